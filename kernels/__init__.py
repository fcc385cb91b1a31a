"""FP8 kernels: Triton implementations and the PyTorch reference they match bit for bit.

The functions here are dispatchers with the reference's names and signatures. Each calls one
``torch.library`` custom op of ``kernels/ops.py`` / ``ops_block.py`` (``torch.ops.dist_quant.*``): CUDA tensors run
the Triton launcher in ``kernels/<op>.py``, everything else ``reference`` (CPU keeps the plain
PyTorch path; the Triton kernels run on CPU only in the tests, under ``TRITON_INTERPRET=1``).
Going through the ops is what lets ``torch.compile`` trace a quantized step (fake implementations,
declared in-place writes) and keeps the compiled step the same computation as the eager one. A
Python-float scale (tests, interactive use) skips the op: an op takes tensors.

Fused operations with no single reference function:

- ``cast_to_fp8_with_amax`` / ``cast_transpose_with_amax`` (delayed scaling): the cast, plus
  ``amax_out = max(amax_out, amax(x))`` in place in the same pass (``amax_out`` a 1-element fp32
  view holding a value >= 0, such as ``amax_history[0]``'s slot);
- ``delayed_cast``: the delayed-scaling quantizer's whole cast, the fused cast above plus
  ``scale_inv = 1 / scale``, one launch on CUDA, returning a ``DelayedCast``;
- ``current_scaling_cast``: ``amax`` -> ``current_scale`` -> cast (and transpose), two launches and
  no host sync on CUDA, returning a ``CurrentScalingCast``;
- ``delayed_scaling_update_groups``: ``delayed_scaling_update`` for a list of
  ``(amax_history, scale, fp8_max, margin, algo)`` groups, one launch on CUDA.

NVFP4 (``reference_nvfp4.py`` is its definition): ``nvfp4_cast`` is the ``dist_quant::nvfp4_cast``
op (``kernels/nvfp4.py``), rowwise or columnwise, 16x16 blocks, RHT and stochastic rounding in one
pass; ``quantize_nvfp4``, ``random_hadamard_transform``, ``dequantize_nvfp4``, ``nvfp4_gemm`` and
``nvfp4_global_scales`` are the reference functions themselves (torch ops, exact on any device).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from dist_quant.kernels import nvfp4, ops, ops_block, reference, reference_nvfp4
from dist_quant.kernels._launch import EAGER_TENSOR_TYPES
from dist_quant.kernels.block_gemm import block_scaled_gemm_triton
from dist_quant.kernels.cast import (
    DelayedCast,
    cast_to_fp8_triton,
    cast_transpose_triton,
    delayed_cast_triton,
)
from dist_quant.kernels.current import CurrentScalingCast, current_scaling_cast_triton
from dist_quant.kernels.delayed_update import delayed_scaling_update_groups_triton
from dist_quant.kernels.dequantize import dequantize_triton
from dist_quant.kernels.kinds_base import AmaxAlgo, spellings
from dist_quant.kernels.nvfp4 import nvfp4_cast_triton
from torch import Tensor

# Constants and helpers of the reference, so this module is a drop-in for it.
FP8_DTYPES = reference.FP8_DTYPES
FLT_MAX = reference.FLT_MAX
fp8_max = reference.fp8_max

# NVFP4 (kernels/reference_nvfp4.py is its bit-level definition).
NVFP4Cast = reference_nvfp4.NVFP4Cast
NVFP4Operand = reference_nvfp4.NVFP4Operand
NVFP4_RHT_SIGNS = reference_nvfp4.NVFP4_RHT_SIGNS
nvfp4_global_scales = reference_nvfp4.nvfp4_global_scales
quantize_nvfp4 = reference_nvfp4.quantize_nvfp4
random_hadamard_transform = reference_nvfp4.random_hadamard_transform
dequantize_nvfp4 = reference_nvfp4.dequantize_nvfp4
nvfp4_gemm = reference_nvfp4.nvfp4_gemm

__all__ = [
    "FLT_MAX",
    "FP8_DTYPES",
    "NVFP4Cast",
    "NVFP4Operand",
    "NVFP4_RHT_SIGNS",
    "CurrentScalingCast",
    "DelayedCast",
    "amax",
    "block_cast",
    "block_dequantize",
    "block_scaled_gemm",
    "block_scaled_gemm_triton",
    "cast_to_fp8",
    "cast_to_fp8_with_amax",
    "cast_transpose",
    "cast_transpose_with_amax",
    "current_scale",
    "current_scaling_cast",
    "delayed_cast",
    "delayed_scaling_update",
    "delayed_scaling_update_groups",
    "dequantize",
    "fp8_max",
    "mxfp8_cast",
    "mxfp8_dequantize",
    "dequantize_nvfp4",
    "nvfp4_cast",
    "nvfp4_cast_triton",
    "nvfp4_gemm",
    "nvfp4_global_scales",
    "quantize_nvfp4",
    "random_hadamard_transform",
    "reference",
    "reference_nvfp4",
]


def amax(x: Tensor) -> Tensor:
    return ops.amax(x.detach())


def _float_scale_cast(x: Tensor, scale: float, fp8_dtype: torch.dtype, transpose: bool):
    if transpose:
        fn = cast_transpose_triton if x.is_cuda else reference.cast_transpose
    else:
        fn = cast_to_fp8_triton if x.is_cuda else reference.cast_to_fp8
    return fn(x, scale, fp8_dtype)


def cast_to_fp8(x: Tensor, scale: Tensor | float, fp8_dtype: torch.dtype) -> Tensor:
    if not isinstance(scale, Tensor):
        return _float_scale_cast(x, scale, fp8_dtype, transpose=False)
    return ops.cast_to_fp8(x.detach(), scale, fp8_dtype)


def cast_transpose(
    x: Tensor, scale: Tensor | float, fp8_dtype: torch.dtype
) -> tuple[Tensor, Tensor]:
    if not isinstance(scale, Tensor):
        return _float_scale_cast(x, scale, fp8_dtype, transpose=True)
    return ops.cast_transpose(x.detach(), scale, fp8_dtype)


def cast_to_fp8_with_amax(
    x: Tensor, scale: Tensor | float, fp8_dtype: torch.dtype, amax_out: Tensor
) -> Tensor:
    scale = scale if isinstance(scale, Tensor) else _scale_tensor(scale, x.device)
    return ops.cast_to_fp8_with_amax(x.detach(), scale, fp8_dtype, amax_out)


def cast_transpose_with_amax(
    x: Tensor, scale: Tensor | float, fp8_dtype: torch.dtype, amax_out: Tensor
) -> tuple[Tensor, Tensor]:
    scale = scale if isinstance(scale, Tensor) else _scale_tensor(scale, x.device)
    return ops.cast_transpose_with_amax(x.detach(), scale, fp8_dtype, amax_out)


def delayed_cast(
    x: Tensor, scale: Tensor, fp8_dtype: torch.dtype, amax_out: Tensor, *, transpose: bool
) -> DelayedCast:
    """A delayed-scaling quantizer's cast: ``cast_to_fp8_with_amax`` (``cast_transpose_with_amax``
    when ``transpose``) plus ``scale_inv = 1 / scale`` taken at this point of the stream (the
    update changes ``scale`` later); one launch on CUDA.

    An eager call on a plain CUDA tensor goes straight to the launcher the op would run (as
    ``delayed_scaling_update_groups`` does): a training step casts a few tensors per module, and
    the op layer and the detach cost more host time than the relaunch itself."""
    if _eager_cuda(x):
        return delayed_cast_triton(x, scale, fp8_dtype, amax_out, transpose=transpose)
    if transpose:
        return DelayedCast(*ops.delayed_cast_transpose(x.detach(), scale, fp8_dtype, amax_out))
    q, scale_inv = ops.delayed_cast(x.detach(), scale, fp8_dtype, amax_out)
    return DelayedCast(q, None, scale_inv)


def _eager_cuda(x: Tensor) -> bool:
    """A plain CUDA tensor or parameter outside torch.compile's tracing (dynamo sees a traced
    tensor's type as ``Tensor``, hence the explicit check): the launchers take it as it is, no
    detach needed (their outputs are new tensors and carry no autograd history)."""
    return type(x) in EAGER_TENSOR_TYPES and x.is_cuda and not torch.compiler.is_compiling()


def _scale_tensor(scale: float, device: torch.device) -> Tensor:
    return torch.tensor([scale], dtype=torch.float32, device=device)


def current_scale(
    amax: Tensor,
    fp8_dtype: torch.dtype,
    *,
    amax_epsilon: float = 0.0,
    use_power_2_scales: bool = False,
) -> tuple[Tensor, Tensor]:
    return ops.current_scale(
        amax.detach(), fp8_dtype, float(amax_epsilon), bool(use_power_2_scales)
    )


def current_scaling_cast(
    x: Tensor,
    fp8_dtype: torch.dtype,
    *,
    amax_epsilon: float = 0.0,
    use_power_2_scales: bool = False,
    transpose: bool = False,
) -> CurrentScalingCast:
    eps, pow2 = float(amax_epsilon), bool(use_power_2_scales)
    if _eager_cuda(x):  # as in delayed_cast
        return current_scaling_cast_triton(
            x, fp8_dtype, amax_epsilon=eps, use_power_2_scales=pow2, transpose=transpose
        )
    if transpose:
        return CurrentScalingCast(
            *ops.current_scaling_cast_transpose(x.detach(), fp8_dtype, eps, pow2)
        )
    q, scale, scale_inv, a = ops.current_scaling_cast(x.detach(), fp8_dtype, eps, pow2)
    return CurrentScalingCast(q, None, scale, scale_inv, a)


def delayed_scaling_update(
    amax_history: Tensor,
    scale: Tensor,
    fp8_max_per_slot: Tensor | float,
    *,
    margin: float,
    algo: AmaxAlgo | str,
) -> None:
    delayed_scaling_update_groups([(amax_history, scale, fp8_max_per_slot, margin, algo)])


def delayed_scaling_update_groups(groups: Sequence[Sequence]) -> None:
    """Every ``(amax_history, scale, fp8_max, margin, algo)`` group in place: one op call, one
    launch on CUDA (the reference one group after another elsewhere).

    Eager CUDA calls skip the op and go straight to the launcher the op would run: it validates
    and tables a list of buffers once and relaunches it while the buffers keep their storage, so a
    training step's update costs a dict lookup and one launch of host time.
    """
    if not groups:
        return
    first = groups[0]
    if len(first) == 5 and isinstance(first[0], Tensor) and _eager_cuda(first[0]):
        delayed_scaling_update_groups_triton(groups)
        return
    for i, g in enumerate(groups):
        if len(g) != 5 or g[4] not in tuple(AmaxAlgo):
            raise ValueError(
                f"delayed_scaling_update: group {i}: expected (amax_history, scale, fp8_max, "
                f"margin, algo) with algo {spellings(AmaxAlgo)}, got {g!r}"
            )
    limits = [
        g[2] if isinstance(g[2], Tensor) else torch.tensor(float(g[2]), device=g[0].device)
        for g in groups
    ]
    ops.delayed_scaling_update_groups(
        [g[0] for g in groups],
        [g[1] for g in groups],
        [limit.float() for limit in limits],
        [float(g[3]) for g in groups],
        [AmaxAlgo(g[4]).code for g in groups],
    )


def mxfp8_cast(
    x: Tensor, fp8_dtype: torch.dtype, *, columnwise: bool = False
) -> tuple[Tensor, Tensor]:
    return ops_block.mxfp8_cast(x.detach(), fp8_dtype, bool(columnwise))


def mxfp8_dequantize(
    q: Tensor, e8m0: Tensor, *, columnwise: bool = False, dtype: torch.dtype = torch.float32
) -> Tensor:
    return ops_block.mxfp8_dequantize(q, e8m0, bool(columnwise), dtype)


def block_cast(
    x: Tensor, fp8_dtype: torch.dtype, *, block_dim: int, use_power_2_scales: bool = True
) -> tuple[Tensor, Tensor]:
    return ops_block.block_cast(x.detach(), fp8_dtype, block_dim, bool(use_power_2_scales))


def block_dequantize(
    q: Tensor, scale_inv: Tensor, *, block_dim: int, dtype: torch.dtype = torch.float32
) -> Tensor:
    return ops_block.block_dequantize(q, scale_inv, block_dim, dtype)


def dequantize(q: Tensor, scale_inv: Tensor | float, dtype: torch.dtype = torch.float32) -> Tensor:
    if not isinstance(scale_inv, Tensor):
        fn = dequantize_triton if q.is_cuda else reference.dequantize
        return fn(q, scale_inv, dtype)
    return ops_block.dequantize(q, scale_inv, dtype)


def block_scaled_gemm(
    a_data: Tensor,
    a_scale_inv: Tensor,
    a_block_dim: int,
    b_data: Tensor,
    b_scale_inv: Tensor,
    b_block_dim: int,
    *,
    out_dtype: torch.dtype,
    bias: Tensor | None = None,
) -> Tensor:
    """The Triton block-scaled GEMM (CUDA only) as the ``dist_quant::block_scaled_gemm`` op."""
    return ops_block.block_scaled_gemm(
        a_data, a_scale_inv, a_block_dim, b_data, b_scale_inv, b_block_dim, out_dtype,
        None if bias is None else bias.detach(),
    )  # fmt: skip


def nvfp4_cast(
    x: Tensor,
    amax: Tensor | float,
    *,
    columnwise: bool = False,
    block_2d: bool = False,
    rht: bool = False,
    stochastic: bool = False,
    seed: int = 0,
    offset: int = 0,
) -> reference_nvfp4.NVFP4Cast:
    """``reference_nvfp4.nvfp4_cast`` as the ``dist_quant::nvfp4_cast`` op: one Triton pass on CUDA
    (the columnwise cast reads ``x`` in place), the reference elsewhere. ``amax`` may stay on the
    device: nothing is synchronised with the host."""
    amax_t = torch.as_tensor(amax, dtype=torch.float32, device=x.device).reshape(1)
    return reference_nvfp4.NVFP4Cast(
        *nvfp4.nvfp4_cast_op(
            x.detach(), amax_t.detach(), bool(columnwise), bool(block_2d), bool(rht),
            bool(stochastic), int(seed), int(offset),
        )
    )  # fmt: skip
