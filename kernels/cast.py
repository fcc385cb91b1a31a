"""Per-tensor FP8 cast: the Triton kernels, their launcher, and the ops ``cast_to_fp8`` and
``cast_transpose`` (``_op.py``); delayed scaling's cast (``delayed.py``) and current scaling's
(``current.py``) launch these kernels too.

Matches ``reference.cast_to_fp8`` / ``reference.cast_transpose`` bit for bit. One read of ``x`` and
one write per output: ``q`` (``x``'s shape and torch's elementwise layout) and, with the transpose,
``q_t`` (the contiguous ``(cols, rows)`` transpose of the 2D view, the backward GEMM's layout).

The scale comes from a 1-element tensor (delayed scaling) or, for current scaling, from per-program
amax partials that ``current.py`` wrote: each program then reduces the partials and computes the
scale itself, so current scaling needs no scale kernel and no host sync.

``amax_out`` (delayed scaling): ``amax_out = max(amax_out, amax(x))`` in place, by an integer
atomic max on the fp32 bits of ``|x|``; a non-negative fp32's bits order like its value and a
positive NaN's bits exceed every one of them, so NaN propagates. ``amax_out`` must therefore hold a
value >= +0 or a positive NaN, as an amax history row does.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

import torch
from dist_quant.kernels import reference
from dist_quant.kernels._fp8_round import (
    Fp8Spec,
    abs_bits,
    amax_from_bits,
    cdiv,
    current_scale_from_amax,
    flat_pair,
    fp8_encode,
    fp8_spec,
    hw_rounding,
    is_gpu,
    next_pow2,
    reciprocal,
    rows_cols,
    scalar_fp32,
)
from dist_quant.kernels._launch import (
    FastLaunch,
    LaunchConfig,
    PreparedLaunch,
    launch_config,
)
from dist_quant.kernels._op import as_scale, distinct, fake_rows_cols, register_op
from dist_quant.kernels._triton import tl, triton
from torch import Tensor

_INPUT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)

# GPU launch configurations (bench/bench_cast.py --sweep measures the alternatives).
# Swept on H200 with the hardware rounding (2026-12-02, 64M / 256M bf16): BLOCK 8192 / 4 warps
# 60.2 / 213.2 us for cast + amax (4096 / 4: 59.9 / 215.6; 16384 / 4: 74.1 / 260.1); 128x128
# tiles / 8 warps 77.4 / 286.9 us with the transpose, best of 10 (64x64 / 4: 91.6 / 344.4;
# 64x256 / 8: 83.8 / 310.8). Every configuration wrote the same bytes.
GPU_FLAT = {"BLOCK": 8192, "num_warps": 4}
GPU_TILE = {"BM": 128, "BN": 128, "num_warps": 8}
# Current scaling: walk the cast grid backwards, so the first tiles read are the ones the amax
# pass read last and may still find in L2. Not measured yet: `bench_cast.py --sweep` times both.
GPU_REVERSE_AFTER_AMAX = True


@dataclass(frozen=True)
class AmaxPartials:
    """Current scaling's scale source: int32 bits of per-program ``max|x|`` and where to report."""

    partials: torch.Tensor  # (P,) int32, written by current.py's amax pass
    amax_epsilon: float
    use_power_2_scales: bool
    amax_out: torch.Tensor  # (1,) fp32: the reduced amax, written by program 0
    scale_out: torch.Tensor  # (1,) fp32
    scale_inv_out: torch.Tensor  # (1,) fp32


@triton.jit
def _program_and_scale(
    scale_ptr,
    partials_ptr,
    n_partials,
    eps,
    amax_out_ptr,
    scale_out_ptr,
    scale_inv_out_ptr,
    FP8_MAX: tl.constexpr,
    POW2: tl.constexpr,
    P_BLOCK: tl.constexpr,
    REVERSE: tl.constexpr,
    WRITE_INV: tl.constexpr,
):
    """``(pid, scale)`` of this program, for both cast kernels: the program's tile index (counted
    from the end with REVERSE: the tail is what the amax pass left in L2) and the scale every
    program uses: loaded (P_BLOCK == 0; with WRITE_INV program 0 also stores its reciprocal) or
    computed from the amax partials. Inlined by the compiler: no cost over writing it out."""
    pid = tl.program_id(0)
    if REVERSE:
        pid = tl.num_programs(0) - 1 - pid
    if P_BLOCK == 0:
        scale = tl.load(scale_ptr)
        if WRITE_INV:
            tl.store(scale_inv_out_ptr, reciprocal(scale), mask=pid == 0)
    else:
        offs = tl.arange(0, P_BLOCK)
        bits = tl.load(partials_ptr + offs, mask=offs < n_partials, other=0)
        a = amax_from_bits(tl.max(bits, axis=0))
        scale = current_scale_from_amax(a, eps, FP8_MAX, POW2)
        first = pid == 0
        tl.store(amax_out_ptr, a, mask=first)
        tl.store(scale_out_ptr, scale, mask=first)
        tl.store(scale_inv_out_ptr, reciprocal(scale), mask=first)
    return pid, scale


