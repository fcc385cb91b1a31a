"""Every kernel entry point as a ``torch.library`` custom op (namespace ``dist_quant``).

The default implementation of each op is ``kernels/reference.py`` (CPU, and any device without a
registered kernel); CUDA tensors run the Triton launcher. Each op has a fake (meta) implementation
so that ``torch.compile`` traces through it without running it, and the ops that write scaling
state in place declare it (``mutates_args``), so a compiled graph keeps those writes in order and
a CUDA graph replays them into the same buffers.

Conventions shared by every op, so the fake and the real outputs agree on shape and stride:
outputs are new tensors, never views of an input; per-tensor casts and dequantize keep the
input's layout (``empty_like``, as the launchers and torch's elementwise ops do), a columnwise
MXFP8 dequantize is the transpose of a contiguous buffer (as the reference), everything else is
contiguous; per-tensor scales are 1-element fp32 tensors. Inputs are detached by the dispatchers in ``kernels/__init__.py``: no op here has a
derivative (quantized data is not differentiable; autograd lives in the modules' Functions).

Delayed-update algorithms travel as integer codes (``ALGO_CODES``): a schema has no list of strings.
"""

from __future__ import annotations

import math

import torch
from dist_quant.kernels import reference
from dist_quant.kernels.block import block_cast_triton
from dist_quant.kernels.block_gemm import block_scaled_gemm_triton
from dist_quant.kernels.cast import cast_to_fp8_triton, cast_transpose_triton
from dist_quant.kernels.current import amax_triton, current_scale_triton, current_scaling_cast_triton
from dist_quant.kernels.delayed_update import delayed_scaling_update_groups_triton
from dist_quant.kernels.dequantize import (
    block_dequantize_triton,
    dequantize_triton,
    mxfp8_dequantize_triton,
)
from dist_quant.kernels.mxfp8 import mxfp8_cast_triton
from torch import Tensor
from torch.library import custom_op, register_fake

ALGO_CODES = {"max": 0, "most_recent": 1}
_ALGO_NAMES = {code: name for name, code in ALGO_CODES.items()}


def _rows_cols(x: Tensor) -> tuple[int, int]:
    return math.prod(x.shape[:-1]), x.shape[-1]


def _pair(q: Tensor, q_t: Tensor) -> tuple[Tensor, Tensor]:
    """Two distinct outputs: the transpose of a (1, n) or (n, 1) ``q`` is ``q`` itself."""
    if q_t.untyped_storage().data_ptr() == q.untyped_storage().data_ptr():
        q_t = q_t.clone()
    return q, q_t


def _accumulate_amax(amax_out: Tensor, x: Tensor) -> None:
    """``amax_out = max(amax_out, amax(x))`` in place, NaN propagating (reference of the fused ops)."""
    amax_out.copy_(torch.maximum(amax_out, reference.amax(x)))


# ---- amax / per-tensor casts -----------------------------------------------------------------
@custom_op("dist_quant::amax", mutates_args=())
def amax(x: Tensor) -> Tensor:
    return reference.amax(x)


@amax.register_kernel("cuda")
def _(x: Tensor) -> Tensor:
    return amax_triton(x)


@register_fake("dist_quant::amax")
def _(x: Tensor) -> Tensor:
    return x.new_empty((), dtype=torch.float32)


@custom_op("dist_quant::cast_to_fp8", mutates_args=())
def cast_to_fp8(x: Tensor, scale: Tensor, fp8_dtype: torch.dtype) -> Tensor:
    return reference.cast_to_fp8(x, scale, fp8_dtype)


@cast_to_fp8.register_kernel("cuda")
def _(x: Tensor, scale: Tensor, fp8_dtype: torch.dtype) -> Tensor:
    return cast_to_fp8_triton(x, scale, fp8_dtype)


@register_fake("dist_quant::cast_to_fp8")
def _(x: Tensor, scale: Tensor, fp8_dtype: torch.dtype) -> Tensor:
    return torch.empty_like(x, dtype=fp8_dtype)


