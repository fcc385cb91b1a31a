"""QuantizedTensor containers: metadata, cached transposes, GEMM operands, refusal of arithmetic.

Expected dequantized values are computed in float64 from the stored bytes and scales (then rounded
once to fp32, which is exact for a product of an FP8 value and a scale).
"""

import math
import operator

import numpy as np
import pytest
import torch

from dist_quant import (
    Float8BlockQuantizer,
    Float8CurrentScalingQuantizer,
    MXFP8Quantizer,
    QuantizedTensor,
)
from dist_quant.tensor import GemmOperand

E4M3 = torch.float8_e4m3fn


def f32(x):
    return np.asarray(x, dtype=np.float64).astype(np.float32).astype(np.float64)


def fp8_values(t: torch.Tensor) -> np.ndarray:
    return t.float().double().numpy()


def per_tile(scale: np.ndarray, rows: int, cols: int, height: int, width: int) -> np.ndarray:
    """Expand a scale grid to one value per element."""
    return np.repeat(np.repeat(scale, height, axis=0), width, axis=1)[:rows, :cols]


def test_metadata_is_that_of_the_original_tensor():
    x = torch.randn(2, 3, 40, dtype=torch.bfloat16)
    out = Float8CurrentScalingQuantizer(torch.float8_e5m2).quantize(x)
    assert out.shape == (2, 3, 40) and out.dtype == torch.bfloat16
    assert out.device == x.device and out.fp8_dtype == torch.float8_e5m2
    assert out.data.dtype == torch.float8_e5m2 and out.data.shape == x.shape
    assert out.dequantize(torch.bfloat16).dtype == torch.bfloat16
    assert out.dequantize().shape == x.shape


@pytest.mark.parametrize("columnwise_usage", [False, True])
def test_per_tensor_transpose_is_built_once_and_cached(columnwise_usage):
    q = Float8CurrentScalingQuantizer(E4M3)
    q.set_usage(rowwise=True, columnwise=columnwise_usage)
    out = q.quantize(torch.randn(2, 5, 33))
    first = out.transpose_data()
    assert out.transpose_data() is first and first.is_contiguous()
    np.testing.assert_array_equal(
        first.view(torch.uint8).numpy(), out.data.view(torch.uint8).numpy().reshape(10, 33).T
    )
    assert out.columnwise_operand().data is first


def test_per_tensor_operands_are_the_2d_view_and_its_transpose_with_one_scale():
    x = torch.randn(4, 3, 20) * 7
    out = Float8CurrentScalingQuantizer(E4M3).quantize(x)
    rw, cw = out.rowwise_operand(), out.columnwise_operand()
    assert (rw.shape, cw.shape) == ((12, 20), (20, 12))
    assert rw.scaling == cw.scaling == "tensor" and rw.scale_inv is cw.scale_inv is out.scale_inv
    inv = out.scale_inv.item()
    expected = f32(fp8_values(out.data).reshape(12, 20) * inv)
    np.testing.assert_array_equal(rw.dequantize().double().numpy(), expected)
    np.testing.assert_array_equal(cw.dequantize().double().numpy(), expected.T)
    np.testing.assert_array_equal(out.dequantize().double().numpy(), expected.reshape(4, 3, 20))


