"""SwiGLU's backward fused with fc1's per-tensor FP8 grad-output cast:
``delayed_swiglu_backward_cast`` and ``current_swiglu_backward_cast``, whose bytes, transpose,
scale inverse and amax are those of casting ``dh = swiglu_backward(dy, h)`` (``kernels/swiglu.py``,
torch's bits) with ``delayed_cast`` / ``current_scaling_cast``.

Unfused, fc2's dgrad ``dy`` (ffn columns) and fc1's output ``h`` (2 * ffn) are read to write ``dh``
(2 * ffn) in high precision, and fc1's grad-output cast reads ``dh`` again (twice under current
scaling). fc1's GEMMs need only the FP8 ``dh`` and its transpose (the dgrad and wgrad operands):

- delayed scaling: one launch reads ``dy`` and ``h`` by ``[BM, BN]`` tiles of the ``(rows, ffn)``
  grid, computes each tile's ``d_gate`` and ``d_up`` exactly as ``swiglu_grads`` and writes their
  FP8 codes at columns ``c`` and ``ffn + c`` of ``q`` and rows ``c`` and ``ffn + c`` of the
  transpose; ``max|dh|`` is folded into ``amax_out`` and ``1 / scale`` written, as
  ``swiglu_cast.py``'s forward kernel does. No high-precision ``dh`` is written.
- current scaling: the SwiGLU backward writes ``dh`` and its per-program amax partials in one
  launch, then ``cast.py``'s cast reduces them and casts ``dh`` (+ transpose): two launches instead
  of three, ``dh`` read once instead of twice.
"""

from __future__ import annotations

import torch
from dist_quant.kernels import reference
from dist_quant.kernels._fp8_round import (
    abs_bits,
    cdiv,
    fp8_encode,
    fp8_spec,
    hw_rounding,
    is_gpu,
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
    swiglu_backward_reference,
    swiglu_grads,
)
from dist_quant.kernels.swiglu_cast import (
    amax_programs,
    cast_ref,
    check_fp32_scalar,
    or_empty,
    tile_config,
    tile_of,
)
from torch import Tensor

# The backward's tiles, apart from the forward's (`GPU_SWIGLU_TILE`): the fastest of
# `bench/bench_swiglu_cast.py --sweep` on the H200 (2026-12-04, dy (8192, 14336)): 32 x 128 / 8
# warps 480.0 us (swiglu_backward then the cast, unfused: 542.9; 64 x 64 / 16 warps 503.7; 32 x 64
# / 16 warps 542.0), although it takes 180 registers for sm_90 against 54.
GPU_SWIGLU_BWD_TILE = {"BM": 32, "BN": 128, "num_warps": 8}


