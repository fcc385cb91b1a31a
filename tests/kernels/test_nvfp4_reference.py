"""The NVFP4 reference (kernels/reference_nvfp4.py) against the float64 re-derivation of the contract
(nvfp4_oracle.py), bit for bit, and against the contract's own examples (ties, special amaxes,
nibble order, Philox's published known answers)."""

import numpy as np
import pytest
import torch
from dist_quant.kernels import reference_nvfp4 as ref
from nvfp4_oracle import FLT_MAX, global_scales, quantize, r32
from triton_cases import random_values

from dist_quant import kernels as K

INF, NAN = float("inf"), float("nan")


def _assert_cast_matches_oracle(x: torch.Tensor, amax: float, block_2d: bool = False) -> None:
    out = ref.quantize_nvfp4(x, amax, block_2d=block_2d)
    packed, sb, s_dec = quantize(x, amax, block_2d=block_2d)
    np.testing.assert_array_equal(out.data.numpy(), packed)
    scales = out.scales.double().numpy()
    np.testing.assert_array_equal(np.isnan(scales), np.isnan(sb))
    np.testing.assert_array_equal(scales[~np.isnan(sb)], sb[~np.isnan(sb)])
    assert out.s_dec.dtype == torch.float32 and out.s_dec.shape == ()
    assert out.s_dec.item() == s_dec


@pytest.mark.parametrize("block_2d", [False, True])
@pytest.mark.parametrize("shape", [(1, 16), (7, 48), (37, 160)])
def test_cast_matches_the_float64_rederivation_bit_for_bit(shape, block_2d):
    x = random_values(shape, torch.float32, seed=sum(shape)) * 2.0**-20  # blocks over 2**-60..2**20
    x.view(-1)[5] = -0.0
    x.view(-1)[-3] = 1e-44  # an fp32 subnormal
    for amax in (float(x.abs().max()), 1.0, 3.0e38, 1e-30):  # the true one, and too small/large
        _assert_cast_matches_oracle(x, amax, block_2d)
    _assert_cast_matches_oracle(x.bfloat16(), float(x.bfloat16().abs().max()), block_2d)


def test_blocks_holding_nan_or_inf_match_the_rederivation():
    x = random_values((4, 64), torch.float32, seed=3)
    x[0, 3], x[1, 17], x[2, 40], x[3, 0] = NAN, INF, -INF, NAN
    for amax in (NAN, INF, 100.0):
        _assert_cast_matches_oracle(x, amax)
        _assert_cast_matches_oracle(x, amax, block_2d=True)
    out = ref.quantize_nvfp4(x, 100.0)
    assert out.data[0, 1] >> 4 == 7  # element 3, NaN, encodes as +6; its block's scale is NaN
    assert out.scales[0, 0].float().isnan() and out.scales[1, 1].float() == 448.0


def test_round_to_nearest_ties_go_to_the_even_code():
    # amax 2688 gives S_enc = 1 and a block amax of 6 gives s_b = 1, so x is the value rounded.
    ties = [0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0]
    expected = [0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0]
    row = torch.tensor([6.0, *ties, -6.0, *(-t for t in ties)])
    out = ref.quantize_nvfp4(row.reshape(1, 16), 2688.0)
    assert out.scales.float().tolist() == [[1.0]] and out.s_dec.item() == 1.0
    values = ref.dequantize_nvfp4(*out, dtype=torch.float32)[0]
    assert values.tolist() == [6.0, *expected, -6.0, *(-e for e in expected)]
    # one fp32 ulp either side of each tie rounds to the nearer value
    above = torch.nextafter(torch.tensor(ties), torch.tensor(INF))
    below = torch.nextafter(torch.tensor(ties), torch.tensor(0.0))
    for side, want in (
        (above, [0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]),
        (below, [0, 0.5, 1, 1.5, 2, 3, 4]),
    ):
        x = torch.cat([torch.tensor([6.0]), side, torch.tensor([0.0] * 8)]).reshape(1, 16)
        got = ref.dequantize_nvfp4(*ref.quantize_nvfp4(x, 2688.0), dtype=torch.float32)
        assert got[0, 1:8].tolist() == want


@pytest.mark.parametrize(
    "amax,s_enc",
    [(0.0, 1.0), (INF, 1.0), (NAN, FLT_MAX), (1e-40, FLT_MAX), (2688.0, 1.0), (3.0, r32(896.0))],
)
def test_global_scales_of_zero_inf_nan_and_tiny_amax(amax, s_enc):
    enc, dec = K.nvfp4_global_scales(torch.tensor(amax))
    assert enc.dtype == dec.dtype == torch.float32 and enc.shape == dec.shape == ()
    assert enc.item() == float(s_enc) == global_scales(amax)[0]
    assert dec.item() == global_scales(amax)[1] == float(r32(1.0 / float(s_enc)))


