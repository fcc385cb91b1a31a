"""Reference scale formulas (delayed, current, MXFP8, float8 block) re-derived in float64.

Expected fp32 values come from float64 math rounded once to fp32 (exact for a single division or
product of fp32 inputs, see fp8_oracle.f32); expected bytes come from the independent oracle.
"""

import math

import numpy as np
import pytest
import torch
from dist_quant.kernels import reference as ref
from fp8_oracle import E4M3, E5M2, decode, encode, f32, floor_pow2

FLT_MAX = float(np.finfo(np.float32).max)
FORMATS = [(torch.float8_e4m3fn, E4M3), (torch.float8_e5m2, E5M2)]


def _expected_scale(amax: float, fp8_max: float, *, margin: int = 0, pow2: bool = False):
    """None where the contract keeps the previous scale (delayed) / uses 1 (current, block)."""
    if not math.isfinite(amax) or amax <= 0:
        return None
    s = f32(f32(fp8_max / amax) / 2.0**margin)
    s = FLT_MAX if math.isinf(s) else float(s)
    return floor_pow2(s) if pow2 else s


# --- delayed scaling --------------------------------------------------------------------------


def _history(length: int, algo: str, seed: int) -> np.ndarray:
    """(L, 7) fp32 history; column specials sit in row 0 (read by both algos) or, for 'max', the
    oldest row too: 0, inf, NaN, a tiny amax whose scale overflows, and ordinary values."""
    rng = np.random.default_rng(seed)
    h = f32(rng.uniform(0.0, 50.0, size=(length, 7)))
    h[:, 0] = 0.0
    h[-1, 1] = 3.0
    h[0, 1] = math.inf  # after the line above, so that L = 1 still sees inf
    h[0, 2] = math.nan
    h[:, 3] = 1e-40 if algo == "most_recent" else 0.0
    h[0, 3] = 1e-40  # fp32 subnormal: 448 / 1e-40 overflows fp32 -> FLT_MAX
    h[0, 4] = 1e-3
    return f32(h)


@pytest.mark.parametrize("algo", ["max", "most_recent"])
@pytest.mark.parametrize("length", [1, 16, 1024])
@pytest.mark.parametrize("margin", [0, 1, 2, 3])
@pytest.mark.parametrize("fp8_dtype,fmt", FORMATS)
def test_delayed_scaling_update_matches_float64_derivation(algo, length, margin, fp8_dtype, fmt):
    h = _history(length, algo, seed=length + margin)
    old_scale = np.array([1.5, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0])
    history = torch.tensor(h, dtype=torch.float32)
    scale = torch.tensor(old_scale, dtype=torch.float32)
    fp8_max = torch.full((7,), fmt.max)
    ref.delayed_scaling_update(history, scale, fp8_max, margin=margin, algo=algo)

    expected = []
    for j in range(7):
        column = [float(v) for v in h[:, j]]
        a = (
            (math.nan if any(map(math.isnan, column)) else max(column))
            if algo == "max"
            else column[0]
        )
        s = _expected_scale(a, fmt.max, margin=margin)
        expected.append(old_scale[j] if s is None else s)
    np.testing.assert_array_equal(scale.double().numpy(), np.array(expected))
    assert scale[3].item() == FLT_MAX  # tiny amax: the fp32 quotient overflows


@pytest.mark.parametrize("length", [1, 16, 1024])
def test_delayed_scaling_update_rolls_history_in_place_and_keeps_views_valid(length):
    h = _history(length, "max", seed=7)
    history = torch.tensor(h, dtype=torch.float32)
    scale = torch.ones(7)
    amax_view, scale_view = history[0][2:3], scale[4:5]  # what a Float8Quantizer holds
    ptrs = (history.data_ptr(), scale.data_ptr())
    ref.delayed_scaling_update(history, scale, 448.0, margin=0, algo="most_recent")
    assert (history.data_ptr(), scale.data_ptr()) == ptrs
    expected = np.concatenate([h[1:], h[:1]]) if length > 1 else h.copy()
    expected[0] = 0.0  # rows shift up by one: the oldest is dropped, this step's row goes last
    np.testing.assert_array_equal(history.double().numpy(), expected)
    assert scale_view.item() == scale[4].item() == f32(448.0 / h[0, 4])
    amax_view.fill_(9.0)
    assert history[0, 2].item() == 9.0


