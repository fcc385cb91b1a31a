"""Block-scaled FP8 GEMM (``kernels/block_gemm.py``) against a float64 product of the dequantized
operands, the matrices the emulated GEMM multiplies.

Operands come from ``reference.block_cast`` (pinned bit for bit by its own tests) or are built
directly; the expected values are derived here in float64 from their bytes and scales.

Error bound on the CPU (the kernel under ``TRITON_INTERPRET=1``, fp32 arithmetic throughout), per
output element, with ``u = 2**-24``, ``k_max = min(K, 128)`` and ``n_b = ceil(K/128)`` K blocks:

- each product of two FP8 values is exact in fp32 (at most 4 x 4 significant bits);
- one block sums at most ``k_max`` of them in fp32 in some order: error <= gamma_{k_max - 1} *
  sum |a_k b_k| (Higham, "Accuracy and Stability of Numerical Algorithms", 3.1);
- the block sum is multiplied by ``a``'s and ``b``'s scale inverses: two roundings;
- ``n_b`` block results are added to a zero accumulator: ``n_b - 1`` roundings;
- the emulation's operands are ``fl(q * scale_inv)``, within ``u`` of ``q * scale_inv`` (equal for
  power-of-two scales): two more roundings between what the kernel and the reference multiply.

Together: |out - exact| <= gamma_n * (|A| @ |B|.T) with n = k_max + n_b + 3. The emulated GEMM's
own fp32 bound is gamma_K, so c = n / K <= 1 + 1/128 + 3/K for K >= 128: the same accumulation
bound plus one rounding per K block and three for the scales. A scale applied to the wrong tile
errs by a factor of 2 or more, far outside it.

On a GPU the 128 products of a block are summed by the FP8 tensor cores, whose accumulator keeps
about 13 mantissa bits and truncates (DeepSeek-V3 3.3.2 measures ~14 bits on Hopper): the block
term gamma_{k_max - 1} is replaced by ``TC_BLOCK_REL = 2**-9``, room for 16 truncations of 2**-13
of the block's magnitude per 128-deep step (4 wgmma instructions of 32 products each). The kernel
adds each block's result to the fp32 accumulator on the ordinary cores, so this error does not
grow with K beyond the per-block sum (the DeepSeek promotion interval of 128). Measured on an H200
(bench/bench_block_gemm.py, 2048^3): 2**-15.1 of |A| @ |B|.T on random data, 2**-10.2 on
all-positive data, the worst case for a truncating accumulator.

Rounding the fp32 result (plus bias, one more rounding) to bf16 or fp16 adds half an ulp of the
output: 2**-8 or 2**-11 relative (unit roundoff of 8 and 11 significant bits).
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from dist_quant.kernels import reference as ref
from dist_quant.kernels.block_gemm import block_scaled_gemm_triton
from triton_cases import DEVICE, on_device

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
U = 2.0**-24
TC_BLOCK_REL = 2.0**-9
OUT_REL = {torch.float32: 0.0, torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11}


def _quantized(x: torch.Tensor, block_dim: int, fp8_dtype=E4M3, pow2: bool = True):
    q, s = ref.block_cast(x, fp8_dtype, block_dim=block_dim, use_power_2_scales=pow2)
    return q.contiguous(), s


def _dequantized_f64(q: torch.Tensor, s: torch.Tensor, block_dim: int) -> np.ndarray:
    """fp32 ``q * scale_inv`` per element (what the emulation multiplies), held in float64."""
    rows, cols = q.shape
    per_elem = np.repeat(s.cpu().double().numpy(), 128, axis=1)[:, :cols]
    if block_dim == 2:
        per_elem = np.repeat(per_elem, 128, axis=0)[:rows]
    exact = q.cpu().float().double().numpy() * per_elem  # exact: 4-bit x 24-bit significands
    return exact.astype(np.float32).astype(np.float64)


def _gemm(a, b, out_dtype, bias=None):
    (qa, sa, da), (qb, sb, db) = a, b
    args = on_device(qa, sa, qb, sb) + (() if bias is None else on_device(bias))
    return block_scaled_gemm_triton(
        args[0], args[1], da, args[2], args[3], db, out_dtype=out_dtype,
        bias=None if bias is None else args[4],
    )  # fmt: skip


def _assert_within_bound(out: torch.Tensor, a, b, bias: torch.Tensor | None) -> None:
    a64, b64 = _dequantized_f64(*a), _dequantized_f64(*b)
    k = a64.shape[1]
    n = min(k, 128) + math.ceil(k / 128) + 3
    gamma = n * U / (1 - n * U) + (TC_BLOCK_REL if DEVICE == "cuda" else 0.0)
    bound = gamma * (np.abs(a64) @ np.abs(b64).T)
    exact = a64 @ b64.T
    if bias is not None:
        exact = exact + bias.double().numpy()
        bound = bound + U * (np.abs(exact) + bound)  # fl(acc + bias)
    r = OUT_REL[out.dtype]
    bound = bound * (1 + r) + r * np.abs(exact)
    got = out.cpu().double().numpy()
    assert out.shape == exact.shape and out.device.type == DEVICE
    finite = np.isfinite(exact)
    assert np.array_equal(np.isnan(got), ~finite), "NaN positions differ"
    err = np.abs(got - exact)[finite]
    assert (err <= bound[finite]).all(), f"max excess over the bound {np.max(err - bound[finite])}"


def _x(shape, seed: int, spread: int = 0) -> torch.Tensor:
    """Normal values; ``spread > 0`` scales each 1x128 tile by its own 2**[-spread, spread]."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g)
    if spread:
        tiles = torch.randint(
            -spread, spread + 1, (shape[0], math.ceil(shape[1] / 128)), generator=g
        )
        x = x * torch.exp2(tiles.float()).repeat_interleave(128, dim=1)[:, : shape[1]]
    return x


