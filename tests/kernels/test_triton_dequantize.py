"""Triton dequantize (per-tensor, MXFP8, Float8 block) against the reference, bit for bit.

Every FP8 byte is decoded, scales include ones that push results into fp32 subnormals, overflow
and NaN, and the output dtypes cover fp32, bf16 (rounded on the bits) and fp16.
"""

import pytest
import torch
from dist_quant.kernels import reference as ref
from dist_quant.kernels.dequantize import (
    block_dequantize_triton,
    dequantize_triton,
    mxfp8_dequantize_triton,
)
from triton_cases import DEVICE, FP8_DTYPES, RAGGED_SHAPES, assert_bitwise_equal, on_device

OUT_DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def _bytes(shape, fp8_dtype, seed):
    """Random bytes, the first 256 of them every code in order."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 256, shape, generator=g, dtype=torch.uint8)
    flat = q.view(-1)
    k = min(256, flat.numel())
    flat[:k] = torch.arange(k, dtype=torch.uint8)
    return q.view(fp8_dtype)


@pytest.mark.parametrize("out_dtype", OUT_DTYPES)
@pytest.mark.parametrize("fp8_dtype", FP8_DTYPES)
@pytest.mark.parametrize("scale_inv", [1.0, 0.1, 2.0**-140, 1e36, float("nan")])
def test_per_tensor_dequantize_of_every_byte(scale_inv, fp8_dtype, out_dtype):
    q = _bytes((3, 300), fp8_dtype, seed=31)
    s = torch.tensor(scale_inv)
    got = dequantize_triton(*on_device(q, s), out_dtype)
    assert_bitwise_equal(got, ref.dequantize(q, s, out_dtype), "dequantize")


def test_per_tensor_dequantize_keeps_torch_layout_for_noncontiguous_data():
    q = _bytes((64, 48), torch.float8_e4m3fn, seed=32)
    q_dev = q.to(DEVICE, copy=True)
    for view, view_dev in ((q.t(), q_dev.t()), (q[:, ::3], q_dev[:, ::3])):
        got = dequantize_triton(view_dev, 0.5, torch.bfloat16)
        assert_bitwise_equal(got, ref.dequantize(view, 0.5, torch.bfloat16), "dequantize")


@pytest.mark.parametrize("out_dtype", OUT_DTYPES)
@pytest.mark.parametrize("fp8_dtype", FP8_DTYPES)
def test_mxfp8_dequantize_of_every_byte_and_every_e8m0_code(fp8_dtype, out_dtype):
    q = _bytes((256, 64), fp8_dtype, seed=33)
    e8m0 = torch.arange(512, dtype=torch.int64).remainder(256).to(torch.uint8).reshape(256, 2)
    for columnwise in (False, True):
        got = mxfp8_dequantize_triton(*on_device(q, e8m0), columnwise=columnwise, dtype=out_dtype)
        exp = ref.mxfp8_dequantize(q, e8m0, columnwise=columnwise, dtype=out_dtype)
        assert_bitwise_equal(got, exp, f"mxfp8_dequantize columnwise={columnwise}")


@pytest.mark.parametrize("fp8_dtype", FP8_DTYPES)
@pytest.mark.parametrize("shape", RAGGED_SHAPES)
def test_mxfp8_dequantize_matches_reference_on_ragged_shapes(shape, fp8_dtype):
    q = _bytes(shape, fp8_dtype, seed=34)
    rows = q.numel() // shape[-1] if shape[-1] else shape[0]
    g = torch.Generator().manual_seed(35)
    e8m0 = torch.randint(100, 150, (rows, -(-shape[-1] // 32)), generator=g, dtype=torch.uint8)
    got = mxfp8_dequantize_triton(*on_device(q, e8m0), dtype=torch.bfloat16)
    assert_bitwise_equal(got, ref.mxfp8_dequantize(q, e8m0, dtype=torch.bfloat16), "rowwise")


@pytest.mark.parametrize("block_dim", [1, 2])
@pytest.mark.parametrize("fp8_dtype", FP8_DTYPES)
@pytest.mark.parametrize("shape", RAGGED_SHAPES + [(130, 260)])
def test_block_dequantize_matches_reference_on_ragged_shapes(shape, fp8_dtype, block_dim):
    q = _bytes(shape, fp8_dtype, seed=36)
    rows = q.numel() // shape[-1] if shape[-1] else shape[0]
    scale_rows = rows if block_dim == 1 else -(-rows // 128)
    g = torch.Generator().manual_seed(37)
    s = torch.exp2(torch.randint(-140, 120, (scale_rows, -(-shape[-1] // 128)), generator=g))
    s = s.float() * 1.37  # not a power of two: the product rounds
    for out_dtype in OUT_DTYPES:
        got = block_dequantize_triton(*on_device(q, s), block_dim=block_dim, dtype=out_dtype)
        exp = ref.block_dequantize(q, s, block_dim=block_dim, dtype=out_dtype)
        assert_bitwise_equal(got, exp, f"block_dequantize {out_dtype}")


def test_bad_arguments_raise_value_errors_naming_the_op():
    q = torch.zeros(4, 64, dtype=torch.uint8, device=DEVICE).view(torch.float8_e4m3fn)
    with pytest.raises(ValueError, match="mxfp8_dequantize: e8m0 must be uint8 of shape"):
        mxfp8_dequantize_triton(q, torch.zeros(4, 3, dtype=torch.uint8, device=DEVICE))
    with pytest.raises(ValueError, match="block_dequantize: scale_inv must have shape"):
        block_dequantize_triton(q, torch.ones(4, 2, device=DEVICE), block_dim=1)
    with pytest.raises(ValueError, match="dequantize: dtype must be fp32/bf16/fp16"):
        dequantize_triton(q, 1.0, torch.float64)
    with pytest.raises(ValueError, match="dequantize.*fp8_dtype"):
        dequantize_triton(torch.zeros(3, device=DEVICE), 1.0)
