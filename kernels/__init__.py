"""FP8 kernels: Triton implementations and the PyTorch reference they match bit for bit.

One file per kernel op, or per small family of ops that share a kernel, each read top to bottom:
the Triton kernel, its launcher, the reference call, the ``torch.library`` registration with its
fake, and the public function, which calls the op through ``_op.KernelOp``, the one dispatch
path (eager calls run the launcher or the reference directly; torch.compile traces the op):

- ``cast.py``: ``cast_to_fp8``, ``cast_transpose`` (the per-tensor cast kernels);
- ``delayed.py``: ``delayed_cast`` (a delayed-scaling quantizer's whole cast: the bytes and
  transpose, the amax folded into the history slot and ``1 / scale``, one launch),
  ``cast_to_fp8_with_amax`` / ``cast_transpose_with_amax`` (its bytes);
- ``current.py``: ``amax``, ``current_scale``, ``current_scaling_cast`` (amax -> scale -> cast in
  two launches, no host sync);
- ``delayed_update.py``: ``delayed_scaling_update`` / ``_groups`` (every group in one launch);
- ``mxfp8.py``: ``mxfp8_cast``; ``block.py``: ``block_cast``;
- ``dequantize.py``: ``dequantize``, ``mxfp8_dequantize``, ``block_dequantize``;
- ``block_gemm.py``: ``block_scaled_gemm`` (CUDA only);
- ``nvfp4.py``: ``nvfp4_cast`` (``reference_nvfp4.py`` is its definition; ``quantize_nvfp4``,
  ``random_hadamard_transform``, ``dequantize_nvfp4``, ``nvfp4_gemm`` and
  ``nvfp4_global_scales`` are the reference functions themselves, exact on any device);
- ``fp8_stats.py``: ``cast_stats`` (telemetry; imported from there, not exported here);
- ``swiglu.py``: ``swiglu``, ``swiglu_backward`` (LayerNormMLP's activation, torch's bits on
  CUDA in one launch each); ``swiglu_cast.py``: ``delayed_swiglu_cast``, ``current_swiglu_cast``
  (SwiGLU fused with fc2's per-tensor input cast: the cast's bytes without writing SwiGLU's output);
  ``swiglu_backward_cast.py``: ``delayed_swiglu_backward_cast``, ``current_swiglu_backward_cast``
  (its backward fused with fc1's per-tensor grad-output cast, likewise).
- ``attention.py``: ``fp8_attention_fwd``, ``fp8_attention_bwd`` (FP8 flash attention, kernels
  in ``attention_fwd.py`` / ``attention_bwd.py``, held to a tolerance of its float64 definition
  ``reference_attention.py``; imported from there, not exported here).

``reference.py`` is the numerics contract every kernel matches; the CPU runs it, and the Triton
kernels run on the CPU only in the tests, under ``TRITON_INTERPRET=1``.
"""

from __future__ import annotations

from dist_quant.kernels import reference, reference_nvfp4
from dist_quant.kernels.block import block_cast
from dist_quant.kernels.block_gemm import block_scaled_gemm, block_scaled_gemm_triton
from dist_quant.kernels.cast import cast_to_fp8, cast_transpose
from dist_quant.kernels.current import CurrentScalingCast, amax, current_scale, current_scaling_cast
from dist_quant.kernels.delayed import (
    DelayedCast,
    cast_to_fp8_with_amax,
    cast_transpose_with_amax,
    delayed_cast,
)
from dist_quant.kernels.delayed_update import delayed_scaling_update, delayed_scaling_update_groups
from dist_quant.kernels.dequantize import block_dequantize, dequantize, mxfp8_dequantize
from dist_quant.kernels.mxfp8 import mxfp8_cast
from dist_quant.kernels.nvfp4 import nvfp4_cast, nvfp4_cast_triton
from dist_quant.kernels.reference import FLT_MAX, FP8_DTYPES, fp8_max
from dist_quant.kernels.reference_nvfp4 import (
    NVFP4_RHT_SIGNS,
    NVFP4Cast,
    NVFP4Operand,
    dequantize_nvfp4,
    nvfp4_gemm,
    nvfp4_global_scales,
    quantize_nvfp4,
    random_hadamard_transform,
)
from dist_quant.kernels.swiglu import swiglu, swiglu_backward
from dist_quant.kernels.swiglu_backward_cast import (
    current_swiglu_backward_cast,
    delayed_swiglu_backward_cast,
)
from dist_quant.kernels.swiglu_cast import current_swiglu_cast, delayed_swiglu_cast

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
    "current_swiglu_backward_cast",
    "current_swiglu_cast",
    "delayed_cast",
    "delayed_scaling_update",
    "delayed_scaling_update_groups",
    "delayed_swiglu_backward_cast",
    "delayed_swiglu_cast",
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
    "swiglu",
    "swiglu_backward",
]
