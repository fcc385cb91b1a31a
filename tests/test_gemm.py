"""gemm(a, b) = a @ b.T: the emulated FP8 path against a float64 matmul of the dequantized operands.

The float64 reference takes each operand's fp32 dequantized values (FP8 value times scale, rounded
once to fp32: the operands the emulation multiplies) and multiplies them exactly enough that the
only difference left is the fp32 accumulation. Its error bound (Higham, "Accuracy and Stability of
Numerical Algorithms", 3.1): |fl(a.b) - a.b| <= gamma_K * sum_k |a_k b_k|, gamma_K = K u / (1 - K u)
with u = 2**-24 for fp32, whatever the summation order the backend picks.
"""

import re

import numpy as np
import pytest
import torch

from dist_quant import (
    Float8BlockQuantizer,
    Float8CurrentScalingQuantizer,
    MXFP8Quantizer,
)
from dist_quant.gemm import gemm
from dist_quant.tensor import GemmOperand

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2


def f32(x):
    return np.asarray(x, dtype=np.float64).astype(np.float32).astype(np.float64)


def dequantized_f64(op: GemmOperand | torch.Tensor) -> np.ndarray:
    """The fp32 matrix an operand stands for, derived from its bytes and scales in float64."""
    if isinstance(op, torch.Tensor):
        return op.double().numpy()
    r, c = op.shape
    values = op.data.float().double().numpy()
    scale = op.scale_inv.double().numpy()
    if op.scaling == "tensor":
        per_elem = np.full((r, c), scale.reshape(()))
    elif op.scaling == "mxfp8":
        per_elem = np.repeat(2.0 ** (scale - 127), 32, axis=1)[:, :c]
    else:
        height = 1 if op.scaling == "block1d" else 128
        per_elem = np.repeat(np.repeat(scale, height, axis=0), 128, axis=1)[:r, :c]
    return f32(values * per_elem)


def assert_fp32_accumulation_close(out: torch.Tensor, a, b, *, rel: float | None = None) -> None:
    """|out - a @ b.T| <= gamma_K * (|a| @ |b|.T); ``rel`` replaces gamma_K where given."""
    a64, b64 = dequantized_f64(a), dequantized_f64(b)
    exact = a64 @ b64.T
    k = a64.shape[1]
    u = 2.0**-24
    gamma = k * u / (1 - k * u) if rel is None else rel
    bound = gamma * (np.abs(a64) @ np.abs(b64).T)
    err = np.abs(out.double().numpy() - exact)
    assert (err <= bound).all(), f"max excess {np.max(err - bound)}"


def _x(shape, seed, scale=1.0):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed)) * scale


@pytest.mark.parametrize(
    "qa,qb",
    [
        (Float8CurrentScalingQuantizer(E4M3), Float8CurrentScalingQuantizer(E4M3)),
        (Float8CurrentScalingQuantizer(E4M3), Float8CurrentScalingQuantizer(E5M2)),  # HYBRID
        (Float8CurrentScalingQuantizer(E5M2), Float8CurrentScalingQuantizer(E5M2)),
        (MXFP8Quantizer(), MXFP8Quantizer()),
        (Float8BlockQuantizer(block_scaling_dim=1), Float8BlockQuantizer(block_scaling_dim=2)),
    ],
    ids=["e4m3", "hybrid", "e5m2", "mxfp8", "block"],
)
@pytest.mark.parametrize("operands", ["rowwise", "columnwise"])
def test_emulated_gemm_matches_float64_matmul_of_dequantized_operands(qa, qb, operands):
    # Ragged on purpose: K = 200 is not a multiple of 32 or 128, M and N are odd.
    m, k, n = 7, 200, 131
    if operands == "rowwise":
        a = qa.quantize(_x((m, k), 1, 4.0)).rowwise_operand()  # (M, K)
        b = qb.quantize(_x((n, k), 2, 0.02)).rowwise_operand()  # (N, K)
    else:
        a = qa.quantize(_x((k, m), 1, 4.0)).columnwise_operand()  # (M, K) from a (K, M) tensor
        b = qb.quantize(_x((k, n), 2, 0.02)).columnwise_operand()
    out = gemm(a, b, out_dtype=torch.float32)
    assert out.shape == (m, n) and out.dtype == torch.float32
    assert_fp32_accumulation_close(out, a, b)


def test_gemm_mixes_a_plain_operand_with_a_quantized_one_in_fp32():
    a = _x((5, 64), 3).to(torch.bfloat16)
    b = Float8CurrentScalingQuantizer(E4M3).quantize(_x((9, 64), 4)).rowwise_operand()
    out = gemm(a, b, out_dtype=torch.float32)
    assert_fp32_accumulation_close(out, a, b)
    out_bf16 = gemm(a, b, out_dtype=torch.bfloat16)
    assert out_bf16.dtype == torch.bfloat16
    torch.testing.assert_close(out_bf16, out.to(torch.bfloat16), rtol=0, atol=0)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_plain_operands_of_one_dtype_multiply_in_that_dtype(dtype):
    a, b = _x((6, 48), 5).to(dtype), _x((10, 48), 6).to(dtype)
    out = gemm(a, b, out_dtype=torch.float32)
    torch.testing.assert_close(out, torch.matmul(a, b.t()).float(), rtol=0, atol=0)