@pytest.mark.parametrize("shape", [(70, 45), (3, 1, 33)])
def test_mxfp8_operands_dequantize_from_their_own_scales(shape):
    x = torch.randn(shape) * 3
    out = MXFP8Quantizer().quantize(x)
    rows, cols = math.prod(shape[:-1]), shape[-1]
    for operand, (r, c) in (
        (out.rowwise_operand(), (rows, cols)),
        (out.columnwise_operand(), (cols, rows)),
    ):
        assert operand.shape == (r, c) and operand.scale_inv.shape == (r, -(-c // 32))
        scale = 2.0 ** (operand.scale_inv.numpy().astype(np.float64) - 127)
        expected = fp8_values(operand.data) * per_tile(scale, r, c, 1, 32)
        np.testing.assert_array_equal(operand.dequantize().double().numpy(), f32(expected))


def test_columnwise_only_tensors_dequantize_from_the_columnwise_copy():
    x = torch.randn(3, 50, 70)
    for q in (MXFP8Quantizer(), Float8BlockQuantizer(block_scaling_dim=1)):
        q.set_usage(rowwise=False, columnwise=True)
        out = q.quantize(x)
        cw = out.columnwise_operand()
        assert out.dequantize().shape == x.shape
        torch.testing.assert_close(
            out.dequantize(), cw.dequantize().t().reshape(x.shape), rtol=0, atol=0
        )
        with pytest.raises(ValueError, match="no rowwise data"):
            _ = out.data


def test_128x128_columnwise_is_the_exact_transpose_of_bytes_and_scale_grid():
    x = torch.randn(200, 300)
    q = Float8BlockQuantizer(block_scaling_dim=2)
    q.set_usage(rowwise=True, columnwise=False)  # the transpose is exact, so it is always there
    out = q.quantize(x)
    rw, cw = out.rowwise_operand(), out.columnwise_operand()
    assert out.columnwise_operand().data is cw.data  # cached
    assert rw.scale_inv.shape == (2, 3) and cw.scale_inv.shape == (3, 2)
    np.testing.assert_array_equal(
        cw.data.view(torch.uint8).numpy(), rw.data.view(torch.uint8).numpy().T
    )
    np.testing.assert_array_equal(cw.scale_inv.numpy(), rw.scale_inv.numpy().T)
    expected = f32(
        fp8_values(rw.data) * per_tile(rw.scale_inv.double().numpy(), 200, 300, 128, 128)
    )
    np.testing.assert_array_equal(rw.dequantize().double().numpy(), expected)
    np.testing.assert_array_equal(cw.dequantize().double().numpy(), expected.T)


def test_1x128_operands_use_row_tiles_and_column_tiles():
    x = torch.randn(130, 260)
    out = Float8BlockQuantizer(block_scaling_dim=1).quantize(x)
    rw, cw = out.rowwise_operand(), out.columnwise_operand()
    assert rw.scaling == cw.scaling == "block1d"
    assert rw.scale_inv.shape == (130, 3) and cw.scale_inv.shape == (260, 2)
    expected = fp8_values(cw.data) * per_tile(cw.scale_inv.double().numpy(), 260, 130, 1, 128)
    np.testing.assert_array_equal(cw.dequantize().double().numpy(), f32(expected))


@pytest.mark.parametrize("shape", [(0, 5), (5, 0), (0,)])
def test_empty_tensors_quantize_and_expose_empty_operands(shape):
    x = torch.empty(shape)
    rows, cols = math.prod(shape[:-1]), shape[-1]
    for q in (
        Float8CurrentScalingQuantizer(E4M3),
        MXFP8Quantizer(),
        Float8BlockQuantizer(block_scaling_dim=1),
        Float8BlockQuantizer(block_scaling_dim=2),
    ):
        out = q.quantize(x)
        assert out.dequantize().shape == shape
        assert out.rowwise_operand().shape == (rows, cols)
        assert out.columnwise_operand().shape == (cols, rows)


ARITHMETIC = [
    operator.add,
    operator.sub,
    operator.mul,
    operator.truediv,
    operator.matmul,
    operator.pow,
    operator.iadd,
    operator.imul,
    lambda a, b: b + a,
    lambda a, b: b * a,
    lambda a, b: -a,
    lambda a, b: abs(a),
]


@pytest.mark.parametrize("op", ARITHMETIC)
def test_arithmetic_on_quantized_tensors_raises_type_error(op):
    x = torch.randn(4, 64)
    for q in (Float8CurrentScalingQuantizer(E4M3), MXFP8Quantizer(), Float8BlockQuantizer()):
        out = q.quantize(x)
        assert isinstance(out, QuantizedTensor)
        with pytest.raises(TypeError, match=r"dequantize\(\)"):
            op(out, torch.ones(4, 64))


def test_gemm_operand_validates_its_fields():
    data = torch.zeros(4, 4).to(E4M3)
    with pytest.raises(ValueError, match="scaling"):
        GemmOperand(data, torch.ones(()), "rowwise", E4M3)
    with pytest.raises(ValueError, match="2D"):
        GemmOperand(data.reshape(16), torch.ones(()), "tensor", E4M3)
    with pytest.raises(ValueError, match="2D"):
        GemmOperand(data, torch.ones(()), "tensor", torch.float8_e5m2)


def test_0dim_per_tensor_quantization_has_no_gemm_view():
    out = Float8CurrentScalingQuantizer(E4M3).quantize(torch.tensor(3.0))
    assert out.shape == () and out.dequantize().shape == ()
    with pytest.raises(ValueError, match="0-dim"):
        out.rowwise_operand()
