"""MXFP8, float8 block scaling, dequantize and the block-scaled GEMM as ``torch.library`` ops.

The same conventions as ``kernels/ops.py`` (which holds ``Op``, the per-tensor casts, current
scaling and the delayed update): the reference is the default kernel, the Triton launcher the
CUDA one, every op has a fake implementation.
"""

from __future__ import annotations

import torch
from dist_quant.kernels import reference
from dist_quant.kernels.block import block_cast_triton
from dist_quant.kernels.block_gemm import block_scaled_gemm_triton
from dist_quant.kernels.dequantize import (
    block_dequantize_triton,
    dequantize_triton,
    mxfp8_dequantize_triton,
)
from dist_quant.kernels.mxfp8 import mxfp8_cast_triton
from dist_quant.kernels.ops import register_op, rows_cols
from torch import Tensor


# ---- MXFP8 and float8 block scaling ------------------------------------------------------------
def _mxfp8_cast_ref(x: Tensor, fp8_dtype: torch.dtype, columnwise: bool) -> tuple[Tensor, Tensor]:
    q, e8m0 = reference.mxfp8_cast(x, fp8_dtype, columnwise=columnwise)
    return q.contiguous(), e8m0.contiguous()


def _mxfp8_cast_cuda(x: Tensor, fp8_dtype: torch.dtype, columnwise: bool) -> tuple[Tensor, Tensor]:
    q, e8m0 = mxfp8_cast_triton(x, fp8_dtype, columnwise=columnwise)
    return q.contiguous(), e8m0.contiguous()


def _mxfp8_cast_fake(x: Tensor, fp8_dtype: torch.dtype, columnwise: bool) -> tuple[Tensor, Tensor]:
    rows, cols = rows_cols(x)
    if columnwise:
        q_shape, s_shape = (cols, rows), (cols, -(-rows // reference.MXFP8_BLOCK))
    else:
        q_shape, s_shape = tuple(x.shape), (rows, -(-cols // reference.MXFP8_BLOCK))
    return x.new_empty(q_shape, dtype=fp8_dtype), x.new_empty(s_shape, dtype=torch.uint8)


def _block_cast_ref(
    x: Tensor, fp8_dtype: torch.dtype, block_dim: int, use_power_2_scales: bool
) -> tuple[Tensor, Tensor]:
    q, s_inv = reference.block_cast(
        x, fp8_dtype, block_dim=block_dim, use_power_2_scales=use_power_2_scales
    )
    return q.contiguous(), s_inv.contiguous()


def _block_cast_cuda(
    x: Tensor, fp8_dtype: torch.dtype, block_dim: int, use_power_2_scales: bool
) -> tuple[Tensor, Tensor]:
    q, s_inv = block_cast_triton(
        x, fp8_dtype, block_dim=block_dim, use_power_2_scales=use_power_2_scales
    )
    return q.contiguous(), s_inv.contiguous()


def _block_cast_fake(
    x: Tensor, fp8_dtype: torch.dtype, block_dim: int, use_power_2_scales: bool
) -> tuple[Tensor, Tensor]:
    rows, cols = rows_cols(x)
    s_shape = reference._block_scale_shape(rows, cols, block_dim)
    return x.new_empty(x.shape, dtype=fp8_dtype), x.new_empty(s_shape, dtype=torch.float32)


# ---- dequantize ----------------------------------------------------------------------------------
def _dequantize_ref(q: Tensor, scale_inv: Tensor, dtype: torch.dtype) -> Tensor:
    return reference.dequantize(q, scale_inv, dtype)


def _dequantize_cuda(q: Tensor, scale_inv: Tensor, dtype: torch.dtype) -> Tensor:
    return dequantize_triton(q, scale_inv, dtype)


def _dequantize_fake(q: Tensor, scale_inv: Tensor, dtype: torch.dtype) -> Tensor:
    return torch.empty_like(q, dtype=dtype)


def _mxfp8_dequantize_ref(q: Tensor, e8m0: Tensor, columnwise: bool, dtype: torch.dtype) -> Tensor:
    return reference.mxfp8_dequantize(q, e8m0, columnwise=columnwise, dtype=dtype)


def _mxfp8_dequantize_cuda(q: Tensor, e8m0: Tensor, columnwise: bool, dtype: torch.dtype) -> Tensor:
    return mxfp8_dequantize_triton(q, e8m0, columnwise=columnwise, dtype=dtype)


def _mxfp8_dequantize_fake(q: Tensor, e8m0: Tensor, columnwise: bool, dtype: torch.dtype) -> Tensor:
    # columnwise: the (rows, cols) matrix is the transpose of q's (cols, rows) layout
    out = q.new_empty(tuple(q.shape), dtype=dtype)
    return out.t() if columnwise else out


def _block_dequantize_ref(
    q: Tensor, scale_inv: Tensor, block_dim: int, dtype: torch.dtype
) -> Tensor:
    return reference.block_dequantize(q, scale_inv, block_dim=block_dim, dtype=dtype).contiguous()


def _block_dequantize_cuda(
    q: Tensor, scale_inv: Tensor, block_dim: int, dtype: torch.dtype
) -> Tensor:
    return block_dequantize_triton(q, scale_inv, block_dim=block_dim, dtype=dtype).contiguous()


def _block_dequantize_fake(
    q: Tensor, scale_inv: Tensor, block_dim: int, dtype: torch.dtype
) -> Tensor:
    return q.new_empty(q.shape, dtype=dtype)


# ---- block-scaled GEMM (Triton only: the CPU path is gemm.py's emulation) ----------------------
def _block_scaled_gemm_cuda(
    a_data: Tensor,
    a_scale_inv: Tensor,
    a_block_dim: int,
    b_data: Tensor,
    b_scale_inv: Tensor,
    b_block_dim: int,
    out_dtype: torch.dtype,
    bias: Tensor | None,
) -> Tensor:
    return block_scaled_gemm_triton(
        a_data, a_scale_inv, a_block_dim, b_data, b_scale_inv, b_block_dim,
        out_dtype=out_dtype, bias=bias,
    )  # fmt: skip


def _block_scaled_gemm_fake(
    a_data: Tensor,
    a_scale_inv: Tensor,
    a_block_dim: int,
    b_data: Tensor,
    b_scale_inv: Tensor,
    b_block_dim: int,
    out_dtype: torch.dtype,
    bias: Tensor | None,
) -> Tensor:
    return a_data.new_empty((a_data.shape[0], b_data.shape[0]), dtype=out_dtype)


# ---- registration ------------------------------------------------------------------------------
mxfp8_cast = register_op("mxfp8_cast", (), _mxfp8_cast_ref, _mxfp8_cast_cuda, _mxfp8_cast_fake)
block_cast = register_op("block_cast", (), _block_cast_ref, _block_cast_cuda, _block_cast_fake)
dequantize = register_op("dequantize", (), _dequantize_ref, _dequantize_cuda, _dequantize_fake)
mxfp8_dequantize = register_op(
    "mxfp8_dequantize", (), _mxfp8_dequantize_ref, _mxfp8_dequantize_cuda, _mxfp8_dequantize_fake
)
block_dequantize = register_op(
    "block_dequantize", (), _block_dequantize_ref, _block_dequantize_cuda, _block_dequantize_fake
)
block_scaled_gemm = register_op(
    "block_scaled_gemm", (), None, _block_scaled_gemm_cuda, _block_scaled_gemm_fake
)
