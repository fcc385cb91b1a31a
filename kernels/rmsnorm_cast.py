"""RMSNorm fused with a delayed-scaling FP8 cast, written to reproduce torch's CUDA ``F.rms_norm``
bit for bit: NOT used by the modules until ``tests/kernels/test_rmsnorm_cast.py``'s GPU test
proves it on the H200 (torch 2.11).

What it reproduces (torch's ``_fused_rms_norm`` CUDA kernel, the vectorised path of
``layer_norm_kernel.cu`` with ``rms_norm=true``, taken when the row length N is a multiple of 4 and
the buffers are 16-byte aligned): one block of 32 x 16 threads per row; thread ``t`` walks the
row's 4-element vectors ``t, t + 512, ...`` and accumulates ``s = fma(v, v, s)`` element by
element in fp32; the 32 lanes of a warp are summed by shuffle-down (lane l += lane l + 16, + 8,
..., + 1), then the 16 warps by the same halving through shared memory (warp w += warp w + 8,
+ 4, + 2, + 1); ``rstd = rsqrtf(s / N + eps)`` (IEEE division, CUDA's ``rsqrtf``); the output is
``gamma * (rstd * x)`` in fp32, rounded to x's dtype. Here one program per row does the same
additions in the same order: the per-thread chains on a (512,) vector, the two halving trees as
sums over size-2 axes of reshapes (one addition each, so no freedom of order is left).

The cast is ``fp8_encode(y * scale)`` of the rounded output with ``max|y|`` folded into
``amax_out``, as ``delayed.py``'s cast of ``F.rms_norm``'s output would. Under the interpreter
``rsqrtf`` is ``1 / sqrt`` (numpy), so only the GPU can prove the contract.
"""

from __future__ import annotations

import torch
from dist_quant.kernels._fp8_round import (
    _INTERPRETED,
    abs_bits,
    fp8_encode,
    fp8_spec,
    hw_rounding,
    reciprocal,
    to_bf16_bits,
)
from dist_quant.kernels._triton import libdevice, tl, triton
from torch import Tensor

THREADS, LANES, WARPS, VEC = 512, 32, 16, 4  # torch's block (32, 16) and vector width


@triton.jit
def _torch_block_sum(acc):
    """Sum of a (512,) vector in the order of torch's warp shuffle-down then shared-memory
    halving (thread t = lane + 32 * warp)."""
    v = tl.reshape(acc, (16, 32))
    v = tl.sum(tl.reshape(v, (16, 2, 16)), axis=1)  # lane l + lane l + 16
    v = tl.sum(tl.reshape(v, (16, 2, 8)), axis=1)
    v = tl.sum(tl.reshape(v, (16, 2, 4)), axis=1)
    v = tl.sum(tl.reshape(v, (16, 2, 2)), axis=1)
    v = tl.reshape(v, (16, 2))
    v = tl.sum(v, axis=1)  # lane 0 of each warp: (16,)
    v = tl.sum(tl.reshape(v, (2, 8)), axis=0)  # warp w + warp w + 8
    v = tl.sum(tl.reshape(v, (2, 4)), axis=0)
    v = tl.sum(tl.reshape(v, (2, 2)), axis=0)
    return tl.sum(v, axis=0)  # warp 0 + warp 1