def test_delayed_scaling_update_rejects_bad_arguments_without_touching_state():
    history, scale = torch.ones(4, 3), torch.ones(3)
    for kwargs, match in (
        ({"margin": 0, "algo": "mean"}, "algo"),
        ({"margin": -1, "algo": "max"}, "margin"),
    ):
        with pytest.raises(ValueError, match=match):
            ref.delayed_scaling_update(history, scale, 448.0, **kwargs)
    with pytest.raises(ValueError, match="scale must have shape"):
        ref.delayed_scaling_update(history, torch.ones(2), 448.0, margin=0, algo="max")
    with pytest.raises(ValueError, match="float32"):
        ref.delayed_scaling_update(history.double(), scale, 448.0, margin=0, algo="max")
    assert history.eq(1).all() and scale.eq(1).all()


@pytest.mark.parametrize("new_algo", ["max", "most_recent"])
@pytest.mark.parametrize("length", [1, 2, 16])
@pytest.mark.parametrize("new_margin", [0, 3])
def test_rescale_from_history_gives_the_last_updates_scale_under_new_settings(
    new_algo, length, new_margin
):
    """After an update (margin 1, "max") rolled the history, a switch to (new_margin, new_algo)
    rescales from what the roll kept: the step just closed (h[0] before the roll) is the newest,
    h[2:] the earlier kept steps; h[1], the oldest, was dropped; L = 1 keeps nothing."""
    h = _history(length, new_algo, seed=31 + length)
    old_scale = np.array([1.5, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0])
    history = torch.tensor(h, dtype=torch.float32)
    scale = torch.tensor(old_scale, dtype=torch.float32)
    ref.delayed_scaling_update(history, scale, 448.0, margin=1, algo="max")
    after_update, rolled = scale.double().numpy().copy(), history.clone()
    ref.rescale_from_history(history, scale, 448.0, margin=new_margin, algo=new_algo)
    assert torch.equal(history.isnan(), rolled.isnan()), "the history is read, never written"
    assert torch.equal(history.nan_to_num(), rolled.nan_to_num())

    expected = []
    for j in range(7):
        newest = float(h[0, j])
        kept = [newest] + [float(v) for v in h[2:, j]] + [0.0]  # + the empty accumulator
        if length == 1:
            a = 0.0  # the roll zeroed the only row
        elif new_algo == "most_recent":
            a = newest
        else:
            a = math.nan if any(map(math.isnan, kept)) else max(kept)
        s = _expected_scale(a, 448.0, margin=new_margin)
        expected.append(after_update[j] if s is None else s)
    np.testing.assert_array_equal(scale.double().numpy(), np.array(expected))


def test_rescale_from_history_rejects_bad_arguments_without_touching_state():
    history, scale = torch.ones(4, 3), torch.full((3,), 2.0)
    with pytest.raises(ValueError, match="rescale_from_history: algo"):
        ref.rescale_from_history(history, scale, 448.0, margin=0, algo="mean")
    with pytest.raises(ValueError, match="fp8_max_per_slot must hold 1 or 3"):
        ref.rescale_from_history(history, scale, torch.ones(2), margin=0, algo="max")
    assert history.eq(1).all() and scale.eq(2).all()


# --- current scaling --------------------------------------------------------------------------

AMAXES = [0.0, 1e-45, 1e-40, 1e-30, 0.0137, 1.0, 3.3, 448.0, 1e5, 3e38, math.inf, math.nan]