# (M, N, K), a block_dim, b block_dim, output dtype, bias, fp8 dtypes (a, b), power-of-two scales
CASES = [
    ((7, 131, 200), 1, 2, torch.float32, False, (E4M3, E4M3), True),  # fprop: x @ W.T
    ((7, 131, 200), 1, 2, torch.bfloat16, True, (E4M3, E4M3), True),
    ((130, 70, 385), 1, 1, torch.float32, True, (E4M3, E4M3), True),  # wgrad; 1-wide last block
    ((130, 70, 385), 1, 1, torch.bfloat16, False, (E4M3, E4M3), False),
    ((33, 17, 64), 1, 2, torch.float32, True, (E4M3, E4M3), False),  # K < 128
    ((1, 1, 1), 1, 1, torch.float32, False, (E4M3, E4M3), True),
    ((70, 200, 256), 2, 1, torch.float16, True, (E4M3, E4M3), True),  # 2D x 1D, K = 2 blocks
    ((20, 150, 300), 1, 2, torch.float32, False, (E4M3, E5M2), True),  # HYBRID-like dgrad
    ((20, 150, 300), 1, 1, torch.bfloat16, True, (E5M2, E5M2), True),
]


@pytest.mark.parametrize("shape,da,db,out_dtype,with_bias,fp8,pow2", CASES)
def test_random_operands_match_float64_within_fp32_accumulation_bound(
    shape, da, db, out_dtype, with_bias, fp8, pow2
):
    m, n, k = shape
    a = (*_quantized(_x((m, k), 1) * 3.0, da, fp8[0], pow2), da)
    b = (*_quantized(_x((n, k), 2), db, fp8[1], pow2), db)
    bias = _x((1, n), 3)[0] * 10 if with_bias else None
    _assert_within_bound(_gemm(a, b, out_dtype, bias), a, b, bias)