def test_all_zero_tensor_with_amax_zero_quantizes_to_zero_bytes_and_scales():
    out = ref.quantize_nvfp4(torch.zeros(3, 32), 0.0)
    assert out.data.eq(0).all() and out.scales.float().eq(0).all() and out.s_dec.item() == 1.0
    assert ref.dequantize_nvfp4(*out, dtype=torch.bfloat16).eq(0).all()


def test_packing_puts_the_even_element_in_the_low_nibble():
    x = torch.zeros(1, 16)
    x[0, :4] = torch.tensor([0.5, 6.0, -1.0, 3.0])
    x[0, 15] = -0.1  # a negative value that rounds to zero keeps its sign: -0, code 8
    out = ref.quantize_nvfp4(x, 2688.0)
    assert out.data[0].tolist() == [0x71, 0x5A, 0, 0, 0, 0, 0, 0x80]


def test_dequantize_is_value_times_block_scale_times_s_dec_in_fp32():
    x = random_values((9, 64), torch.float32, seed=5)
    out = ref.quantize_nvfp4(x, float(x.abs().max()) * 1.7)
    codes = ref.unpack_e2m1(out.data).numpy()
    grid = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6])
    values = np.where(codes & 8, -1.0, 1.0) * grid[codes & 7]
    expected = r32(values * np.repeat(out.scales.double().numpy(), 16, axis=1) * out.s_dec.item())
    for dtype in (torch.float32, torch.bfloat16):
        got = ref.dequantize_nvfp4(*out, dtype=dtype)
        assert got.dtype == dtype
        np.testing.assert_array_equal(
            got.double().numpy(), torch.tensor(expected).to(dtype).double()
        )


def test_2d_blocks_make_the_columnwise_cast_the_transpose_of_the_rowwise_one():
    w = random_values((48, 80), torch.float32, seed=6)
    amax = float(w.abs().max())
    rows = ref.quantize_nvfp4(w, amax, block_2d=True)
    cols = ref.quantize_nvfp4(w.t().contiguous(), amax, block_2d=True)
    assert torch.equal(ref.unpack_e2m1(rows.data).t(), ref.unpack_e2m1(cols.data))
    per_element_t = cols.scales.float().repeat_interleave(16, 1).t()  # (48, 80)
    assert torch.equal(rows.scales.float().repeat_interleave(16, 1), per_element_t)


def _hadamard_signed() -> np.ndarray:
    i = np.arange(16)
    h = np.array([[(-1) ** bin(r & c).count("1") for c in i] for r in i], dtype=np.float64)
    return 0.25 * h @ np.diag(ref.NVFP4_RHT_SIGNS)


def test_rht_is_the_signed_orthonormal_hadamard_matrix_exactly_on_exact_sums():
    x = torch.randint(-1000, 1000, (5, 3, 32)).float()  # every partial sum is exact in fp32
    y = ref.random_hadamard_transform(x)
    groups = x.double().numpy().reshape(-1, 16)
    np.testing.assert_array_equal(y.double().numpy().reshape(-1, 16), groups @ _hadamard_signed().T)


def test_rht_rounds_in_its_stated_butterfly_order():
    # an independent fp32 walk of the stated order: partner index i ^ h, h = 1, 2, 4, 8
    x = random_values((6, 32), torch.float32, seed=7)
    v = x.numpy().reshape(-1, 16) * np.array(ref.NVFP4_RHT_SIGNS, dtype=np.float32)
    for h in (1, 2, 4, 8):
        idx = np.arange(16)
        partner = v[:, idx ^ h]
        v = np.where((idx & h) == 0, v + partner, partner - v).astype(np.float32)
    expected = (v * np.float32(0.25)).reshape(6, 32)
    np.testing.assert_array_equal(ref.random_hadamard_transform(x).numpy(), expected)
    # and it is orthonormal: applying the transpose brings x back to within fp32 rounding
    back = ref.random_hadamard_transform(x).double().numpy().reshape(-1, 16) @ _hadamard_signed()
    np.testing.assert_allclose(back.reshape(6, 32), x.double().numpy(), rtol=0, atol=1e-6 * 2.0**40)


