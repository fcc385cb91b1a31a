"""``gemm(a, b, out_dtype=...) = a @ b.T`` over plain tensors and FP8 ``GemmOperand``s.

Both operands are contracted along their last dim: ``a`` is ``(M, K)``, ``b`` is ``(N, K)``, the
result ``(M, N)``. Paths, in order:

1. both plain tensors of one dtype: ``torch.matmul`` in that dtype (the high-precision path);
2. CUDA sm89+, both operands per-tensor FP8, not both E5M2 (no such cuBLASLt kernel), ``K`` and
   ``N`` divisible by 16 (cuBLASLt FP8 alignment): ``torch._scaled_mm`` with fp32 accumulation;
3. CUDA sm90+, both operands Float8 block-scaled (1x128 or 128x128 tiles), output fp32/bf16/fp16:
   the Triton block-scaled GEMM (``kernels/block_gemm.py``, as the ``dist_quant::block_scaled_gemm``
   op), which scales each 128-deep partial
   product of the FP8 tensor cores and accumulates in fp32;
4. both operands NVFP4: ``nvfp4_gemm``, the contract's GEMM emulated exactly (fp32 products per
   16-element block scaled by both block scales, fp32 accumulation in block order, times
   ``alpha = amax_a * amax_b / (6^2 * 448^2)``), on CPUs and on Hopper alike (no FP4 tensor cores
   before Blackwell), the same bits on both; a transform applied to both wgrad operands cancels
   in the product, and where only one went through it (``input_rht`` without
   ``grad_output_rht``, or the reverse) the other's E2M1 values are transformed exactly first;
5. otherwise the exact emulation: dequantize both to fp32 (an NVFP4 operand's transform undone),
   ``torch.matmul`` in fp32, cast to ``out_dtype``. This is what CPUs use, and MXFP8 or mixed
   operands everywhere; its fp32 accumulation order is the device's.
"""

from __future__ import annotations

import torch
from torch import Tensor

from dist_quant.kernels import block_scaled_gemm, nvfp4_gemm
from dist_quant.kinds import SCALED_MM_ALIGNMENT, OperandLayout
from dist_quant.tensor import GemmOperand, rounded_to

_BLOCK_GEMM_OUT = (torch.float32, torch.bfloat16, torch.float16)


def gemm(
    a: Tensor | GemmOperand,
    b: Tensor | GemmOperand,
    *,
    out_dtype: torch.dtype,
    bias: Tensor | None = None,
) -> Tensor:
    """``a @ b.T (+ bias)`` for ``a`` ``(M, K)`` and ``b`` ``(N, K)``: ``(M, N)`` in ``out_dtype``.

    The bias is added before the final rounding to ``out_dtype`` (in fp32 on the emulated path, in
    the GEMM epilogue on ``_scaled_mm``).
    """
    if not isinstance(a, _OPERANDS) or not isinstance(b, _OPERANDS):
        name, op = ("a", a) if not isinstance(a, _OPERANDS) else ("b", b)
        raise TypeError(
            f"gemm: operand {name} must be a torch.Tensor or GemmOperand, got {type(op).__name__}"
        )
    a_shape, b_shape = a.shape, b.shape
    if len(a_shape) != 2 or len(b_shape) != 2 or a_shape[1] != b_shape[1]:
        raise ValueError(
            f"gemm: computes a @ b.T and needs a (M, K) and b (N, K); got a {tuple(a_shape)} "
            f"and b {tuple(b_shape)}"
        )
    if bias is not None and bias.shape != (b_shape[0],):
        raise ValueError(f"gemm: bias must have shape ({b_shape[0]},), got {tuple(bias.shape)}")
    if _can_use_scaled_mm(a, b):
        return _scaled_mm(a.data, a.scale_inv, b.data, b.scale_inv, out_dtype, bias)
    if isinstance(a, Tensor) and isinstance(b, Tensor) and a.dtype == b.dtype:
        out = torch.matmul(a, b.t())
        return rounded_to(out if bias is None else out + bias.to(out.dtype), out_dtype)
    if _both_nvfp4(a, b):
        out = nvfp4_gemm(
            (a.data, a.scale_inv, a.amax, a.rht), (b.data, b.scale_inv, b.amax, b.rht)
        )  # fp32
        return rounded_to(out if bias is None else out + bias.float(), out_dtype)
    if _can_use_block_gemm(a, b, out_dtype):
        return block_scaled_gemm(
            a.data, a.scale_inv, a.scaling.block_dim,
            b.data, b.scale_inv, b.scaling.block_dim,
            out_dtype=out_dtype, bias=bias,
        )  # fmt: skip
    a_hp = a.dequantize(torch.float32) if isinstance(a, GemmOperand) else a.float()
    b_hp = b.dequantize(torch.float32) if isinstance(b, GemmOperand) else b.float()
    out = torch.matmul(a_hp, b_hp.t())
    return rounded_to(out if bias is None else out + bias.float(), out_dtype)


_OPERANDS = (Tensor, GemmOperand)