@triton.jit
def _rmsnorm_cast_kernel(
    x_ptr,
    w_ptr,
    y_ptr,  # x's dtype (int16 view for bf16 in the interpreter); unused without WRITE_Y
    q_ptr,  # uint8 view of the FP8 output
    qt_ptr,  # uint8 (N, rows) when TRANSPOSE
    rstd_ptr,  # fp32 (rows,)
    scale_ptr,
    amax_acc_ptr,
    scale_inv_ptr,
    rows,
    N,
    eps,
    iters,
    MAX_BITS: tl.constexpr,
    MANT_BITS: tl.constexpr,
    MIN_EXP: tl.constexpr,
    WRITE_Y: tl.constexpr,
    TRANSPOSE: tl.constexpr,
    HW_ROUND: tl.constexpr,
    BITS: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    scale = tl.load(scale_ptr)
    tl.store(scale_inv_ptr, reciprocal(scale), mask=row == 0)
    x_row = x_ptr + row * N
    t = tl.arange(0, 512)
    acc = tl.zeros([512], dtype=tl.float32)
    for i in range(0, iters):  # thread t's vectors t, t + 512, ...
        base = (i * 512 + t) * 4
        ok = base < N
        for k in tl.static_range(4):
            v = tl.load(x_row + base + k, mask=ok, other=0.0).to(tl.float32)
            acc = tl.fma(v, v, acc)
    mean_sq = tl.math.div_rn(_torch_block_sum(acc), N.to(tl.float32))
    if _INTERPRETED:
        rstd = reciprocal(tl.sqrt_rn(mean_sq + eps))
    else:
        rstd = libdevice.rsqrt(mean_sq + eps)
    tl.store(rstd_ptr + row, rstd)
    amax = tl.zeros([512], dtype=tl.int32)
    for i in range(0, iters * 4):  # the second pass, 512 columns at a time
        cols = i * 512 + t
        ok = cols < N
        x = tl.load(x_row + cols, mask=ok, other=0.0).to(tl.float32)
        w = tl.load(w_ptr + cols, mask=ok, other=0.0).to(tl.float32)
        y = w * (rstd * x)
        if BITS:
            y_bits = to_bf16_bits(y)
            y = (y_bits.to(tl.int32) << 16).to(tl.float32, bitcast=True)
            if WRITE_Y:
                tl.store(y_ptr + row * N + cols, y_bits, mask=ok)
        else:
            y = y.to(x_ptr.dtype.element_ty).to(tl.float32)
            if WRITE_Y:
                tl.store(y_ptr + row * N + cols, y.to(x_ptr.dtype.element_ty), mask=ok)
        code = fp8_encode(y * scale, MAX_BITS, MANT_BITS, MIN_EXP, HW_ROUND).to(tl.uint8)
        tl.store(q_ptr + row * N + cols, code, mask=ok)
        if TRANSPOSE:
            tl.store(qt_ptr + cols.to(tl.int64) * rows + row, code, mask=ok)
        amax = tl.maximum(amax, tl.where(ok, abs_bits(y), 0))
    tl.atomic_max(amax_acc_ptr, tl.max(amax, axis=0), sem="relaxed")


def rmsnorm_cast_triton(
    x: Tensor,
    weight: Tensor,
    eps: float,
    scale: Tensor,
    fp8_dtype: torch.dtype,
    amax_out: Tensor,
    *,
    transpose: bool,
    write_y: bool,
) -> tuple[Tensor | None, Tensor, Tensor | None, Tensor, Tensor]:
    """``(y or None, q, q_t or None, scale_inv, rstd)``: ``y = F.rms_norm(x, (N,), weight, eps)``
    as torch's CUDA kernel computes it, ``q`` its delayed-scaling cast (``q_t`` the ``(N, rows)``
    transpose), ``max|y|`` folded into ``amax_out``, ``rstd`` per row (fp32). Refuses what torch's
    vectorised path would not take (N not a multiple of 4, a non-contiguous x)."""
    what = "kernels.rmsnorm_cast.rmsnorm_cast"
    spec = fp8_spec(fp8_dtype, what)
    if x.dtype not in (torch.float32, torch.bfloat16, torch.float16) or weight.dtype != x.dtype:
        raise ValueError(f"{what}: x and weight must share a float dtype, got {x.dtype} and "
                         f"{weight.dtype}")  # fmt: skip
    n = x.shape[-1]
    if n % VEC or not x.is_contiguous() or weight.shape != (n,) or not weight.is_contiguous():
        raise ValueError(
            f"{what}: needs a contiguous x whose last dim is a multiple of {VEC} (torch's "
            f"vectorised path) and a contiguous ({n},) weight; got x {tuple(x.shape)} "
            f"contiguous={x.is_contiguous()}, weight {tuple(weight.shape)}"
        )
    rows, dev = x.numel() // max(n, 1), x.device
    y = torch.empty_like(x) if write_y else None
    q = torch.empty_like(x, dtype=fp8_dtype)
    q_t = torch.empty((n, rows), dtype=fp8_dtype, device=dev) if transpose else None
    rstd = torch.empty(rows, dtype=torch.float32, device=dev)
    scale_inv = torch.empty(1, dtype=torch.float32, device=dev)
    if rows * n == 0:
        scale_inv.copy_(torch.reciprocal(scale.reshape(1)))
        return y, q, q_t, scale_inv, rstd
    bits = x.dtype == torch.bfloat16 and bool(_INTERPRETED.value)
    y_arg = q if y is None else (y.view(torch.int16) if bits else y)
    q_bytes = q.view(torch.uint8)
    _rmsnorm_cast_kernel[(rows,)](
        x, weight, y_arg, q_bytes, q_bytes if q_t is None else q_t.view(torch.uint8), rstd,
        scale.reshape(1), amax_out.view(torch.int32), scale_inv, rows, n, float(eps),
        -(-n // (THREADS * VEC)), MAX_BITS=spec.max_bits, MANT_BITS=spec.mant_bits,
        MIN_EXP=spec.min_exp, WRITE_Y=write_y, TRANSPOSE=transpose, HW_ROUND=hw_rounding(x),
        BITS=bits, num_warps=4,
    )  # fmt: skip
    return y, q, q_t, scale_inv, rstd