@triton.jit
def _cast_kernel(
    x_ptr,
    q_ptr,  # uint8 view of the FP8 output
    scale_ptr,
    amax_acc_ptr,  # int32 view of amax_out (WITH_AMAX)
    partials_ptr,
    n_partials,
    eps,
    amax_out_ptr,
    scale_out_ptr,
    scale_inv_out_ptr,
    n,
    BLOCK: tl.constexpr,
    MAX_BITS: tl.constexpr,
    MANT_BITS: tl.constexpr,
    MIN_EXP: tl.constexpr,
    FP8_MAX: tl.constexpr,
    WITH_AMAX: tl.constexpr,
    POW2: tl.constexpr,
    P_BLOCK: tl.constexpr,
    REVERSE: tl.constexpr,
    WRITE_INV: tl.constexpr,
    HW_ROUND: tl.constexpr,
):
    pid, scale = _program_and_scale(
        scale_ptr, partials_ptr, n_partials, eps, amax_out_ptr, scale_out_ptr, scale_inv_out_ptr,
        FP8_MAX, POW2, P_BLOCK, REVERSE, WRITE_INV,
    )  # fmt: skip
    offs = pid.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    code = fp8_encode(x * scale, MAX_BITS, MANT_BITS, MIN_EXP, HW_ROUND)
    tl.store(q_ptr + offs, code.to(tl.uint8), mask=mask)
    if WITH_AMAX:
        tl.atomic_max(amax_acc_ptr, tl.max(abs_bits(x), axis=0), sem="relaxed")


