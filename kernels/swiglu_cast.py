"""SwiGLU fused with fc2's per-tensor FP8 input cast: ``delayed_swiglu_cast`` and
``current_swiglu_cast``, whose bytes, transpose, scale inverse and amax are those of casting
``swiglu(h)`` (``kernels/swiglu.py``, torch's bits) with ``delayed_cast`` / ``current_scaling_cast``.

Unfused, ``LayerNormMLP(activation="swiglu")`` reads fc1's output ``h`` (2 * ffn columns) and
writes the activation ``a`` (ffn columns) in high precision, and fc2's input cast reads ``a`` again
(twice under current scaling: the amax pass and the cast pass). The backward needs only ``h`` (the
SwiGLU gradient recomputes silu from it) and the FP8 copies of ``a``, so ``a`` need not exist:

- delayed scaling (the scale is known before the kernel): one launch reads ``h`` by ``[BM, BN]``
  tiles of the ``(rows, ffn)`` grid (the gate and up tiles along ffn), computes each element of
  ``a`` exactly as ``swiglu_value`` (rounded to ``h``'s dtype where torch rounds), writes the FP8
  tile row-major and its transpose along rows (``GPU_SWIGLU_TILE``), folds ``max|a|`` into ``amax_out`` by the same
  integer atomic max as ``cast.py`` and writes ``1 / scale``. No high-precision ``a`` is written.
- current scaling (the scale needs ``max|a|`` first): the SwiGLU pass writes ``a`` and its per-
  program amax partials in one launch (what ``current.py``'s amax pass would read ``a`` again
  for), then ``cast.py``'s cast kernel reduces the partials, computes the scale and casts ``a``
  (+ transpose): two launches instead of three, ``a`` read once instead of twice. Recomputing
  ``a`` from ``h`` in the cast pass instead would read twice the bytes it saves writing.

The encode is ``_fp8_round.fp8_encode`` of ``a * scale`` (fp32), so the codes equal the unfused
cast's bit for bit; the GPU test compares with the unfused ops on the GPU.
"""

from __future__ import annotations

import functools

import torch
from dist_quant.kernels import reference
from dist_quant.kernels._fp8_round import (
    abs_bits,
    cdiv,
    fp8_encode,
    fp8_spec,
    hw_rounding,
    is_gpu,
    next_pow2,
    reciprocal,
)
from dist_quant.kernels._op import register_op
from dist_quant.kernels._triton import tl, triton
from dist_quant.kernels.cast import AmaxPartials, launch_cast
from dist_quant.kernels.current import CurrentScalingCast, current_scaling_cast_triton
from dist_quant.kernels.delayed import DelayedCast
from dist_quant.kernels.swiglu import (
    GPU_BLOCK,
    bits_mode,
    stacked_rows,
    store_rounded,
    swiglu_reference,
    swiglu_value,
)
from torch import Tensor

# Current scaling's SwiGLU (or SwiGLU backward) + amax pass: persistent programs per SM, as
# current.py's amax pass. `bench/bench_swiglu_cast.py --sweep` on the H200 (2026-12-04, h (8192,
# 2 x 14336)): 4 per SM 393.8 us forward / 641.0 backward, 8 per SM 331.6 / 581.1, 16 340.8 / 581.9.
GPU_SWIGLU_AMAX = {"PROGRAMS_PER_SM": 8}
# The delayed kernel's (rows, ffn) tiles, the fastest of the same sweep: 32 x 128 / 8 warps 247.8
# us (SwiGLU then the cast, unfused: 310.2; 64 x 64 / 16 warps 294.5; cast.py's 128 x 128 / 8
# warps 358.9, whose 64 elements per thread compile to 255 registers and a stack spill).
GPU_SWIGLU_TILE = {"BM": 32, "BN": 128, "num_warps": 8}