def per_tensor_gemm(
    a: Tensor,
    a_scale_inv: Tensor,
    b: Tensor,
    b_scale_inv: Tensor,
    *,
    out_dtype: torch.dtype,
    bias: Tensor | None = None,
) -> Tensor:
    """``gemm`` of two per-tensor FP8 operands given as their 2D bytes (``a`` ``(M, K)``, ``b``
    ``(N, K)``) and (1,) fp32 scale inverses, for callers that hold the bytes (the per-tensor
    linear path): the same computation, without building operands on the ``_scaled_mm`` path."""
    if _scaled_mm_fits(a, b):
        return _scaled_mm(a, a_scale_inv, b, b_scale_inv, out_dtype, bias)
    return gemm(
        GemmOperand(a, a_scale_inv, OperandLayout.TENSOR, a.dtype),
        GemmOperand(b, b_scale_inv, OperandLayout.TENSOR, b.dtype),
        out_dtype=out_dtype,
        bias=bias,
    )


def _scaled_mm(
    a: Tensor,
    a_scale_inv: Tensor,
    b: Tensor,
    b_scale_inv: Tensor,
    out_dtype: torch.dtype,
    bias: Tensor | None,
) -> Tensor:
    # cuBLASLt wants a row-major and b column-major: b is (N, K) row-major, so b.t() is (K, N)
    # column-major without a copy (.contiguous() of a contiguous tensor returns it before
    # reaching the dispatcher). cuBLASLt's bias epilogue exists for 16-bit outputs only; an fp32
    # output adds it after.
    epilogue_bias = bias is not None and out_dtype != torch.float32
    if epilogue_bias and bias.dtype != out_dtype:
        bias = bias.to(out_dtype)
    out = torch._scaled_mm(
        a.contiguous(),
        b.contiguous().t(),
        scale_a=_scaled_mm_scale(a_scale_inv),
        scale_b=_scaled_mm_scale(b_scale_inv),
        bias=bias if epilogue_bias else None,
        out_dtype=out_dtype,
    )
    return out + bias.float() if bias is not None and not epilogue_bias else out


_capability: dict[int, tuple[int, int]] = {}


def _device_capability(index: int) -> tuple[int, int]:
    """The capability of CUDA device ``index``, cached: get_device_capability costs more host time
    than the rest of the dispatch."""
    cap = _capability.get(index)
    if cap is None:
        cap = _capability[index] = torch.cuda.get_device_capability(index)
    return cap


def _scaled_mm_scale(scale_inv: Tensor) -> Tensor:
    """A per-tensor ``scale_inv`` as torch._scaled_mm takes it: a 1-element fp32 tensor, of shape
    ``(1,)`` so that both operands' scales have one rank (inductor's scaled-mm templates require
    it). The quantizers' scales already are: each torch call skipped saves microseconds of host
    time per GEMM."""
    if scale_inv.dtype != torch.float32:
        scale_inv = scale_inv.float()
    return scale_inv if scale_inv.dim() == 1 else scale_inv.reshape(1)


def _can_use_scaled_mm(a: Tensor | GemmOperand, b: Tensor | GemmOperand) -> bool:
    if type(a) is not GemmOperand or type(b) is not GemmOperand:
        return False
    if a.scaling is not OperandLayout.TENSOR or b.scaling is not OperandLayout.TENSOR:
        return False
    return _scaled_mm_fits(a.data, b.data)


def _scaled_mm_fits(a: Tensor, b: Tensor) -> bool:
    """Whether cuBLASLt's per-tensor FP8 GEMM takes 2D FP8 ``a`` ``(M, K)`` and ``b`` ``(N, K)``."""
    if a.dtype == b.dtype == torch.float8_e5m2:
        return False
    index = a.get_device()  # -1 on the CPU; an int, cheaper than a torch.device
    if index < 0 or b.get_device() != index:
        return False
    if _device_capability(index) < (8, 9):
        return False
    (m, k), n = a.shape, b.shape[0]
    if min(m, k, n) == 0:  # nothing to multiply; the emulation handles empty shapes
        return False
    return k % SCALED_MM_ALIGNMENT == 0 and n % SCALED_MM_ALIGNMENT == 0


def _both_nvfp4(a: Tensor | GemmOperand, b: Tensor | GemmOperand) -> bool:
    return (
        isinstance(a, GemmOperand)
        and isinstance(b, GemmOperand)
        and a.scaling is OperandLayout.NVFP4
        and b.scaling is OperandLayout.NVFP4
    )


def _can_use_block_gemm(
    a: Tensor | GemmOperand, b: Tensor | GemmOperand, out_dtype: torch.dtype
) -> bool:
    if not (isinstance(a, GemmOperand) and isinstance(b, GemmOperand)):
        return False
    if a.scaling.block_dim is None or b.scaling.block_dim is None:
        return False
    if out_dtype not in _BLOCK_GEMM_OUT:
        return False
    index = a.data.get_device()
    if index < 0 or b.data.get_device() != index:
        return False
    # FP8 operands of tl.dot need FP8 tensor cores that the kernel was tuned for: Hopper and later
    return _device_capability(index) >= (9, 0)