def test_plain_operands_of_different_dtypes_multiply_in_fp32():
    a, b = _x((6, 48), 5).to(torch.bfloat16), _x((10, 48), 6).to(torch.float16)
    out = gemm(a, b, out_dtype=torch.float32)
    assert_fp32_accumulation_close(out, a.float(), b.float())


def test_empty_dimensions_give_an_empty_or_zero_result():
    a = Float8CurrentScalingQuantizer(E4M3).quantize(torch.empty(0, 32)).rowwise_operand()
    b = Float8CurrentScalingQuantizer(E4M3).quantize(_x((3, 32), 7)).rowwise_operand()
    assert gemm(a, b, out_dtype=torch.bfloat16).shape == (0, 3)
    z = gemm(torch.empty(2, 0), torch.empty(3, 0, dtype=torch.float64), out_dtype=torch.float32)
    assert z.shape == (2, 3) and z.count_nonzero() == 0


@pytest.mark.parametrize("a_shape,b_shape", [((3, 4), (5, 6)), ((3, 4, 2), (5, 2)), ((4,), (5, 4))])
def test_shape_errors_name_both_shapes(a_shape, b_shape):
    with pytest.raises(ValueError, match=re.escape(str(a_shape)) + ".*" + re.escape(str(b_shape))):
        gemm(torch.ones(a_shape), torch.ones(b_shape), out_dtype=torch.float32)


def test_non_tensor_operands_are_rejected():
    with pytest.raises(TypeError, match="operand b"):
        gemm(torch.ones(2, 2), [[1.0, 2.0]], out_dtype=torch.float32)


@pytest.mark.gpu
def test_scaled_mm_path_matches_the_emulation_on_sm89_plus():
    if torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("torch._scaled_mm needs compute capability 8.9+")
    x, w = _x((64, 128), 8).cuda(), _x((48, 128), 9).cuda()
    a = Float8CurrentScalingQuantizer(E4M3).quantize(x).rowwise_operand()
    b = Float8CurrentScalingQuantizer(E4M3).quantize(w).rowwise_operand()
    out = gemm(a, b, out_dtype=torch.float32)
    assert out.shape == (64, 48)
    a_cpu = GemmOperand(a.data.cpu(), a.scale_inv.cpu(), "tensor", E4M3)
    b_cpu = GemmOperand(b.data.cpu(), b.scale_inv.cpu(), "tensor", E4M3)
    # cuBLASLt scales the accumulator instead of each operand, and Hopper's FP8 tensor cores keep
    # roughly 14 mantissa bits inside a K-chunk before promoting to fp32 (DeepSeek-V3 report,
    # section 3.3.2), so the bound is 2**-12 of sum |a_k b_k| rather than fp32's gamma_K.
    assert_fp32_accumulation_close(out.cpu(), a_cpu, b_cpu, rel=2.0**-12)


@pytest.mark.gpu
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
def test_scaled_mm_path_adds_the_bias_for_every_output_dtype(out_dtype):
    """cuBLASLt takes a bias only for 16-bit outputs: an fp32 output must still get it."""
    if torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("torch._scaled_mm needs compute capability 8.9+")
    x, w = _x((64, 128), 10).cuda(), _x((48, 128), 11).cuda()
    bias = torch.linspace(-3, 3, 48, device="cuda")
    a = Float8CurrentScalingQuantizer(E4M3).quantize(x).rowwise_operand()
    b = Float8CurrentScalingQuantizer(E4M3).quantize(w).rowwise_operand()
    with_bias = gemm(a, b, out_dtype=out_dtype, bias=bias).float()
    without = gemm(a, b, out_dtype=torch.float32)
    # bf16 rounds the sum once: half a bf16 ulp of the largest magnitude
    tol = 0.0 if out_dtype == torch.float32 else (without + bias).abs().max().item() * 2.0**-8
    torch.testing.assert_close(with_bias, without + bias, rtol=0, atol=tol)


@pytest.mark.gpu
def test_scaled_mm_path_gives_the_same_bits_for_every_spelling_of_a_per_tensor_scale():
    """The quantizers' (1,) fp32 scales go to torch._scaled_mm as they are; a hand-built operand's
    0-dim, (1, 1) or float64 scale is brought to that form, not passed on as something else."""
    if torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("torch._scaled_mm needs compute capability 8.9+")
    x, w = _x((64, 128), 12).cuda(), _x((48, 128), 13).cuda()
    a = Float8CurrentScalingQuantizer(E4M3).quantize(x).rowwise_operand()
    b = Float8CurrentScalingQuantizer(E4M3).quantize(w).rowwise_operand()
    assert a.scale_inv.shape == (1,) and a.scale_inv.dtype == torch.float32
    bias = torch.linspace(-3, 3, 48, device="cuda")
    want = gemm(a, b, out_dtype=torch.bfloat16, bias=bias)
    spellings = [
        lambda s: s.reshape(()),
        lambda s: s.reshape(1, 1),
        lambda s: s.double(),  # exact: the values are fp32
    ]
    for spell_a in spellings:
        for spell_b in [lambda s: s, *spellings]:
            a2 = GemmOperand(a.data, spell_a(a.scale_inv), "tensor", E4M3)
            b2 = GemmOperand(b.data, spell_b(b.scale_inv), "tensor", E4M3)
            assert torch.equal(gemm(a2, b2, out_dtype=torch.bfloat16, bias=bias), want)