@triton.jit
def _swiglu_backward_cast_kernel(
    dy_ptr,  # (rows, ffn)
    h_ptr,  # (rows, 2 * ffn)
    q_ptr,  # uint8 view of the FP8 (rows, 2 * ffn) dh
    qt_ptr,  # uint8 (2 * ffn, rows) when TRANSPOSE
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
    dy = tl.load(dy_ptr + r[:, None] * ffn + c[None, :], mask=mask, other=0.0).to(tl.float32)
    gate_off = r[:, None] * 2 * ffn + c[None, :]
    g = tl.load(h_ptr + gate_off, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(h_ptr + gate_off + ffn, mask=mask, other=0.0).to(tl.float32)
    # masked lanes: dy = 0 gives d_gate = d_up = 0, no effect on amax
    d_gate, d_up = swiglu_grads(dy, g, u, h_ptr.dtype.element_ty, BITS)
    code_g = fp8_encode(d_gate * scale, MAX_BITS, MANT_BITS, MIN_EXP, HW_ROUND).to(tl.uint8)
    code_u = fp8_encode(d_up * scale, MAX_BITS, MANT_BITS, MIN_EXP, HW_ROUND).to(tl.uint8)
    tl.store(q_ptr + gate_off, code_g, mask=mask)
    tl.store(q_ptr + gate_off + ffn, code_u, mask=mask)
    if TRANSPOSE:
        # through shared memory, as the forward: each q_t row's BM bytes contiguous
        tl.store(qt_ptr + c[None, :] * rows + r[:, None], code_g, mask=mask)
        tl.store(qt_ptr + (c[None, :] + ffn) * rows + r[:, None], code_u, mask=mask)  # int64
    tile_max = tl.maximum(abs_bits(d_gate), abs_bits(d_up))
    tl.atomic_max(amax_acc_ptr, tl.max(tl.max(tile_max, axis=1), axis=0), sem="relaxed")


@triton.jit
def _swiglu_backward_amax_kernel(
    dy_ptr, h_ptr, dh_ptr, partials_ptr, rows, ffn, iters, BLOCK: tl.constexpr,
    BITS: tl.constexpr,
):  # fmt: skip
    """Rows ``pid, pid + P, ...``: writes ``dh`` and the int32 bits of this program's ``max|dh|``
    to ``partials[pid]`` (``current.py``'s amax partials, which ``cast.py`` reduces)."""
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    out_ty = h_ptr.dtype.element_ty
    acc = tl.zeros([BLOCK], dtype=tl.int32)
    for i in range(0, iters):
        row = (pid + i * nprog).to(tl.int64)
        row_cols = tl.where(row < rows, ffn, 0)  # a row past the end: all lanes masked
        for c0 in range(0, ffn, BLOCK):
            cols = c0 + tl.arange(0, BLOCK)
            ok = cols < row_cols
            dy = tl.load(dy_ptr + row * ffn + cols, mask=ok, other=0.0).to(tl.float32)
            gate_off = row * 2 * ffn + cols
            g = tl.load(h_ptr + gate_off, mask=ok, other=0.0).to(tl.float32)
            u = tl.load(h_ptr + gate_off + ffn, mask=ok, other=0.0).to(tl.float32)
            d_gate, d_up = swiglu_grads(dy, g, u, out_ty, BITS)
            store_rounded(dh_ptr + gate_off, d_gate, ok, BITS)
            store_rounded(dh_ptr + gate_off + ffn, d_up, ok, BITS)
            acc = tl.maximum(acc, tl.maximum(abs_bits(d_gate), abs_bits(d_up)))
    tl.store(partials_ptr + pid, tl.max(acc, axis=0))


def _operands(dy: Tensor, h: Tensor, what: str) -> tuple[Tensor, Tensor, int]:
    """``(dy, h)`` as contiguous ``(rows, ffn)`` / ``(rows, 2 * ffn)``, and ffn."""
    h2, ffn = stacked_rows(h.detach(), what)
    if not isinstance(dy, Tensor) or dy.shape != (*h.shape[:-1], ffn) or dy.dtype != h.dtype:
        got = f"{dy.dtype} {tuple(dy.shape)}" if isinstance(dy, Tensor) else repr(dy)
        raise ValueError(
            f"kernels.swiglu_backward_cast.{what}: dy must be {h.dtype} of shape "
            f"{(*h.shape[:-1], ffn)} (h's rows, half its columns), got {got}"
        )
    if dy.device != h.device:
        raise ValueError(
            f"kernels.swiglu_backward_cast.{what}: dy is on {dy.device}, h on {h.device}: they "
            "must share a device"
        )
    return dy.detach().contiguous().view(-1, ffn), h2, ffn


def delayed_swiglu_backward_cast_triton(
    dy: Tensor, h: Tensor, scale: Tensor, fp8_dtype: torch.dtype, amax_out: Tensor, transpose: bool
) -> DelayedCast:
    """``delayed_cast(swiglu_backward(dy, h), scale, fp8_dtype, amax_out, transpose=transpose)``
    in one launch that never writes the high-precision gradient: the bytes ``(..., 2 * ffn)``,
    the ``(2 * ffn, rows)`` transpose when ``transpose``, ``1 / scale`` as of this launch;
    ``max|dh|`` folded into ``amax_out``."""
    what = "delayed_swiglu_backward_cast"
    spec = fp8_spec(fp8_dtype, f"kernels.swiglu_backward_cast.{what}")
    dy2, h2, ffn = _operands(dy, h, what)
    rows, dev = h2.shape[0], h.device
    check_fp32_scalar(scale, "scale", dev, what)
    check_fp32_scalar(amax_out, "amax_out", dev, what)
    q = torch.empty(h.shape, dtype=fp8_dtype, device=dev)
    q_t = torch.empty((2 * ffn, rows), dtype=fp8_dtype, device=dev) if transpose else None
    scale_inv = torch.empty(1, dtype=torch.float32, device=dev)
    if rows * ffn == 0:  # no program runs to write it
        scale_inv.copy_(torch.reciprocal(scale.reshape(1)))
        return DelayedCast(q, q_t, scale_inv)
    bm, bn, warps = tile_config(h, rows, GPU_SWIGLU_BWD_TILE)
    q_bytes = q.view(torch.uint8)
    _swiglu_backward_cast_kernel[(cdiv(rows, bm) * cdiv(ffn, bn),)](
        dy2, h2, q_bytes, q_bytes if q_t is None else q_t.view(torch.uint8), scale.reshape(1),
        amax_out.view(torch.int32), scale_inv, rows, ffn, BM=bm, BN=bn,
        MAX_BITS=spec.max_bits, MANT_BITS=spec.mant_bits, MIN_EXP=spec.min_exp,
        TRANSPOSE=transpose, HW_ROUND=hw_rounding(h), BITS=bits_mode(h), num_warps=warps,
    )  # fmt: skip
    return DelayedCast(q, q_t, scale_inv)


def current_swiglu_backward_cast_triton(
    dy: Tensor,
    h: Tensor,
    fp8_dtype: torch.dtype,
    amax_epsilon: float = 0.0,
    use_power_2_scales: bool = False,
    transpose: bool = False,
) -> CurrentScalingCast:
    """``current_scaling_cast(swiglu_backward(dy, h), ...)`` in two launches: the SwiGLU backward
    with the amax partials, then the cast of ``dh`` reducing them (``cast.launch_cast``)."""
    what = "current_swiglu_backward_cast"
    fp8_spec(fp8_dtype, f"kernels.swiglu_backward_cast.{what}")
    if not amax_epsilon >= 0.0:
        raise ValueError(
            f"kernels.swiglu_backward_cast.{what}: amax_epsilon must be >= 0, got {amax_epsilon!r}"
        )
    dy2, h2, ffn = _operands(dy, h, what)
    rows, dev = h2.shape[0], h.device
    dh = torch.empty(h.shape, dtype=h.dtype, device=dev)
    if rows * ffn == 0:  # amax 0: scale 1, as current.py's empty cast
        return current_scaling_cast_triton(dh, fp8_dtype, amax_epsilon, use_power_2_scales,
                                           transpose)  # fmt: skip
    if is_gpu(h):
        block, warps = GPU_BLOCK["BLOCK"], GPU_BLOCK["num_warps"]
        programs = amax_programs(dev, rows)
    else:  # the interpreter: a few programs, several rows each, masked tails
        block, warps, programs = 64, 1, min(rows, 4)
    partials = torch.empty(programs, dtype=torch.int32, device=dev)
    bits = bits_mode(h)
    _swiglu_backward_amax_kernel[(programs,)](
        dy2, h2, dh.view(torch.int16) if bits else dh, partials, rows, ffn, cdiv(rows, programs),
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
    q, q_t = launch_cast(dh, fp8_dtype, transpose=transpose, partials=source)
    return CurrentScalingCast(q, q_t, scale, scale_inv, amax)


# ---- the ops: reference calls, fakes, registration -----------------------------------------------
def _q_fakes(h: Tensor, fp8_dtype: torch.dtype, transpose: bool) -> tuple[Tensor, Tensor]:
    rows = h.numel() // h.shape[-1] if h.shape[-1] else 0
    q_t = h.new_empty((h.shape[-1], rows) if transpose else (0, 0), dtype=fp8_dtype)
    return torch.empty_like(h, dtype=fp8_dtype, memory_format=torch.contiguous_format), q_t


def _delayed_ref(
    dy: Tensor, h: Tensor, scale: Tensor, fp8_dtype: torch.dtype, amax_out: Tensor,
    transpose: bool,
) -> tuple[Tensor, Tensor, Tensor]:  # fmt: skip
    dh = swiglu_backward_reference(dy, h)
    q, q_t = cast_ref(dh, scale, fp8_dtype, transpose)
    amax_out.copy_(torch.maximum(amax_out, reference.amax(dh)))
    return q, q_t, torch.reciprocal(scale.reshape(1))


def _delayed_cuda(
    dy: Tensor, h: Tensor, scale: Tensor, fp8_dtype: torch.dtype, amax_out: Tensor,
    transpose: bool,
) -> tuple[Tensor, Tensor, Tensor]:  # fmt: skip
    q, q_t, scale_inv = delayed_swiglu_backward_cast_triton(
        dy, h, scale, fp8_dtype, amax_out, transpose
    )
    return q, or_empty(q_t, q), scale_inv


def _delayed_fake(
    dy: Tensor, h: Tensor, scale: Tensor, fp8_dtype: torch.dtype, amax_out: Tensor,
    transpose: bool,
) -> tuple[Tensor, Tensor, Tensor]:  # fmt: skip
    return (*_q_fakes(h, fp8_dtype, transpose), h.new_empty((1,), dtype=torch.float32))


def _current_ref(
    dy: Tensor, h: Tensor, fp8_dtype: torch.dtype, amax_epsilon: float,
    use_power_2_scales: bool, transpose: bool,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:  # fmt: skip
    dh = swiglu_backward_reference(dy, h)
    amax = reference.amax(dh)
    scale, scale_inv = reference.current_scale(
        amax, fp8_dtype, amax_epsilon=amax_epsilon, use_power_2_scales=use_power_2_scales
    )
    q, q_t = cast_ref(dh, scale, fp8_dtype, transpose)
    return q, q_t, scale.reshape(1), scale_inv.reshape(1), amax


def _current_cuda(
    dy: Tensor, h: Tensor, fp8_dtype: torch.dtype, amax_epsilon: float,
    use_power_2_scales: bool, transpose: bool,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:  # fmt: skip
    out = current_swiglu_backward_cast_triton(
        dy, h, fp8_dtype, amax_epsilon, use_power_2_scales, transpose
    )
    return out.data, or_empty(out.data_t, out.data), out.scale, out.scale_inv, out.amax


def _current_fake(
    dy: Tensor, h: Tensor, fp8_dtype: torch.dtype, amax_epsilon: float,
    use_power_2_scales: bool, transpose: bool,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:  # fmt: skip
    f32 = torch.float32
    return (
        *_q_fakes(h, fp8_dtype, transpose),
        h.new_empty((1,), dtype=f32),
        h.new_empty((1,), dtype=f32),
        h.new_empty((), dtype=f32),
    )


# opaque under compile: the launchers launch through Triton's JIT, as kernels/swiglu.py's
_delayed_swiglu_backward_cast = register_op(
    "delayed_swiglu_backward_cast", ("amax_out",), _delayed_ref, _delayed_cuda, _delayed_fake,
    traceable=False, eager_cuda=delayed_swiglu_backward_cast_triton,
    pack=lambda out: DelayedCast(*out),
)  # fmt: skip
_current_swiglu_backward_cast = register_op(
    "current_swiglu_backward_cast", (), _current_ref, _current_cuda, _current_fake,
    traceable=False, eager_cuda=current_swiglu_backward_cast_triton,
    pack=lambda out: CurrentScalingCast(*out),
)  # fmt: skip


# ---- public functions ----------------------------------------------------------------------------
def delayed_swiglu_backward_cast(
    dy: Tensor, h: Tensor, scale: Tensor, fp8_dtype: torch.dtype, amax_out: Tensor, *,
    transpose: bool,
) -> DelayedCast:  # fmt: skip
    """``delayed_cast(swiglu_backward(dy, h), scale, fp8_dtype, amax_out, transpose=transpose)``:
    the same bytes, transpose, scale inverse and amax fold, without writing the gradient."""
    out = _delayed_swiglu_backward_cast(dy, h, scale, fp8_dtype, amax_out, bool(transpose))
    return out if transpose else out._replace(data_t=None)  # the op's placeholder, off CUDA


def current_swiglu_backward_cast(
    dy: Tensor,
    h: Tensor,
    fp8_dtype: torch.dtype,
    *,
    amax_epsilon: float = 0.0,
    use_power_2_scales: bool = False,
    transpose: bool = False,
) -> CurrentScalingCast:
    """``current_scaling_cast(swiglu_backward(dy, h), ...)``: the same outputs, the gradient read
    once."""
    out = _current_swiglu_backward_cast(
        dy, h, fp8_dtype, float(amax_epsilon), bool(use_power_2_scales), bool(transpose)
    )
    return out if transpose else out._replace(data_t=None)  # the op's placeholder, off CUDA