@triton.jit
def _cast_transpose_kernel(
    x_ptr,
    q_ptr,
    qt_ptr,
    scale_ptr,
    amax_acc_ptr,
    partials_ptr,
    n_partials,
    eps,
    amax_out_ptr,
    scale_out_ptr,
    scale_inv_out_ptr,
    rows,
    cols,
    stride_xr,
    stride_xc,
    stride_qr,
    stride_qc,
    BM: tl.constexpr,
    BN: tl.constexpr,
    MAX_BITS: tl.constexpr,
    MANT_BITS: tl.constexpr,
    MIN_EXP: tl.constexpr,
    FP8_MAX: tl.constexpr,
    WITH_AMAX: tl.constexpr,
    POW2: tl.constexpr,
    P_BLOCK: tl.constexpr,
    REVERSE: tl.constexpr,
    WRITE_INV: tl.constexpr,
    HW_ROUND: tl.constexpr,
):
    pid, scale = _program_and_scale(
        scale_ptr, partials_ptr, n_partials, eps, amax_out_ptr, scale_out_ptr, scale_inv_out_ptr,
        FP8_MAX, POW2, P_BLOCK, REVERSE, WRITE_INV,
    )  # fmt: skip
    n_col_tiles = tl.cdiv(cols, BN)
    r = ((pid // n_col_tiles) * BM + tl.arange(0, BM)).to(tl.int64)
    c = ((pid % n_col_tiles) * BN + tl.arange(0, BN)).to(tl.int64)
    mask = (r < rows)[:, None] & (c < cols)[None, :]
    x = tl.load(x_ptr + r[:, None] * stride_xr + c[None, :] * stride_xc, mask=mask, other=0.0)
    x = x.to(tl.float32)
    code = fp8_encode(x * scale, MAX_BITS, MANT_BITS, MIN_EXP, HW_ROUND).to(tl.uint8)
    tl.store(q_ptr + r[:, None] * stride_qr + c[None, :] * stride_qc, code, mask=mask)
    # The compiler picks a row-contiguous layout for this store (through shared memory).
    tl.store(qt_ptr + c[None, :] * rows + r[:, None], code, mask=mask)
    if WITH_AMAX:
        tl.atomic_max(amax_acc_ptr, tl.max(tl.max(abs_bits(x), axis=1), axis=0), sem="relaxed")


def cast_to_fp8_triton(
    x: torch.Tensor,
    scale: torch.Tensor | float,
    fp8_dtype: torch.dtype,
    *,
    amax_out: torch.Tensor | None = None,
) -> torch.Tensor:
    """``reference.cast_to_fp8``; with ``amax_out``, also ``amax_out = max(amax_out, amax(x))``."""
    q, _ = launch_cast(x, fp8_dtype, transpose=False, scale=scale, amax_out=amax_out)
    return q


def cast_transpose_triton(
    x: torch.Tensor,
    scale: torch.Tensor | float,
    fp8_dtype: torch.dtype,
    *,
    amax_out: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``reference.cast_transpose`` in one pass; ``amax_out`` as in ``cast_to_fp8_triton``."""
    q, q_t = launch_cast(x, fp8_dtype, transpose=True, scale=scale, amax_out=amax_out)
    return q, q_t


@functools.cache
def _config(
    spec: Fp8Spec,
    with_amax: bool,
    pow2: bool,
    p_block: int,
    reverse: bool,
    write_inv: bool,
    hw_round: bool,
    tile: tuple[tuple[str, int], ...],
    warps: int,
) -> LaunchConfig:
    return launch_config(
        (
            *tile,
            ("MAX_BITS", spec.max_bits),
            ("MANT_BITS", spec.mant_bits),
            ("MIN_EXP", spec.min_exp),
            ("FP8_MAX", spec.max),
            ("WITH_AMAX", with_amax),
            ("POW2", pow2),
            ("P_BLOCK", p_block),
            ("REVERSE", reverse),
            ("WRITE_INV", write_inv),
            ("HW_ROUND", hw_round),
        ),
        (("num_warps", warps),),
    )


def cast_args(
    x: torch.Tensor,
    q: torch.Tensor,
    q_t: torch.Tensor | None,
    scale: torch.Tensor,
    amax_acc: torch.Tensor,
    partials: torch.Tensor,
    n_partials: int,
    eps: float,
    outs: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
) -> tuple:
    """The leading runtime arguments of the cast kernels, in their order (the flat kernel has no
    ``q_t``): the full launch path and the prepared relaunches both build them here. ``outs`` is
    ``(amax_out, scale_out, scale_inv_out)``; sizes and strides follow."""
    head = (x, q) if q_t is None else (x, q, q_t)
    return (*head, scale, amax_acc, partials, n_partials, eps, *outs)


_launch_flat = FastLaunch(_cast_kernel)
_launch_tiled = FastLaunch(_cast_transpose_kernel)


def launch_cast(
    x: torch.Tensor,
    fp8_dtype: torch.dtype,
    *,
    transpose: bool,
    scale: torch.Tensor | float | None = None,
    amax_out: torch.Tensor | None = None,
    partials: AmaxPartials | None = None,
    scale_inv_out: torch.Tensor | None = None,
    prepare: Callable[[PreparedLaunch, tuple[int, int] | None], None] | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Shared launcher: exactly one of ``scale`` (delayed) and ``partials`` (current) is given;
    with ``scale``, ``scale_inv_out`` (1-element fp32) receives ``1 / scale``. ``prepare`` (GPU):
    receives this launch prepared (its trailing sizes and strides fixed) and the shape of ``q_t``,
    when a later call may pass ``x``, the fresh outputs and the buffers themselves: no copy or
    conversion was made of any of them."""
    what = "cast_transpose" if transpose else "cast_to_fp8"
    spec = fp8_spec(fp8_dtype, f"kernels.cast.{what}")
    if x.dtype not in _INPUT_DTYPES:
        raise ValueError(f"kernels.cast.{what}: x must be fp32/bf16/fp16, got {x.dtype}")
    if (scale is None) == (partials is None):
        raise ValueError(f"kernels.cast.{what}: pass exactly one of scale and partials")
    x = x.detach()
    dev = x.device
    gpu = is_gpu(x)
    if partials is None:
        scale_t = scalar_fp32(scale, dev, f"kernels.cast.{what}: scale")
        p, n_partials, eps, pow2, p_block = scale_t, 0, 0.0, False, 0
        inv = scale_t if scale_inv_out is None else scale_inv_out
        outs = (scale_t, scale_t, inv)
    else:
        scale_t = partials.scale_out
        p, n_partials = partials.partials, partials.partials.numel()
        eps, pow2 = float(partials.amax_epsilon), bool(partials.use_power_2_scales)
        p_block = next_pow2(n_partials)
        outs = (partials.amax_out, partials.scale_out, partials.scale_inv_out)
    if amax_out is not None:
        if amax_out.dtype != torch.float32 or amax_out.numel() != 1 or amax_out.device != dev:
            raise ValueError(
                f"kernels.cast.{what}: amax_out must be a 1-element fp32 tensor on {dev}, got "
                f"{amax_out.dtype} {tuple(amax_out.shape)} on {amax_out.device}"
            )
        acc = amax_out.view(torch.int32)
    else:
        acc = scale_t  # unused: WITH_AMAX is off
    with_amax, reverse = (
        amax_out is not None,
        partials is not None and gpu and GPU_REVERSE_AFTER_AMAX,
    )
    write_inv = partials is None and scale_inv_out is not None
    hw = hw_rounding(x)
    copy_back = False
    if not transpose:
        src, q, dst = flat_pair(x, fp8_dtype)
        n, q_t = src.numel(), None
        if n == 0:  # current.py handles an empty x itself (scale 1)
            return q, None
        block, warps = (GPU_FLAT["BLOCK"], GPU_FLAT["num_warps"]) if gpu else (1 << 15, 1)
        launcher, tile, grid, sizes = _launch_flat, (("BLOCK", block),), (cdiv(n, block),), (n,)
    else:
        rows, cols = rows_cols(x, f"kernels.cast.{what}")
        q = torch.empty_like(x, dtype=fp8_dtype)
        q_t = torch.empty((cols, rows), dtype=fp8_dtype, device=dev)
        if rows * cols == 0:
            return q, q_t
        src = x if x.dim() == 2 else x.reshape(rows, cols)
        try:
            dst = q if q.dim() == 2 else q.view(rows, cols)
        except RuntimeError:  # a permuted N-D layout: write 2D, then copy into torch's layout
            dst, copy_back = torch.empty((rows, cols), dtype=fp8_dtype, device=dev), True
        if gpu:
            bm, bn, warps = GPU_TILE["BM"], GPU_TILE["BN"], GPU_TILE["num_warps"]
        else:  # interpreter: ~16K-element tiles shaped to the matrix (a (1, n) input is one row)
            bm = min(128, next_pow2(rows))
            bn = min(next_pow2(cols), max(128, (1 << 14) // bm))
            warps = 1
        launcher, tile = _launch_tiled, (("BM", bm), ("BN", bn))
        grid = (cdiv(rows, bm) * cdiv(cols, bn),)
        sizes = (rows, cols, src.stride(0), src.stride(1), dst.stride(0), dst.stride(1))
    cfg = _config(spec, with_amax, pow2, p_block, reverse, write_inv, hw, tile, warps)
    q_t_bytes = None if q_t is None else q_t.view(torch.uint8)
    head = cast_args(src, dst.view(torch.uint8), q_t_bytes, scale_t, acc, p, n_partials, eps, outs)
    args = (*head, *sizes)
    launcher(grid, args, cfg, interpreted=not gpu)
    if copy_back:
        q.copy_(dst.view(q.shape))
    elif (
        prepare is not None
        and src.data_ptr() == x.data_ptr()
        and (partials is not None or scale_t is scale)
    ):
        prepared = launcher.prepare(grid, args, cfg, len(sizes))
        if prepared is not None:
            prepare(prepared, None if q_t is None else (cols, rows))
    return q, q_t


# ---- the ops: reference calls, fakes, registration ---------------------------------------------
def _cast_to_fp8_ref(x: Tensor, scale: Tensor, fp8_dtype: torch.dtype) -> Tensor:
    return reference.cast_to_fp8(x, scale, fp8_dtype)


def _cast_to_fp8_cuda(x: Tensor, scale: Tensor, fp8_dtype: torch.dtype) -> Tensor:
    return cast_to_fp8_triton(x, scale, fp8_dtype)


def _cast_to_fp8_fake(x: Tensor, scale: Tensor, fp8_dtype: torch.dtype) -> Tensor:
    return torch.empty_like(x, dtype=fp8_dtype)


def _cast_transpose_ref(x: Tensor, scale: Tensor, fp8_dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    return distinct(*reference.cast_transpose(x, scale, fp8_dtype))


def _cast_transpose_cuda(x: Tensor, scale: Tensor, fp8_dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    return cast_transpose_triton(x, scale, fp8_dtype)


def _cast_transpose_fake(x: Tensor, scale: Tensor, fp8_dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    rows, cols = fake_rows_cols(x)
    return torch.empty_like(x, dtype=fp8_dtype), x.new_empty((cols, rows), dtype=fp8_dtype)


_cast_to_fp8 = register_op(
    "cast_to_fp8", (), _cast_to_fp8_ref, _cast_to_fp8_cuda, _cast_to_fp8_fake
)
_cast_transpose = register_op(
    "cast_transpose", (), _cast_transpose_ref, _cast_transpose_cuda, _cast_transpose_fake
)


# ---- public functions ----------------------------------------------------------------------------
def cast_to_fp8(x: Tensor, scale: Tensor | float, fp8_dtype: torch.dtype) -> Tensor:
    """``reference.cast_to_fp8``."""
    return _cast_to_fp8(x, as_scale(scale, x), fp8_dtype)


def cast_transpose(
    x: Tensor, scale: Tensor | float, fp8_dtype: torch.dtype
) -> tuple[Tensor, Tensor]:
    """``reference.cast_transpose``: ``(q, q_t)``, ``q_t`` the contiguous ``(cols, rows)``."""
    return _cast_transpose(x, as_scale(scale, x), fp8_dtype)