def test_philox_matches_the_published_known_answers():
    # Random123's kat_vectors for philox4x32_10
    cases = [
        ((0, 0, 0, 0), (0, 0), (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8)),
        ((2**32 - 1,) * 4, (2**32 - 1,) * 2, (0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD)),
        (
            (0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344),
            (0xA4093822, 0x299F31D0),
            (0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1),
        ),
    ]
    for counter, key, expected in cases:
        words = ref.philox4x32(*(torch.tensor([c]) for c in counter), *key)
        assert tuple(int(w) for w in words) == expected


def test_stochastic_rounding_follows_its_random_bits_and_is_reproducible():
    x = random_values((8, 64), torch.float32, seed=8)
    amax = float(x.abs().max())
    out = ref.quantize_nvfp4(x, amax, stochastic=True, seed=2**40 + 3, offset=2**33 + 5)
    again = ref.quantize_nvfp4(x, amax, stochastic=True, seed=2**40 + 3, offset=2**33 + 5)
    other = ref.quantize_nvfp4(x, amax, stochastic=True, seed=2**40 + 3, offset=2**33 + 6)
    assert torch.equal(out.data, again.data) and not torch.equal(out.data, other.data)
    nearest = ref.quantize_nvfp4(x, amax)
    assert torch.equal(out.scales.view(torch.uint8), nearest.scales.view(torch.uint8))
    # re-derive each decision in float64 from the element's 24 random bits
    _, sb, s_dec = quantize(x, amax)
    with np.errstate(divide="ignore"):  # a zero block scale: inf, capped
        enc = np.minimum(r32(1.0 / r32(sb * s_dec)), FLT_MAX)
    v = r32(x.double().numpy().reshape(8, 4, 16) * enc[..., None]).reshape(8, 64)
    mag = np.minimum(np.abs(v), 6.0)
    grid = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6])
    lo_idx = np.searchsorted(grid, mag, side="right") - 1
    frac = (mag - grid[lo_idx]) / (grid[np.minimum(lo_idx + 1, 7)] - grid[lo_idx] + (lo_idx == 7))
    u = ref.philox_uniform24(8 * 64, 2**40 + 3, 2**33 + 5).double().numpy().reshape(8, 64)
    code = lo_idx + (u < frac * 2**24) | (np.signbit(v) << 3)
    np.testing.assert_array_equal(ref.unpack_e2m1(out.data).numpy(), code)


def test_stochastic_rounding_is_unbiased_over_seeds():
    # 0.3 lies between 0 and 0.5: rounds up with probability 0.6; 2.75 between 2 and 3 (0.75)
    x = torch.tensor([6.0, 0.3, 2.75, -0.3] + [0.0] * 12).reshape(1, 16).expand(512, 16)
    out = ref.quantize_nvfp4(x.contiguous(), 2688.0, stochastic=True, seed=11)
    mean = ref.dequantize_nvfp4(*out, dtype=torch.float64).mean(0)
    # 512 draws: the binomial standard error is at most 0.5 * sqrt(0.25 / 512) = 0.011
    assert abs(mean[1] - 0.3) < 0.05 and abs(mean[2] - 2.75) < 0.1 and abs(mean[3] + 0.3) < 0.05
    assert mean[0] == 6.0 and mean[4:].eq(0).all()  # values on the grid never move


def _gemm_float64(a: ref.NVFP4Cast, b: ref.NVFP4Cast, amax_a: float, amax_b: float):
    av = ref.dequantize_nvfp4(a.data, a.scales, 1.0, dtype=torch.float64).numpy()
    bv = ref.dequantize_nvfp4(b.data, b.scales, 1.0, dtype=torch.float64).numpy()
    terms = np.einsum("mbk,nbk->mnb", av.reshape(len(av), -1, 16), bv.reshape(len(bv), -1, 16))
    alpha = float(r32(float(r32(amax_a * amax_b)) / 7225344.0))
    return terms, alpha