@triton.jit
def tile_of(pid, rows, ffn, BM: tl.constexpr, BN: tl.constexpr):
    """Program ``pid``'s ``[BM, BN]`` tile of the ``(rows, ffn)`` grid, tiles row-major: its row
    and column indices (int64) and the in-bounds mask."""
    n_col_tiles = tl.cdiv(ffn, BN)
    r = ((pid // n_col_tiles) * BM + tl.arange(0, BM)).to(tl.int64)
    c = ((pid % n_col_tiles) * BN + tl.arange(0, BN)).to(tl.int64)
    return r, c, (r < rows)[:, None] & (c < ffn)[None, :]


@triton.jit
def _swiglu_cast_kernel(
    h_ptr,
    q_ptr,  # uint8 view of the FP8 (rows, ffn) output
    qt_ptr,  # uint8 (ffn, rows) when TRANSPOSE
    scale_ptr,
    amax_acc_ptr,  # int32 view of amax_out
    scale_inv_ptr,
    rows,
    ffn,
    BM: tl.constexpr,
    BN: tl.constexpr,
    MAX_BITS: tl.constexpr,
    MANT_BITS: tl.constexpr,
    MIN_EXP: tl.constexpr,
    TRANSPOSE: tl.constexpr,
    HW_ROUND: tl.constexpr,
    BITS: tl.constexpr,
):
    pid = tl.program_id(0)
    scale = tl.load(scale_ptr)
    tl.store(scale_inv_ptr, reciprocal(scale), mask=pid == 0)
    r, c, mask = tile_of(pid, rows, ffn, BM, BN)
    # gate and up tiles: each row's BN columns contiguous (coalesced along ffn)
    gate_ptr = h_ptr + r[:, None] * 2 * ffn + c[None, :]
    g = tl.load(gate_ptr, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(gate_ptr + ffn, mask=mask, other=0.0).to(tl.float32)
    a = swiglu_value(g, u, h_ptr.dtype.element_ty, BITS)  # masked lanes: 0, no effect on amax
    code = fp8_encode(a * scale, MAX_BITS, MANT_BITS, MIN_EXP, HW_ROUND).to(tl.uint8)
    tl.store(q_ptr + r[:, None] * ffn + c[None, :], code, mask=mask)
    if TRANSPOSE:
        # the compiler turns the tile through shared memory: each q_t row's BM bytes contiguous
        tl.store(qt_ptr + c[None, :] * rows + r[:, None], code, mask=mask)
    tl.atomic_max(amax_acc_ptr, tl.max(tl.max(abs_bits(a), axis=1), axis=0), sem="relaxed")


@triton.jit
def _swiglu_amax_kernel(
    h_ptr, a_ptr, partials_ptr, rows, ffn, iters, BLOCK: tl.constexpr, BITS: tl.constexpr
):
    """Rows ``pid, pid + P, ...``: writes ``a`` and the int32 bits of this program's ``max|a|``
    to ``partials[pid]``, the layout ``cast.py`` reduces (``current.py``'s amax partials)."""
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    out_ty = a_ptr.dtype.element_ty
    acc = tl.zeros([BLOCK], dtype=tl.int32)
    for i in range(0, iters):
        row = (pid + i * nprog).to(tl.int64)
        row_cols = tl.where(row < rows, ffn, 0)  # a row past the end: all lanes masked
        for c0 in range(0, ffn, BLOCK):
            cols = c0 + tl.arange(0, BLOCK)
            ok = cols < row_cols
            gate_ptr = h_ptr + row * 2 * ffn + cols
            g = tl.load(gate_ptr, mask=ok, other=0.0).to(tl.float32)
            u = tl.load(gate_ptr + ffn, mask=ok, other=0.0).to(tl.float32)
            a = swiglu_value(g, u, out_ty, BITS)
            store_rounded(a_ptr + row * ffn + cols, a, ok, BITS)
            acc = tl.maximum(acc, abs_bits(a))
    tl.store(partials_ptr + pid, tl.max(acc, axis=0))


def check_fp32_scalar(t: Tensor, name: str, device: torch.device, what: str) -> None:
    """``t`` is a 1-element fp32 tensor on ``device``; ``ValueError`` naming the op otherwise."""
    if not isinstance(t, Tensor) or t.dtype != torch.float32 or t.numel() != 1:
        got = f"{t.dtype} {tuple(t.shape)}" if isinstance(t, Tensor) else repr(t)
        raise ValueError(f"kernels.swiglu_cast.{what}: {name} must be a 1-element fp32 tensor, "
                         f"got {got}")  # fmt: skip
    if t.device != device:
        raise ValueError(
            f"kernels.swiglu_cast.{what}: {name} is on {t.device}, h on {device}: they must share "
            "a device"
        )


@functools.cache
def sm_count(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


def tile_config(h: Tensor, rows: int, gpu_tile: dict[str, int]) -> tuple[int, int, int]:
    """``(BM, BN, num_warps)`` of a tiled SwiGLU cast for ``h``'s device (``gpu_tile`` on a GPU)."""
    if is_gpu(h):
        return gpu_tile["BM"], gpu_tile["BN"], gpu_tile["num_warps"]
    return min(32, next_pow2(rows)), 64, 1  # the interpreter: masked tails in every test


def delayed_swiglu_cast_triton(
    h: Tensor, scale: Tensor, fp8_dtype: torch.dtype, amax_out: Tensor, transpose: bool
) -> DelayedCast:
    """``delayed_cast(swiglu(h), scale, fp8_dtype, amax_out, transpose=transpose)`` in one launch
    that never writes ``swiglu(h)``: the bytes ``(..., ffn)``, the ``(ffn, rows)`` transpose when
    ``transpose``, ``1 / scale`` as of this launch; ``max|swiglu(h)|`` folded into ``amax_out``."""
    what = "delayed_swiglu_cast"
    spec = fp8_spec(fp8_dtype, f"kernels.swiglu_cast.{what}")
    h2, ffn = stacked_rows(h.detach(), what)  # (rows, 2 * ffn)
    rows, dev = h2.shape[0], h.device
    check_fp32_scalar(scale, "scale", dev, what)
    check_fp32_scalar(amax_out, "amax_out", dev, what)
    q = torch.empty(*h.shape[:-1], ffn, dtype=fp8_dtype, device=dev)
    q_t = torch.empty((ffn, rows), dtype=fp8_dtype, device=dev) if transpose else None
    scale_inv = torch.empty(1, dtype=torch.float32, device=dev)
    if rows * ffn == 0:  # no program runs to write it
        scale_inv.copy_(torch.reciprocal(scale.reshape(1)))
        return DelayedCast(q, q_t, scale_inv)
    bm, bn, warps = tile_config(h, rows, GPU_SWIGLU_TILE)
    q_bytes = q.view(torch.uint8)
    _swiglu_cast_kernel[(cdiv(rows, bm) * cdiv(ffn, bn),)](
        h2, q_bytes, q_bytes if q_t is None else q_t.view(torch.uint8), scale.reshape(1),
        amax_out.view(torch.int32), scale_inv, rows, ffn, BM=bm, BN=bn,
        MAX_BITS=spec.max_bits, MANT_BITS=spec.mant_bits, MIN_EXP=spec.min_exp,
        TRANSPOSE=transpose, HW_ROUND=hw_rounding(h), BITS=bits_mode(h), num_warps=warps,
    )  # fmt: skip
    return DelayedCast(q, q_t, scale_inv)


def amax_programs(dev: torch.device, rows: int) -> int:
    """Programs of a persistent SwiGLU + amax pass on a GPU: a few per SM, at most one per row."""
    return min(rows, sm_count(dev) * GPU_SWIGLU_AMAX["PROGRAMS_PER_SM"])


def current_swiglu_cast_triton(
    h: Tensor,
    fp8_dtype: torch.dtype,
    amax_epsilon: float = 0.0,
    use_power_2_scales: bool = False,
    transpose: bool = False,
) -> CurrentScalingCast:
    """``current_scaling_cast(swiglu(h), ...)`` in two launches: SwiGLU with the amax partials,
    then the cast of ``swiglu(h)`` reducing them (``cast.launch_cast``)."""
    what = "current_swiglu_cast"
    fp8_spec(fp8_dtype, f"kernels.swiglu_cast.{what}")
    if not amax_epsilon >= 0.0:
        raise ValueError(
            f"kernels.swiglu_cast.{what}: amax_epsilon must be >= 0, got {amax_epsilon!r}"
        )
    h2, ffn = stacked_rows(h.detach(), what)
    rows, dev = h2.shape[0], h.device
    a = torch.empty(*h.shape[:-1], ffn, dtype=h.dtype, device=dev)
    if rows * ffn == 0:  # amax 0: scale 1, as current.py's empty cast
        return current_scaling_cast_triton(a, fp8_dtype, amax_epsilon, use_power_2_scales,
                                           transpose)  # fmt: skip
    if is_gpu(h):
        block, warps = GPU_BLOCK["BLOCK"], GPU_BLOCK["num_warps"]
        programs = amax_programs(dev, rows)
    else:  # the interpreter: a few programs, several rows each, masked tails
        block, warps, programs = 64, 1, min(rows, 4)
    partials = torch.empty(programs, dtype=torch.int32, device=dev)
    bits = bits_mode(h)
    _swiglu_amax_kernel[(programs,)](
        h2, a.view(torch.int16) if bits else a, partials, rows, ffn, cdiv(rows, programs),
        BLOCK=block, BITS=bits, num_warps=warps,
    )  # fmt: skip
    amax = torch.empty((), dtype=torch.float32, device=dev)  # program 0 of the cast writes it
    scale = torch.empty(1, dtype=torch.float32, device=dev)
    scale_inv = torch.empty(1, dtype=torch.float32, device=dev)
    source = AmaxPartials(
        partials=partials,
        amax_epsilon=amax_epsilon,
        use_power_2_scales=use_power_2_scales,
        amax_out=amax.reshape(1),
        scale_out=scale,
        scale_inv_out=scale_inv,
    )
    q, q_t = launch_cast(a, fp8_dtype, transpose=transpose, partials=source)
    return CurrentScalingCast(q, q_t, scale, scale_inv, amax)


# ---- the ops: reference calls, fakes, registration -----------------------------------------------
def cast_ref(a: Tensor, scale: Tensor, fp8_dtype: torch.dtype, transpose: bool) -> tuple:
    """``(q, q_t)``: q_t an empty (0, 0) placeholder without ``transpose`` (an op's outputs are
    tensors); the public functions turn it into None."""
    if not transpose:
        return reference.cast_to_fp8(a, scale, fp8_dtype), a.new_empty((0, 0), dtype=fp8_dtype)
    q, q_t = reference.cast_transpose(a, scale, fp8_dtype)
    if q_t.untyped_storage().data_ptr() == q.untyped_storage().data_ptr():
        q_t = q_t.clone()  # an op's outputs are distinct tensors
    return q, q_t


def _q_t_fake(h: Tensor, fp8_dtype: torch.dtype, transpose: bool) -> Tensor:
    rows = h.numel() // h.shape[-1] if h.shape[-1] else 0
    return h.new_empty((h.shape[-1] // 2, rows) if transpose else (0, 0), dtype=fp8_dtype)


def _q_fake(h: Tensor, fp8_dtype: torch.dtype) -> Tensor:
    return h.new_empty((*h.shape[:-1], h.shape[-1] // 2), dtype=fp8_dtype)


def or_empty(q_t: Tensor | None, q: Tensor) -> Tensor:
    return q.new_empty((0, 0)) if q_t is None else q_t


def _delayed_ref(
    h: Tensor, scale: Tensor, fp8_dtype: torch.dtype, amax_out: Tensor, transpose: bool
) -> tuple[Tensor, Tensor, Tensor]:
    a = swiglu_reference(h)
    q, q_t = cast_ref(a, scale, fp8_dtype, transpose)
    amax_out.copy_(torch.maximum(amax_out, reference.amax(a)))
    return q, q_t, torch.reciprocal(scale.reshape(1))


def _delayed_cuda(
    h: Tensor, scale: Tensor, fp8_dtype: torch.dtype, amax_out: Tensor, transpose: bool
) -> tuple[Tensor, Tensor, Tensor]:
    q, q_t, scale_inv = delayed_swiglu_cast_triton(h, scale, fp8_dtype, amax_out, transpose)
    return q, or_empty(q_t, q), scale_inv


def _delayed_fake(
    h: Tensor, scale: Tensor, fp8_dtype: torch.dtype, amax_out: Tensor, transpose: bool
) -> tuple[Tensor, Tensor, Tensor]:
    scale_inv = h.new_empty((1,), dtype=torch.float32)
    return _q_fake(h, fp8_dtype), _q_t_fake(h, fp8_dtype, transpose), scale_inv


def _current_ref(
    h: Tensor, fp8_dtype: torch.dtype, amax_epsilon: float, use_power_2_scales: bool,
    transpose: bool,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:  # fmt: skip
    a = swiglu_reference(h)
    amax = reference.amax(a)
    scale, scale_inv = reference.current_scale(
        amax, fp8_dtype, amax_epsilon=amax_epsilon, use_power_2_scales=use_power_2_scales
    )
    q, q_t = cast_ref(a, scale, fp8_dtype, transpose)
    return q, q_t, scale.reshape(1), scale_inv.reshape(1), amax


def _current_cuda(
    h: Tensor, fp8_dtype: torch.dtype, amax_epsilon: float, use_power_2_scales: bool,
    transpose: bool,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:  # fmt: skip
    out = current_swiglu_cast_triton(h, fp8_dtype, amax_epsilon, use_power_2_scales, transpose)
    return out.data, or_empty(out.data_t, out.data), out.scale, out.scale_inv, out.amax


def _current_fake(
    h: Tensor, fp8_dtype: torch.dtype, amax_epsilon: float, use_power_2_scales: bool,
    transpose: bool,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:  # fmt: skip
    f32 = torch.float32
    return (
        _q_fake(h, fp8_dtype),
        _q_t_fake(h, fp8_dtype, transpose),
        h.new_empty((1,), dtype=f32),
        h.new_empty((1,), dtype=f32),
        h.new_empty((), dtype=f32),
    )


# opaque under compile: the launchers launch through Triton's JIT, as kernels/swiglu.py's
_delayed_swiglu_cast = register_op(
    "delayed_swiglu_cast", ("amax_out",), _delayed_ref, _delayed_cuda, _delayed_fake,
    traceable=False, eager_cuda=delayed_swiglu_cast_triton, pack=lambda out: DelayedCast(*out),
)  # fmt: skip
_current_swiglu_cast = register_op(
    "current_swiglu_cast", (), _current_ref, _current_cuda, _current_fake, traceable=False,
    eager_cuda=current_swiglu_cast_triton, pack=lambda out: CurrentScalingCast(*out),
)  # fmt: skip


# ---- public functions ----------------------------------------------------------------------------
def delayed_swiglu_cast(
    h: Tensor, scale: Tensor, fp8_dtype: torch.dtype, amax_out: Tensor, *, transpose: bool
) -> DelayedCast:
    """``delayed_cast(swiglu(h), scale, fp8_dtype, amax_out, transpose=transpose)``: the same
    bytes, transpose, scale inverse and amax fold, without writing ``swiglu(h)``."""
    out = _delayed_swiglu_cast(h, scale, fp8_dtype, amax_out, bool(transpose))
    return out if transpose else out._replace(data_t=None)  # the op's placeholder, off CUDA


def current_swiglu_cast(
    h: Tensor,
    fp8_dtype: torch.dtype,
    *,
    amax_epsilon: float = 0.0,
    use_power_2_scales: bool = False,
    transpose: bool = False,
) -> CurrentScalingCast:
    """``current_scaling_cast(swiglu(h), ...)``: the same outputs, ``swiglu(h)`` read once."""
    out = _current_swiglu_cast(
        h, fp8_dtype, float(amax_epsilon), bool(use_power_2_scales), bool(transpose)
    )
    return out if transpose else out._replace(data_t=None)  # the op's placeholder, off CUDA