@pytest.mark.parametrize("da,db", [(1, 2), (1, 1)])
def test_large_dynamic_range_across_tiles_stays_within_bound(da, db):
    # Every 1x128 tile of a (and of b's rows, within each 128x128 block's max) has its own
    # magnitude in 2**[-40, 40]: a scale taken from the wrong row, row group or K block shows.
    m, n, k = 40, 200, 520
    a = (*_quantized(_x((m, k), 4, spread=40), da), da)
    b = (*_quantized(_x((n, k), 5, spread=40), db), db)
    _assert_within_bound(_gemm(a, b, torch.float32), a, b, None)


def test_same_sign_operands_stay_within_bound():
    # All products positive: the partial sums are as large as the bound's |A| @ |B|.T, the worst
    # case for an accumulator that truncates relative to its running magnitude.
    m, n, k = 64, 64, 640
    a = (*_quantized(_x((m, k), 6).abs(), 1), 1)
    b = (*_quantized(_x((n, k), 7).abs(), 2), 2)
    _assert_within_bound(_gemm(a, b, torch.float32), a, b, None)


def _integer_operand(rows: int, k: int, block_dim: int, fp8_dtype, seed: int):
    """Integers in [-4, 4] (exact in both FP8 formats) with scale inverses in 2**[-2, 2]."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(-4, 5, (rows, k), generator=g).float().to(fp8_dtype)
    s_rows = rows if block_dim == 1 else math.ceil(rows / 128)
    s = torch.exp2(torch.randint(-2, 3, (s_rows, math.ceil(k / 128)), generator=g).float())
    return q, s, block_dim


@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    "da,db,fp8", [(1, 2, (E4M3, E4M3)), (1, 1, (E4M3, E5M2)), (2, 1, (E5M2, E5M2))]
)
def test_integer_operands_match_the_exact_product_bit_for_bit(da, db, fp8, out_dtype):
    # |products| <= 16 and power-of-two scales in 2**[-4, 4]: every partial sum (at most
    # 3 blocks x 128 x 16 x 2**4 < 2**15, in steps of 2**-4) is exact in fp32 and in the tensor
    # cores' 13-bit accumulator, so any order of summation gives the exact value, rounded once.
    m, n, k = 150, 140, 300
    a = _integer_operand(m, k, da, fp8[0], seed=8)
    b = _integer_operand(n, k, db, fp8[1], seed=9)
    bias = torch.randint(-40, 41, (n,)).float() / 4
    out = _gemm(a, b, out_dtype, bias)
    exact = _dequantized_f64(*a) @ _dequantized_f64(*b).T + bias.double().numpy()
    expected = torch.from_numpy(exact).float().to(out_dtype)  # exact in fp32: one rounding
    assert out.dtype == out_dtype
    assert torch.equal(out.cpu(), expected)


@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
def test_zero_operand_gives_exactly_the_bias(out_dtype):
    m, n, k = 30, 50, 260
    a = (*_quantized(torch.zeros(m, k), 1), 1)  # zero tiles: scale 1, all-zero bytes
    b = (*_quantized(_x((n, k), 10), 2), 2)
    bias = _x((1, n), 11)[0]
    out = _gemm(a, b, out_dtype, bias)
    assert torch.equal(out.cpu(), bias.expand(m, n).to(out_dtype))
    assert torch.equal(_gemm(a, b, out_dtype).cpu(), torch.zeros(m, n, dtype=out_dtype))


def test_zero_k_blocks_among_nonzero_ones_contribute_nothing():
    m, n, k = 20, 30, 400
    x = _x((m, k), 12)
    x[:, 128:256] = 0.0  # one all-zero K block of a, the rest random
    a = (*_quantized(x, 1), 1)
    b = (*_quantized(_x((n, k), 13), 2), 2)
    _assert_within_bound(_gemm(a, b, torch.float32), a, b, None)


def test_nan_in_a_row_of_a_makes_only_that_output_row_nan():
    m, n, k = 24, 40, 300
    x = _x((m, k), 14)
    x[5, 200] = float("nan")  # its tile keeps scale 1 and the NaN byte (reference.block_cast)
    a = (*_quantized(x, 1), 1)
    b = (*_quantized(_x((n, k), 15), 2), 2)
    out = _gemm(a, b, torch.float32)
    assert torch.isnan(out[5]).all()
    _assert_within_bound(out, a, b, None)  # checks every other row and the NaN positions


def test_empty_k_gives_the_bias_and_empty_m_gives_an_empty_result():
    a = (*_quantized(torch.zeros(3, 0), 1), 1)
    b = (*_quantized(torch.zeros(5, 0), 2), 2)
    bias = torch.arange(5.0)
    assert torch.equal(_gemm(a, b, torch.float32, bias).cpu(), bias.expand(3, 5))
    a0 = (*_quantized(torch.zeros(0, 70), 1), 1)
    b0 = (*_quantized(torch.ones(5, 70), 2), 2)
    assert _gemm(a0, b0, torch.bfloat16).shape == (0, 5)


def _bad_call(case: str):
    qa, sa = _quantized(_x((10, 200), 16), 1)
    qb, sb = _quantized(_x((20, 200), 17), 2)
    args = {"a_data": qa, "a_scale_inv": sa, "a_block_dim": 1, "b_data": qb, "b_scale_inv": sb,
            "b_block_dim": 2, "out_dtype": torch.float32}  # fmt: skip
    if case == "scale shape":
        args["b_block_dim"] = 1  # b's scales are a 128x128 grid, not one per row
    elif case == "k mismatch":
        args["b_data"], args["b_scale_inv"] = _quantized(_x((20, 100), 17), 2)
    elif case == "not fp8":
        args["a_data"] = qa.float()
    elif case == "block dim":
        args["a_block_dim"] = 3
    elif case == "out dtype":
        args["out_dtype"] = torch.float64
    elif case == "bias shape":
        args["bias"] = torch.zeros(19)
    return args


@pytest.mark.parametrize(
    "case,match",
    [
        ("scale shape", "b_scale_inv must be fp32 of shape"),
        ("k mismatch", "needs a \\(M, K\\) and b \\(N, K\\)"),
        ("not fp8", "a_data: fp8_dtype must be"),
        ("block dim", "a_block_dim must be 1"),
        ("out dtype", "out_dtype must be"),
        ("bias shape", "bias must be"),
    ],
)
def test_invalid_arguments_raise_value_error_naming_the_argument(case, match):
    with pytest.raises(ValueError, match=match):
        block_scaled_gemm_triton(**_bad_call(case))


@pytest.mark.gpu
def test_gemm_routes_block_operands_to_the_kernel_on_hopper(monkeypatch):
    from dist_quant import Float8BlockQuantizer
    from dist_quant import gemm as gemm_mod

    if torch.cuda.get_device_capability() < (9, 0):
        pytest.skip("the block-scaled GEMM path needs sm90+")
    calls = []
    routed = gemm_mod.block_scaled_gemm  # the dispatcher gemm() calls for block operands

    def spy(*args, **kwargs):
        calls.append(args[2::3])  # the two block dims
        return routed(*args, **kwargs)

    monkeypatch.setattr(gemm_mod, "block_scaled_gemm", spy)
    m, n, k = 1000, 1500, 2100  # many tiles of the GPU configuration, ragged in all three dims
    x_q = Float8BlockQuantizer(block_scaling_dim=1).quantize(_x((m, k), 18).cuda())
    w_q = Float8BlockQuantizer(block_scaling_dim=2).quantize(_x((n, k), 19).cuda())
    bias = _x((1, n), 20)[0]
    xa, wb = x_q.rowwise_operand(), w_q.rowwise_operand()
    out = gemm_mod.gemm(xa, wb, out_dtype=torch.bfloat16, bias=bias.cuda())
    assert calls == [(1, 2)]
    a, b = (xa.data, xa.scale_inv, 1), (wb.data, wb.scale_inv, 2)
    _assert_within_bound(out, a, b, bias)