@pytest.mark.parametrize("k", [16, 32, 512])
def test_gemm_is_exact_block_terms_accumulated_in_fp32_times_alpha(k):
    a_hp = random_values((5, k), torch.float32, seed=k) * 2.0**-30
    b_hp = random_values((3, k), torch.float32, seed=k + 1) * 2.0**-30
    amax_a, amax_b = float(a_hp.abs().max()), float(b_hp.abs().max())
    a, b = ref.quantize_nvfp4(a_hp, amax_a), ref.quantize_nvfp4(b_hp, amax_b, block_2d=True)
    out = K.nvfp4_gemm((a.data, a.scales, torch.tensor(amax_a)), (b.data, b.scales, amax_b))
    terms, alpha = _gemm_float64(a, b, amax_a, amax_b)
    assert out.dtype == torch.float32 and out.shape == (5, 3)
    exact = terms.sum(-1)
    accumulation = (k // 16) * 2.0**-24 * np.abs(terms).sum(-1)
    bound = (accumulation + 2.0**-24 * np.abs(exact)) * alpha
    if k <= 32:  # at most one rounding in the accumulation: bit exact
        np.testing.assert_array_equal(out.double().numpy(), r32(r32(exact) * alpha))
    else:  # fp32 accumulation over K/16 terms: within the bound of its roundings
        assert (np.abs(out.double().numpy() - exact * alpha) <= bound).all()
    # one matmul of the block-scaled values: the same terms in another order, the same bound
    unordered = K.nvfp4_gemm((a.data, a.scales, amax_a), (b.data, b.scales, amax_b), ordered=False)
    assert (np.abs(unordered.double().numpy() - exact * alpha) <= bound).all()


@pytest.mark.parametrize("k", [16, 512])
def test_gemm_of_one_transformed_operand_is_the_product_with_the_transform_undone(k):
    # the input's wgrad copy without the transform, the output gradient's with it: the block
    # terms of the dequantized operands (transform undone in float64) are exact in fp32, and the
    # GEMM is their fp32 sum in block order, times alpha, bit for bit
    a_hp = random_values((5, k), torch.float32, seed=k + 2)
    b_hp = random_values((3, k), torch.float32, seed=k + 3)
    a_t = ref.random_hadamard_transform(a_hp)
    amax_a, amax_b = float(a_t.abs().max()), float(b_hp.abs().max())
    a, b = ref.quantize_nvfp4(a_t, amax_a), ref.quantize_nvfp4(b_hp, amax_b)
    av = ref.dequantize_nvfp4(a.data, a.scales, 1.0, dtype=torch.float64).numpy()
    av = (av.reshape(-1, 16) @ _hadamard_signed()).reshape(5, -1, 16)  # the transform undone
    bv = ref.dequantize_nvfp4(b.data, b.scales, 1.0, dtype=torch.float64).numpy()
    terms = np.einsum("mbk,nbk->mnb", av, bv.reshape(3, -1, 16))
    np.testing.assert_array_equal(r32(terms), terms)  # every term exact in fp32
    acc = np.zeros((5, 3))
    for blk in range(k // 16):
        acc = r32(acc + terms[:, :, blk])
    alpha = float(r32(float(r32(amax_a * amax_b)) / 7225344.0))
    want = r32(acc * alpha)
    out = K.nvfp4_gemm((a.data, a.scales, amax_a, True), (b.data, b.scales, amax_b, False))
    np.testing.assert_array_equal(out.double().numpy(), want)
    swapped = K.nvfp4_gemm((b.data, b.scales, amax_b, False), (a.data, a.scales, amax_a, True))
    np.testing.assert_array_equal(swapped.double().numpy(), want.T)


def test_bad_shapes_and_arguments_are_refused_naming_the_cause():
    with pytest.raises(ValueError, match=r"multiple of 16, got shape \(4, 24\)"):
        ref.quantize_nvfp4(torch.ones(4, 24), 1.0)
    with pytest.raises(ValueError, match=r"2-D \(M, K\).*\(2, 2, 16\)"):
        ref.quantize_nvfp4(torch.ones(2, 2, 16), 1.0)
    with pytest.raises(ValueError, match="seed must be an int"):
        ref.quantize_nvfp4(torch.ones(4, 16), 1.0, stochastic=True, seed=-1)
    with pytest.raises(ValueError, match=r"last dim must be a multiple of 16.*\(3, 8\)"):
        ref.random_hadamard_transform(torch.ones(3, 8))
    with pytest.raises(ValueError, match="sign_vector"):
        ref.random_hadamard_transform(torch.ones(3, 16), sign_vector=(1,) * 15)
    a = ref.quantize_nvfp4(torch.ones(2, 32), 1.0)
    b = ref.quantize_nvfp4(torch.ones(2, 16), 1.0)
    with pytest.raises(ValueError, match="a has K = 32 and b has K = 16"):
        ref.nvfp4_gemm((a.data, a.scales, 1.0), (b.data, b.scales, 1.0))
    with pytest.raises(ValueError, match=r"scales of shape \(2, 2\)"):
        ref.dequantize_nvfp4(a.data, b.scales, a.s_dec, dtype=torch.float32)