@custom_op("dist_quant::cast_transpose", mutates_args=())
def cast_transpose(x: Tensor, scale: Tensor, fp8_dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    q, q_t = reference.cast_transpose(x, scale, fp8_dtype)
    return _pair(q, q_t)


@cast_transpose.register_kernel("cuda")
def _(x: Tensor, scale: Tensor, fp8_dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    q, q_t = cast_transpose_triton(x, scale, fp8_dtype)
    return _pair(q, q_t)


@register_fake("dist_quant::cast_transpose")
def _(x: Tensor, scale: Tensor, fp8_dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    rows, cols = _rows_cols(x)
    return torch.empty_like(x, dtype=fp8_dtype), x.new_empty((cols, rows), dtype=fp8_dtype)


# Delayed scaling: the cast also folds max(|x|) into the history slot ``amax_out`` (a view into
# row 0 of a recipe state's amax history), declared as a mutation.
@custom_op("dist_quant::cast_to_fp8_with_amax", mutates_args=("amax_out",))
def cast_to_fp8_with_amax(
    x: Tensor, scale: Tensor, fp8_dtype: torch.dtype, amax_out: Tensor
) -> Tensor:
    q = reference.cast_to_fp8(x, scale, fp8_dtype)
    _accumulate_amax(amax_out, x)
    return q


@cast_to_fp8_with_amax.register_kernel("cuda")
def _(x: Tensor, scale: Tensor, fp8_dtype: torch.dtype, amax_out: Tensor) -> Tensor:
    return cast_to_fp8_triton(x, scale, fp8_dtype, amax_out=amax_out)


@register_fake("dist_quant::cast_to_fp8_with_amax")
def _(x: Tensor, scale: Tensor, fp8_dtype: torch.dtype, amax_out: Tensor) -> Tensor:
    return torch.empty_like(x, dtype=fp8_dtype)


@custom_op("dist_quant::cast_transpose_with_amax", mutates_args=("amax_out",))
def cast_transpose_with_amax(
    x: Tensor, scale: Tensor, fp8_dtype: torch.dtype, amax_out: Tensor
) -> tuple[Tensor, Tensor]:
    q, q_t = reference.cast_transpose(x, scale, fp8_dtype)
    _accumulate_amax(amax_out, x)
    return _pair(q, q_t)


@cast_transpose_with_amax.register_kernel("cuda")
def _(
    x: Tensor, scale: Tensor, fp8_dtype: torch.dtype, amax_out: Tensor
) -> tuple[Tensor, Tensor]:
    q, q_t = cast_transpose_triton(x, scale, fp8_dtype, amax_out=amax_out)
    return _pair(q, q_t)


@register_fake("dist_quant::cast_transpose_with_amax")
def _(
    x: Tensor, scale: Tensor, fp8_dtype: torch.dtype, amax_out: Tensor
) -> tuple[Tensor, Tensor]:
    rows, cols = _rows_cols(x)
    return torch.empty_like(x, dtype=fp8_dtype), x.new_empty((cols, rows), dtype=fp8_dtype)


# ---- current scaling ---------------------------------------------------------------------------
@custom_op("dist_quant::current_scale", mutates_args=())
def current_scale(
    amax: Tensor, fp8_dtype: torch.dtype, amax_epsilon: float, use_power_2_scales: bool
) -> tuple[Tensor, Tensor]:
    s, s_inv = reference.current_scale(
        amax, fp8_dtype, amax_epsilon=amax_epsilon, use_power_2_scales=use_power_2_scales
    )
    return s.contiguous(), s_inv.contiguous()


@current_scale.register_kernel("cuda")
def _(
    amax: Tensor, fp8_dtype: torch.dtype, amax_epsilon: float, use_power_2_scales: bool
) -> tuple[Tensor, Tensor]:
    s, s_inv = current_scale_triton(
        amax, fp8_dtype, amax_epsilon=amax_epsilon, use_power_2_scales=use_power_2_scales
    )
    return s.contiguous(), s_inv.contiguous()


@register_fake("dist_quant::current_scale")
def _(
    amax: Tensor, fp8_dtype: torch.dtype, amax_epsilon: float, use_power_2_scales: bool
) -> tuple[Tensor, Tensor]:
    return amax.new_empty(amax.shape, dtype=torch.float32), amax.new_empty(
        amax.shape, dtype=torch.float32
    )


def _reference_current_cast(
    x: Tensor, fp8_dtype: torch.dtype, amax_epsilon: float, use_power_2_scales: bool, transpose: bool
) -> tuple[Tensor, ...]:
    a = reference.amax(x)
    scale, scale_inv = reference.current_scale(
        a, fp8_dtype, amax_epsilon=amax_epsilon, use_power_2_scales=use_power_2_scales
    )
    if transpose:
        q, q_t = reference.cast_transpose(x, scale, fp8_dtype)
        return (*_pair(q, q_t), scale.reshape(1), scale_inv.reshape(1), a)
    q = reference.cast_to_fp8(x, scale, fp8_dtype)
    return q, scale.reshape(1), scale_inv.reshape(1), a


@custom_op("dist_quant::current_scaling_cast", mutates_args=())
def current_scaling_cast(
    x: Tensor, fp8_dtype: torch.dtype, amax_epsilon: float, use_power_2_scales: bool
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """``(q, scale (1,), scale_inv (1,), amax ())`` of amax -> current scale -> cast."""
    return _reference_current_cast(x, fp8_dtype, amax_epsilon, use_power_2_scales, False)


@current_scaling_cast.register_kernel("cuda")
def _(
    x: Tensor, fp8_dtype: torch.dtype, amax_epsilon: float, use_power_2_scales: bool
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    out = current_scaling_cast_triton(
        x, fp8_dtype, amax_epsilon=amax_epsilon, use_power_2_scales=use_power_2_scales
    )
    return out.data, out.scale, out.scale_inv, out.amax


@register_fake("dist_quant::current_scaling_cast")
def _(
    x: Tensor, fp8_dtype: torch.dtype, amax_epsilon: float, use_power_2_scales: bool
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    one = (1,)
    return (
        torch.empty_like(x, dtype=fp8_dtype),
        x.new_empty(one, dtype=torch.float32),
        x.new_empty(one, dtype=torch.float32),
        x.new_empty((), dtype=torch.float32),
    )


@custom_op("dist_quant::current_scaling_cast_transpose", mutates_args=())
def current_scaling_cast_transpose(
    x: Tensor, fp8_dtype: torch.dtype, amax_epsilon: float, use_power_2_scales: bool
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """``(q, q_t (cols, rows), scale (1,), scale_inv (1,), amax ())``."""
    return _reference_current_cast(x, fp8_dtype, amax_epsilon, use_power_2_scales, True)


@current_scaling_cast_transpose.register_kernel("cuda")
def _(
    x: Tensor, fp8_dtype: torch.dtype, amax_epsilon: float, use_power_2_scales: bool
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    out = current_scaling_cast_triton(
        x, fp8_dtype, amax_epsilon=amax_epsilon, use_power_2_scales=use_power_2_scales,
        transpose=True,
    )  # fmt: skip
    return out.data, out.data_t, out.scale, out.scale_inv, out.amax


@register_fake("dist_quant::current_scaling_cast_transpose")
def _(
    x: Tensor, fp8_dtype: torch.dtype, amax_epsilon: float, use_power_2_scales: bool
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    rows, cols = _rows_cols(x)
    one = (1,)
    return (
        torch.empty_like(x, dtype=fp8_dtype),
        x.new_empty((cols, rows), dtype=fp8_dtype),
        x.new_empty(one, dtype=torch.float32),
        x.new_empty(one, dtype=torch.float32),
        x.new_empty((), dtype=torch.float32),
    )


# ---- delayed scaling update ----------------------------------------------------------------------
@custom_op("dist_quant::delayed_scaling_update_groups", mutates_args=("histories", "scales"))
def delayed_scaling_update_groups(
    histories: list[Tensor],
    scales: list[Tensor],
    fp8_maxes: list[Tensor],
    margins: list[float],
    algos: list[int],
) -> None:
    """``reference.delayed_scaling_update`` of each group ``i``, in place; one launch on CUDA."""
    for history, scale, limit, margin, code in zip(histories, scales, fp8_maxes, margins, algos):
        reference.delayed_scaling_update(
            history, scale, limit, margin=margin, algo=_ALGO_NAMES[code]
        )


@delayed_scaling_update_groups.register_kernel("cuda")
def _(
    histories: list[Tensor],
    scales: list[Tensor],
    fp8_maxes: list[Tensor],
    margins: list[float],
    algos: list[int],
) -> None:
    delayed_scaling_update_groups_triton(
        [
            (h, s, limit, margin, _ALGO_NAMES[code])
            for h, s, limit, margin, code in zip(histories, scales, fp8_maxes, margins, algos)
        ]
    )


@register_fake("dist_quant::delayed_scaling_update_groups")
def _(
    histories: list[Tensor],
    scales: list[Tensor],
    fp8_maxes: list[Tensor],
    margins: list[float],
    algos: list[int],
) -> None:
    return None


# ---- MXFP8 and float8 block scaling ------------------------------------------------------------
@custom_op("dist_quant::mxfp8_cast", mutates_args=())
def mxfp8_cast(x: Tensor, fp8_dtype: torch.dtype, columnwise: bool) -> tuple[Tensor, Tensor]:
    q, e8m0 = reference.mxfp8_cast(x, fp8_dtype, columnwise=columnwise)
    return q.contiguous(), e8m0.contiguous()


@mxfp8_cast.register_kernel("cuda")
def _(x: Tensor, fp8_dtype: torch.dtype, columnwise: bool) -> tuple[Tensor, Tensor]:
    q, e8m0 = mxfp8_cast_triton(x, fp8_dtype, columnwise=columnwise)
    return q.contiguous(), e8m0.contiguous()


@register_fake("dist_quant::mxfp8_cast")
def _(x: Tensor, fp8_dtype: torch.dtype, columnwise: bool) -> tuple[Tensor, Tensor]:
    rows, cols = _rows_cols(x)
    if columnwise:
        q_shape, s_shape = (cols, rows), (cols, -(-rows // reference.MXFP8_BLOCK))
    else:
        q_shape, s_shape = tuple(x.shape), (rows, -(-cols // reference.MXFP8_BLOCK))
    return x.new_empty(q_shape, dtype=fp8_dtype), x.new_empty(s_shape, dtype=torch.uint8)


@custom_op("dist_quant::block_cast", mutates_args=())
def block_cast(
    x: Tensor, fp8_dtype: torch.dtype, block_dim: int, use_power_2_scales: bool
) -> tuple[Tensor, Tensor]:
    q, s_inv = reference.block_cast(
        x, fp8_dtype, block_dim=block_dim, use_power_2_scales=use_power_2_scales
    )
    return q.contiguous(), s_inv.contiguous()


@block_cast.register_kernel("cuda")
def _(
    x: Tensor, fp8_dtype: torch.dtype, block_dim: int, use_power_2_scales: bool
) -> tuple[Tensor, Tensor]:
    q, s_inv = block_cast_triton(
        x, fp8_dtype, block_dim=block_dim, use_power_2_scales=use_power_2_scales
    )
    return q.contiguous(), s_inv.contiguous()


@register_fake("dist_quant::block_cast")
def _(
    x: Tensor, fp8_dtype: torch.dtype, block_dim: int, use_power_2_scales: bool
) -> tuple[Tensor, Tensor]:
    rows, cols = _rows_cols(x)
    s_shape = reference._block_scale_shape(rows, cols, block_dim)
    return x.new_empty(x.shape, dtype=fp8_dtype), x.new_empty(s_shape, dtype=torch.float32)


# ---- dequantize ----------------------------------------------------------------------------------
@custom_op("dist_quant::dequantize", mutates_args=())
def dequantize(q: Tensor, scale_inv: Tensor, dtype: torch.dtype) -> Tensor:
    return reference.dequantize(q, scale_inv, dtype)


@dequantize.register_kernel("cuda")
def _(q: Tensor, scale_inv: Tensor, dtype: torch.dtype) -> Tensor:
    return dequantize_triton(q, scale_inv, dtype)


@register_fake("dist_quant::dequantize")
def _(q: Tensor, scale_inv: Tensor, dtype: torch.dtype) -> Tensor:
    return torch.empty_like(q, dtype=dtype)


@custom_op("dist_quant::mxfp8_dequantize", mutates_args=())
def mxfp8_dequantize(q: Tensor, e8m0: Tensor, columnwise: bool, dtype: torch.dtype) -> Tensor:
    return reference.mxfp8_dequantize(q, e8m0, columnwise=columnwise, dtype=dtype)


@mxfp8_dequantize.register_kernel("cuda")
def _(q: Tensor, e8m0: Tensor, columnwise: bool, dtype: torch.dtype) -> Tensor:
    return mxfp8_dequantize_triton(q, e8m0, columnwise=columnwise, dtype=dtype)


@register_fake("dist_quant::mxfp8_dequantize")
def _(q: Tensor, e8m0: Tensor, columnwise: bool, dtype: torch.dtype) -> Tensor:
    # columnwise: the (rows, cols) matrix is the transpose of q's (cols, rows) layout
    out = q.new_empty(tuple(q.shape), dtype=dtype)
    return out.t() if columnwise else out


@custom_op("dist_quant::block_dequantize", mutates_args=())
def block_dequantize(q: Tensor, scale_inv: Tensor, block_dim: int, dtype: torch.dtype) -> Tensor:
    return reference.block_dequantize(q, scale_inv, block_dim=block_dim, dtype=dtype).contiguous()


@block_dequantize.register_kernel("cuda")
def _(q: Tensor, scale_inv: Tensor, block_dim: int, dtype: torch.dtype) -> Tensor:
    return block_dequantize_triton(q, scale_inv, block_dim=block_dim, dtype=dtype).contiguous()


@register_fake("dist_quant::block_dequantize")
def _(q: Tensor, scale_inv: Tensor, block_dim: int, dtype: torch.dtype) -> Tensor:
    return q.new_empty(q.shape, dtype=dtype)


# ---- block-scaled GEMM (Triton only: the CPU path is gemm.py's emulation) ----------------------
@custom_op("dist_quant::block_scaled_gemm", mutates_args=(), device_types="cuda")
def block_scaled_gemm(
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


@register_fake("dist_quant::block_scaled_gemm")
def _(
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