@pytest.mark.parametrize("pow2", [False, True])
@pytest.mark.parametrize("epsilon", [0.0, 1e-12, 0.5])
@pytest.mark.parametrize("fp8_dtype,fmt", FORMATS)
def test_current_scale_matches_float64_derivation(pow2, epsilon, fp8_dtype, fmt):
    amax = torch.tensor(AMAXES, dtype=torch.float32)
    scale, scale_inv = ref.current_scale(
        amax, fp8_dtype, amax_epsilon=epsilon, use_power_2_scales=pow2
    )
    expected = []
    for a in f32(np.array(AMAXES)):
        floored = a if math.isnan(a) else max(float(a), float(f32(epsilon)))
        s = _expected_scale(floored, fmt.max, pow2=pow2)
        expected.append(1.0 if s is None else s)
    np.testing.assert_array_equal(scale.double().numpy(), expected)
    np.testing.assert_array_equal(scale_inv.double().numpy(), f32(1.0 / np.array(expected)))
    assert scale.dtype == scale_inv.dtype == torch.float32 and scale.shape == amax.shape


def test_current_scale_of_a_0dim_amax_is_0dim():
    scale, scale_inv = ref.current_scale(torch.tensor(2.0), torch.float8_e4m3fn)
    assert scale.shape == scale_inv.shape == () and scale.item() == 224.0


# --- MXFP8 ------------------------------------------------------------------------------------


def _expected_e8m0(block_amax: float, fp8_max: float) -> int:
    """Exact RCEIL from the definition, in float64 (every 2**(E - 127) * fp8_max and every fp32
    amax is exact there): the smallest E in [0, 254] with 2**(E - 127) * fp8_max >= amax."""
    if not math.isfinite(block_amax):
        return 255
    return next(e for e in range(255) if 2.0 ** (e - 127) * fp8_max >= block_amax)


def _mx_input(rows: int, cols: int, dtype: torch.dtype) -> torch.Tensor:
    gen = torch.Generator().manual_seed(rows * 1000 + cols)
    mags = torch.exp2(torch.randint(-20, 20, (rows, 1), generator=gen).float())
    x = torch.randn(rows, cols, generator=gen) * mags
    if rows > 4 and cols > 40:
        x[1, :32] = 0.0  # all-zero block -> E = 0
        x[2, 33] = math.inf  # non-finite block -> E = 255, NaN data
        x[3, 5] = 448.0 * 2.0**-3  # power-of-two v -> no round-up
        x[4, 32:64] = 1e-41  # amax below 2**-127 * fp8_max: E = 0 (a subnormal v would say 1)
    return x.to(dtype)


