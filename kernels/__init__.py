"""FP8 kernels: Triton implementations and the PyTorch reference they match bit for bit.

The functions here are dispatchers with the reference's names and signatures: CUDA tensors go to
the Triton launcher in ``kernels/<op>.py``, everything else to ``reference`` (CPU keeps the plain
PyTorch path; the Triton kernels run on CPU only in the tests, under ``TRITON_INTERPRET=1``).

Fused operations with no single reference function:

- ``cast_to_fp8_with_amax`` / ``cast_transpose_with_amax`` (delayed scaling): the cast, plus
  ``amax_out = max(amax_out, amax(x))`` in place in the same pass (``amax_out`` a 1-element fp32
  view holding a value >= 0, such as ``amax_history[0]``'s slot);
- ``current_scaling_cast``: ``amax`` -> ``current_scale`` -> cast (and transpose), two launches and
  no host sync on CUDA, returning a ``CurrentScalingCast``;
- ``delayed_scaling_update_groups``: ``delayed_scaling_update`` for a list of
  ``(amax_history, scale, fp8_max, margin, algo)`` groups, one launch on CUDA.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from dist_quant.kernels import reference
from dist_quant.kernels.block import block_cast_triton
from dist_quant.kernels.block_gemm import block_scaled_gemm_triton
from dist_quant.kernels.cast import cast_to_fp8_triton, cast_transpose_triton
from dist_quant.kernels.current import (
    CurrentScalingCast,
    amax_triton,
    current_scale_triton,
    current_scaling_cast_triton,
)
from dist_quant.kernels.delayed_update import (
    delayed_scaling_update_groups_triton,
    delayed_scaling_update_triton,
)
from dist_quant.kernels.dequantize import (
    block_dequantize_triton,
    dequantize_triton,
    mxfp8_dequantize_triton,
)
from dist_quant.kernels.mxfp8 import mxfp8_cast_triton
from torch import Tensor

# Constants and helpers of the reference, so this module is a drop-in for it.
FP8_DTYPES = reference.FP8_DTYPES
FLT_MAX = reference.FLT_MAX
fp8_max = reference.fp8_max

__all__ = [
    "FLT_MAX",
    "FP8_DTYPES",
    "CurrentScalingCast",
    "amax",
    "block_cast",
    "block_dequantize",
    "block_scaled_gemm_triton",
    "cast_to_fp8",
    "cast_to_fp8_with_amax",
    "cast_transpose",
    "cast_transpose_with_amax",
    "current_scale",
    "current_scaling_cast",
    "delayed_scaling_update",
    "delayed_scaling_update_groups",
    "dequantize",
    "fp8_max",
    "mxfp8_cast",
    "mxfp8_dequantize",
    "reference",
]


def amax(x: Tensor) -> Tensor:
    return amax_triton(x) if x.is_cuda else reference.amax(x)


def cast_to_fp8(x: Tensor, scale: Tensor | float, fp8_dtype: torch.dtype) -> Tensor:
    if x.is_cuda:
        return cast_to_fp8_triton(x, scale, fp8_dtype)
    return reference.cast_to_fp8(x, scale, fp8_dtype)


def cast_transpose(
    x: Tensor, scale: Tensor | float, fp8_dtype: torch.dtype
) -> tuple[Tensor, Tensor]:
    if x.is_cuda:
        return cast_transpose_triton(x, scale, fp8_dtype)
    return reference.cast_transpose(x, scale, fp8_dtype)


def _accumulate_amax(amax_out: Tensor, x: Tensor) -> None:
    """Reference path of the fused ops: ``amax_out = max(amax_out, amax(x))``, NaN propagating."""
    amax_out.copy_(torch.maximum(amax_out, reference.amax(x)))


def cast_to_fp8_with_amax(
    x: Tensor, scale: Tensor | float, fp8_dtype: torch.dtype, amax_out: Tensor
) -> Tensor:
    if x.is_cuda:
        return cast_to_fp8_triton(x, scale, fp8_dtype, amax_out=amax_out)
    q = reference.cast_to_fp8(x, scale, fp8_dtype)
    _accumulate_amax(amax_out, x)
    return q


def cast_transpose_with_amax(
    x: Tensor, scale: Tensor | float, fp8_dtype: torch.dtype, amax_out: Tensor
) -> tuple[Tensor, Tensor]:
    if x.is_cuda:
        return cast_transpose_triton(x, scale, fp8_dtype, amax_out=amax_out)
    q, q_t = reference.cast_transpose(x, scale, fp8_dtype)
    _accumulate_amax(amax_out, x)
    return q, q_t


def current_scale(
    amax: Tensor,
    fp8_dtype: torch.dtype,
    *,
    amax_epsilon: float = 0.0,
    use_power_2_scales: bool = False,
) -> tuple[Tensor, Tensor]:
    fn = current_scale_triton if amax.is_cuda else reference.current_scale
    return fn(amax, fp8_dtype, amax_epsilon=amax_epsilon, use_power_2_scales=use_power_2_scales)


def current_scaling_cast(
    x: Tensor,
    fp8_dtype: torch.dtype,
    *,
    amax_epsilon: float = 0.0,
    use_power_2_scales: bool = False,
    transpose: bool = False,
) -> CurrentScalingCast:
    if x.is_cuda:
        return current_scaling_cast_triton(
            x, fp8_dtype, amax_epsilon=amax_epsilon, use_power_2_scales=use_power_2_scales,
            transpose=transpose,
        )  # fmt: skip
    a = reference.amax(x)
    scale, scale_inv = reference.current_scale(
        a, fp8_dtype, amax_epsilon=amax_epsilon, use_power_2_scales=use_power_2_scales
    )
    if transpose:
        q, q_t = reference.cast_transpose(x, scale, fp8_dtype)
    else:
        q, q_t = reference.cast_to_fp8(x, scale, fp8_dtype), None
    return CurrentScalingCast(q, q_t, scale.reshape(1), scale_inv.reshape(1), a)


def delayed_scaling_update(
    amax_history: Tensor,
    scale: Tensor,
    fp8_max_per_slot: Tensor | float,
    *,
    margin: float,
    algo: str,
) -> None:
    fn = delayed_scaling_update_triton if amax_history.is_cuda else reference.delayed_scaling_update
    fn(amax_history, scale, fp8_max_per_slot, margin=margin, algo=algo)


def delayed_scaling_update_groups(groups: Sequence[Sequence]) -> None:
    """All groups in one launch when they live on a CUDA device; the reference one by one else."""
    if groups and all(g[0].is_cuda for g in groups):
        delayed_scaling_update_groups_triton(groups)
        return
    for history, scale, fp8_max, margin, algo in groups:
        reference.delayed_scaling_update(history, scale, fp8_max, margin=margin, algo=algo)


def mxfp8_cast(
    x: Tensor, fp8_dtype: torch.dtype, *, columnwise: bool = False
) -> tuple[Tensor, Tensor]:
    fn = mxfp8_cast_triton if x.is_cuda else reference.mxfp8_cast
    return fn(x, fp8_dtype, columnwise=columnwise)


def mxfp8_dequantize(
    q: Tensor, e8m0: Tensor, *, columnwise: bool = False, dtype: torch.dtype = torch.float32
) -> Tensor:
    fn = mxfp8_dequantize_triton if q.is_cuda else reference.mxfp8_dequantize
    return fn(q, e8m0, columnwise=columnwise, dtype=dtype)


def block_cast(
    x: Tensor, fp8_dtype: torch.dtype, *, block_dim: int, use_power_2_scales: bool = True
) -> tuple[Tensor, Tensor]:
    fn = block_cast_triton if x.is_cuda else reference.block_cast
    return fn(x, fp8_dtype, block_dim=block_dim, use_power_2_scales=use_power_2_scales)


def block_dequantize(
    q: Tensor, scale_inv: Tensor, *, block_dim: int, dtype: torch.dtype = torch.float32
) -> Tensor:
    fn = block_dequantize_triton if q.is_cuda else reference.block_dequantize
    return fn(q, scale_inv, block_dim=block_dim, dtype=dtype)


def dequantize(q: Tensor, scale_inv: Tensor | float, dtype: torch.dtype = torch.float32) -> Tensor:
    fn = dequantize_triton if q.is_cuda else reference.dequantize
    return fn(q, scale_inv, dtype)