@pytest.mark.parametrize("shape", [(5, 70), (33, 64), (1, 31), (0, 40), (6, 0)])
@pytest.mark.parametrize("columnwise", [False, True])
@pytest.mark.parametrize("fp8_dtype,fmt", FORMATS)
def test_mxfp8_cast_matches_rceil_exponents_and_oracle_bytes(shape, columnwise, fp8_dtype, fmt):
    x = _mx_input(*shape, torch.float32)
    q, e8m0 = ref.mxfp8_cast(x, fp8_dtype, columnwise=columnwise)
    x64 = x.double().numpy()
    oriented = x64.T if columnwise else x64
    r, c = oriented.shape
    nblocks = -(-c // 32)
    assert q.shape == ((r, c) if columnwise else x.shape) and e8m0.shape == (r, nblocks)
    assert e8m0.dtype == torch.uint8
    expected_e = np.zeros((r, nblocks), dtype=np.int64)
    expected_q = np.zeros((r, c), dtype=np.uint8)
    for i in range(r):
        for b in range(nblocks):
            block = oriented[i, b * 32 : (b + 1) * 32]
            a = math.nan if np.isnan(block).any() else float(np.abs(block).max())
            e = _expected_e8m0(a, fmt.max)
            expected_e[i, b] = e
            mult = math.nan if e == 255 else 2.0 ** (127 - e)
            expected_q[i, b * 32 : (b + 1) * 32] = encode(fmt, f32(block * mult))
    np.testing.assert_array_equal(e8m0.numpy(), expected_e)
    got = q.view(torch.uint8).numpy().reshape(r, c)
    nan_rows = np.repeat(expected_e == 255, 32, axis=1)[:, :c]
    np.testing.assert_array_equal(got[~nan_rows], expected_q[~nan_rows])
    assert np.isnan(q.float().numpy().reshape(r, c)[nan_rows]).all()


@pytest.mark.parametrize("fp8_dtype,fmt", FORMATS)
def test_mxfp8_exponent_is_exact_rceil_at_the_bottom_of_the_e8m0_range(fp8_dtype, fmt):
    """Block amaxes around 2**-127 * fp8_max and 2**-126 * fp8_max, where amax / fp8_max is an
    fp32 subnormal: E is 0 up to and including the first threshold, 1 above it up to the second,
    then 2; the data never saturates there (every scaled value stays within fp8_max)."""
    t0, t1 = fmt.max * 2.0**-127, fmt.max * 2.0**-126  # exact in fp32 and float64

    def step(t: float, direction: float) -> float:  # the fp32 neighbour of t
        return float(np.nextafter(np.float32(t), np.float32(direction)))

    tiny = float(np.float32(1e-41))
    amaxes = [0.0, 2.0**-149, tiny, step(t0, 0), t0, step(t0, 1), step(t1, 0), t1, step(t1, 1)]
    x = torch.tensor([[a] * 32 for a in amaxes], dtype=torch.float32)
    assert [float(v) for v in x[:, 0]] == amaxes  # each amax is an fp32 value
    q, e8m0 = ref.mxfp8_cast(x, fp8_dtype)
    assert e8m0[:, 0].tolist() == [_expected_e8m0(a, fmt.max) for a in amaxes]
    assert e8m0[:, 0].tolist() == [0, 0, 0, 0, 0, 1, 1, 1, 2]
    deq = ref.mxfp8_dequantize(q, e8m0).double()
    scaled = [a * 2.0 ** (127 - e) for a, e in zip(amaxes, e8m0[:, 0].tolist())]
    assert all(s <= fmt.max for s in scaled)
    codes = encode(fmt, f32(np.array(scaled)))
    expected = [decode(fmt, int(c)) * 2.0 ** (e - 127) for c, e in zip(codes, e8m0[:, 0].tolist())]
    np.testing.assert_array_equal(deq[:, 0].numpy(), expected)


@pytest.mark.parametrize("in_dtype", [torch.bfloat16, torch.float16])
def test_mxfp8_cast_of_low_precision_input_equals_cast_of_its_fp32_values(in_dtype):
    x = _mx_input(4, 50, in_dtype)
    q_lp, e_lp = ref.mxfp8_cast(x, torch.float8_e4m3fn)
    q_32, e_32 = ref.mxfp8_cast(x.float(), torch.float8_e4m3fn)
    assert torch.equal(e_lp, e_32) and torch.equal(q_lp.view(torch.uint8), q_32.view(torch.uint8))


def test_mxfp8_e8m0_codes_decode_to_powers_of_two_and_255_to_nan():
    codes = torch.arange(256, dtype=torch.uint8).reshape(256, 1)
    q = torch.ones(256, 32).to(torch.float8_e4m3fn)
    out = ref.mxfp8_dequantize(q, codes).double().numpy()
    expected = np.array([2.0 ** (e - 127) for e in range(255)])  # 2**-127 is an fp32 subnormal
    np.testing.assert_array_equal(out[:255], np.repeat(expected[:, None], 32, axis=1))
    assert np.isnan(out[255]).all()


@pytest.mark.parametrize("shape", [(2, 3, 45), (70,), (37, 66)])
def test_mxfp8_dequantize_inverts_both_layouts_to_the_original_view(shape):
    x = torch.randn(shape, generator=torch.Generator().manual_seed(3)) * 10
    rows, cols = math.prod(shape[:-1]), shape[-1]
    q, e = ref.mxfp8_cast(x, torch.float8_e4m3fn)
    qc, ec = ref.mxfp8_cast(x, torch.float8_e4m3fn, columnwise=True)
    deq = ref.mxfp8_dequantize(q, e, dtype=torch.bfloat16)
    deq_c = ref.mxfp8_dequantize(qc, ec, columnwise=True)
    assert deq.shape == x.shape and deq.dtype == torch.bfloat16 and deq_c.shape == (rows, cols)
    for data, codes, transpose, out in ((q, e, False, deq), (qc, ec, True, deq_c)):
        r, c = codes.shape[0], data.shape[-1]
        block_scale = np.repeat(2.0 ** (codes.numpy().astype(np.float64) - 127), 32, axis=1)
        block_scale = block_scale[:, :c]
        expected = data.float().double().numpy().reshape(r, c) * block_scale
        if transpose:
            expected, block_scale = expected.T, block_scale.T
        torch.testing.assert_close(
            out, torch.tensor(expected).reshape(out.shape).to(out.dtype), rtol=0, atol=0
        )
        # Within half an E4M3 ulp of the original: 2**-4 relative in the normal range, half the
        # smallest subnormal step (2**-10 in the scaled domain) below it.
        x64 = x.double().numpy().reshape(rows, cols)
        bound = np.maximum(np.abs(x64) * 2.0**-4, block_scale * 2.0**-10)
        assert (np.abs(expected - x64) <= bound).all()


# --- float8 block scaling ---------------------------------------------------------------------


def _block_input(rows: int, cols: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(rows + 7 * cols)
    x = torch.randn(rows, cols, generator=gen) * torch.exp2(
        torch.randint(-8, 8, (rows, 1), generator=gen).float()
    )
    if rows > 130 and cols > 130:
        x[:128, :128] = 0.0  # zero tile -> scale 1
        x[129, 130] = math.nan  # non-finite tile -> scale 1
    return x


@pytest.mark.parametrize("shape", [(3, 300), (131, 260), (256, 128), (0, 10), (4, 0)])
@pytest.mark.parametrize("block_dim", [1, 2])
@pytest.mark.parametrize("pow2", [True, False])
@pytest.mark.parametrize("in_dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_block_cast_scales_per_tile_match_float64_derivation(shape, block_dim, pow2, in_dtype):
    fp8_dtype, fmt = FORMATS[0] if block_dim == 1 else FORMATS[1]
    x = _block_input(*shape).to(in_dtype)
    q, scale_inv = ref.block_cast(x, fp8_dtype, block_dim=block_dim, use_power_2_scales=pow2)
    rows, cols = shape
    height = 1 if block_dim == 1 else 128
    grid = (-(-rows // height), -(-cols // 128))
    assert q.shape == x.shape and scale_inv.shape == grid and scale_inv.dtype == torch.float32
    x64 = x.double().numpy()
    expected_q = np.zeros(shape, dtype=np.uint8)
    expected_inv = np.zeros(grid)
    for ti in range(grid[0]):
        for tj in range(grid[1]):
            tile_idx = np.s_[ti * height : (ti + 1) * height, tj * 128 : (tj + 1) * 128]
            tile = x64[tile_idx]
            a = math.nan if np.isnan(tile).any() else float(np.abs(tile).max())
            s = _expected_scale(a, fmt.max, pow2=pow2)
            s = 1.0 if s is None else s
            expected_inv[ti, tj] = f32(1.0 / s)
            expected_q[tile_idx] = encode(fmt, f32(tile * s))
    np.testing.assert_array_equal(scale_inv.double().numpy(), expected_inv)
    got = q.view(torch.uint8).numpy()
    finite = ~np.isnan(x64)
    np.testing.assert_array_equal(got[finite], expected_q[finite])
    assert np.isnan(q.float().numpy()[~finite]).all()


@pytest.mark.parametrize("block_dim", [1, 2])
def test_block_dequantize_multiplies_each_tile_by_its_scale_inv(block_dim):
    x = torch.randn(2, 70, 200) * 5
    q, scale_inv = ref.block_cast(x, torch.float8_e4m3fn, block_dim=block_dim)
    out = ref.block_dequantize(q, scale_inv, block_dim=block_dim)
    assert out.shape == x.shape
    inv = scale_inv.double().numpy()
    q64 = q.float().double().numpy().reshape(140, 200)
    for i, j in [(0, 0), (69, 127), (70, 128), (139, 199)]:
        ti = i if block_dim == 1 else i // 128
        assert out.reshape(140, 200)[i, j].item() == f32(q64[i, j] * inv[ti, j // 128])
    with pytest.raises(ValueError, match="scale_inv must have shape"):
        ref.block_dequantize(q, scale_inv[:, :1], block_dim=block_dim)
    with pytest.raises(ValueError, match="block_dim"):
        ref.block_cast(x, torch.float8_e4m3fn, block_dim=3)
