"""FP8 flash attention in Triton: forward, and a backward in three launches (dV, dK, dQ); the launchers
here, the kernels in ``attention_fwd.py`` and ``attention_bwd.py``.

The math is ``reference_attention.py``'s, tile by tile: QK^T, P V, dO V^T, P^T dO, dS K and dS^T Q
are ``tl.dot`` of FP8 operands with fp32 accumulation (FP8 tensor cores on sm89+), the softmax is
online in fp32 and base 2, P and dS are rounded to FP8 in registers with the `s` / `dp` scales.
Nothing of size seq x seq is stored: the forward keeps the per-row log-sum-exp, the backward
recomputes P from it.

Layouts. Hopper's FP8 MMA reads both operands K-major, so an operand contracted along its sequence
dim is read from a transposed copy (``(b, heads, d, s)``, made by the launcher): V for P V, Q and dO
for dK and dV, K for dQ. Every other operand is read as the caller's ``(b, heads, s, d)`` view in
its own strides (head dim contiguous): a view of ``(s, b, heads, d)`` storage, as `sbhd` activations
and a fused QKV projection's heads are, needs no copy, and the output and the gradients are written
in their operand's storage order (the out and dQ in q's, dK and dV in k's). The kernels read FP8
tiles through tensor descriptors (the TMA unit on Hopper): no per-element address registers, and
rows or columns past the end of a sequence arrive as zeros, so only the softmax's masks remain in
the kernels. A descriptor's strides are 16-byte multiples: the transposed copies pad their rows (a
sequence of FP8 bytes) to 16, and an operand whose strides are not is copied contiguous first.

Grouped-query attention: K and V stay at KV-head shape; a forward or dQ program reads the KV head
of its query head, and a dV or dK program loops over the query heads of its group, so the group's sum
needs no atomics.

Every FP8 rounding is the contract's saturating round-to-nearest-even (the hardware conversion on
sm89+, ``fp8_encode``'s explicit rounding under the interpreter), so the codes are the reference's
casts of the same fp32 values.

The ops ``dist_quant::fp8_attention_fwd`` / ``_bwd`` (``fp8_attention_fwd``, ``fp8_attention_bwd``)
run the kernels for CUDA tensors of head dim 64 or 128 on sm89+, and the float64 definition
everywhere else: the CPU, other head dims, GPUs without FP8 tensor cores. The amax buffers a
delayed-scaling `s` / `dp` slot records into are declared as written in place. The launchers call
Triton's JIT (not ``_launch``), so the ops stay opaque under compile. The forward also returns a
copy of the scale it rounded P with, for the backward: a delayed scale changes in place before the
backward runs, and a copy made outside the op could be recomputed from the changed buffer by a
compiled backward.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
from dist_quant.kernels import reference_attention as ref
from dist_quant.kernels._fp8_round import cdiv, fp8_spec, hw_rounding, is_gpu
from dist_quant.kernels._op import register_op
from dist_quant.kernels._triton import TensorDescriptor
from dist_quant.kernels.attention_bwd import _bwd_delta_kernel, _bwd_dkdv_kernel, _bwd_dq_kernel
from dist_quant.kernels.attention_fwd import _fwd_kernel, _transpose_kernel
from dist_quant.kernels.reference import FP8_DTYPES
from dist_quant.kernels.reference_attention import LOG2E
from torch import Tensor

# GPU tiles (BM query rows x BN keys), warps and pipeline stages; the interpreter runs 16 x 16
# tiles. d128: the fastest of sweeps on the H200 (seq 8192, 32/8 heads, causal; BENCHMARKS.md),
# with the operands read through descriptors: forward 0.78 ms (128 x 128 x 8 warps: 0.93); dV and
# dK each 64 x 64 x 4 warps, 3 stages (~0.25 ms less each than 64 x 128 x 8, the pointer kernels'
# best), dQ 64 x 64 x 4 warps. d64: picked without a GPU, no register spills (`ptxas -v`, sm_90a).
GPU_FWD = {64: (128, 128, 8, 3), 128: (64, 128, 4, 3)}  # d -> (BM, BN, warps, stages)
GPU_BWD_DV = {64: (32, 128, 8, 2), 128: (64, 64, 4, 3)}
GPU_BWD_DK = {64: (32, 128, 8, 2), 128: (64, 64, 4, 3)}
GPU_BWD_DQ = {64: (128, 64, 8, 3), 128: (64, 64, 4, 3)}
HEAD_DIMS = (16, 32, 64, 128)  # the interpreter's; the GPU runs GPU_HEAD_DIMS
GPU_HEAD_DIMS = tuple(GPU_FWD)


# ---- launchers ---------------------------------------------------------------------------------


class _Common(NamedTuple):
    b: int
    h: int
    hkv: int
    sq: int
    sk: int
    d: int
    mask: torch.Tensor
    mask_strides: tuple[int, int, int]
    has_mask: bool


def _common(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pad_mask: torch.Tensor | None
) -> _Common:
    """Sizes and the mask's view, after checking what the kernels assume of their operands."""
    b, h, sq, d = q.shape
    hkv, sk = k.shape[1], k.shape[2]
    if d not in HEAD_DIMS:
        raise ValueError(f"FP8 attention kernel: head dim {d} is not one of {HEAD_DIMS}")
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.dtype not in FP8_DTYPES:
            raise ValueError(f"FP8 attention kernel: {name} must be a float8 tensor, got {t.dtype}")
    if k.shape != v.shape or k.shape[0] != b or k.shape[3] != d or h % hkv:
        raise ValueError(
            f"FP8 attention kernel: q {tuple(q.shape)} and k, v {tuple(k.shape)}, "
            f"{tuple(v.shape)} must be (b, h, sq, d) and (b, hkv, sk, d) with hkv dividing h"
        )
    if pad_mask is None:
        return _Common(b, h, hkv, sq, sk, d, q, (0, 0, 0), False)
    # (b, 1, sq, sk) view with stride 0 where the mask broadcasts: each tile reads what it needs
    m = pad_mask.expand(b, 1, sq, sk).view(torch.uint8)
    return _Common(b, h, hkv, sq, sk, d, m, (m.stride(0), m.stride(2), m.stride(3)), True)


def _fmt(fp8_dtype: torch.dtype, what: str) -> dict[str, int]:
    spec = fp8_spec(fp8_dtype, f"FP8 attention kernel ({what})")
    return {"MAX_BITS": spec.max_bits, "MANT": spec.mant_bits, "MIN_EXP": spec.min_exp}


def _readable(x: torch.Tensor) -> torch.Tensor:
    """``x`` itself where a tensor descriptor can read it in place (head dim contiguous, every
    other stride and the base 16-byte aligned: any layout the casts write, e.g. (s, b, h, d)
    storage seen as (b, h, s, d)), else a contiguous copy."""
    aligned = all(st * x.element_size() % 16 == 0 for st in x.stride()[:-1])
    if x.stride(-1) == 1 and aligned and x.data_ptr() % 16 == 0:
        return x
    return x.contiguous()


def _rows(x: torch.Tensor, rows: int) -> TensorDescriptor:
    """Descriptor of (b, heads, s, d) ``x`` in its own strides, tiles of ``rows`` x d."""
    return TensorDescriptor(x, list(x.shape), list(x.stride()), [1, 1, rows, x.shape[-1]])


def _k_major(x: torch.Tensor) -> torch.Tensor:
    """The K-major copy of (b, heads, s, d) ``x`` (any strides, head dim contiguous): a
    (b * heads, d, s) view whose rows are padded to 16 bytes (a descriptor's strides are 16-byte
    multiples)."""
    b, h, s, d = x.shape
    padded = x.new_empty(b * h, d, s + (-s % 16))
    br = 64 if is_gpu(x) else 16
    _transpose_kernel[(b * h, cdiv(s, br))](
        x, padded, h, s, padded.shape[-1], *x.stride()[:3], D=d, BR=br
    )
    return padded[..., :s]


def _columns(t: torch.Tensor, cols: int) -> TensorDescriptor:
    """Descriptor of a `_k_major` copy, tiles of d x ``cols``."""
    return TensorDescriptor.from_tensor(t, [1, t.shape[1], cols])


def _tiles(table: dict, d: int, gpu: bool) -> tuple[int, int, int, int]:
    if not gpu:
        return 16, 16, 1, 1
    if d not in table:
        raise ValueError(
            f"FP8 attention kernel: head dim {d} on the GPU; the tiles are sized for "
            f"{GPU_HEAD_DIMS} (FP8 tensor cores contract at least 32 elements)"
        )
    return table[d]


def attention_fwd_triton(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_scale_inv: torch.Tensor,
    k_scale_inv: torch.Tensor,
    v_scale_inv: torch.Tensor,
    s_scale: torch.Tensor,
    s_amax: torch.Tensor,
    s_dtype: torch.dtype,
    pad_mask: torch.Tensor | None,
    causal: bool,
    out_dtype: torch.dtype,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(out (b, h, sq, d) in ``out_dtype`` and q's layout, lse (b, h, sq) fp32, base 2);
    ``s_amax`` (1-element fp32, >= 0) becomes ``max(s_amax, max p)`` in place. Inputs FP8 in any
    strides with the head dim contiguous (read in place where a descriptor can)."""
    c = _common(q, k, v, pad_mask)
    out = torch.empty_like(q, dtype=out_dtype)  # q's layout: a (s, b, h, d) storage stays so
    q, k, v = _readable(q), _readable(k), _readable(v)
    lse = torch.empty(c.b, c.h, c.sq, dtype=torch.float32, device=q.device)
    bm, bn, warps, stages = _tiles(GPU_FWD, c.d, is_gpu(q))
    s = _fmt(s_dtype, "s")
    _fwd_kernel[(c.b * c.h, cdiv(c.sq, bm))](
        _rows(q, bm), _rows(k, bn), _columns(_k_major(v), bn), out, *out.stride()[:3], lse,
        q_scale_inv, k_scale_inv, v_scale_inv, s_scale, s_amax.view(torch.int32),
        c.mask, *c.mask_strides,
        c.h, c.sq, c.sk, LOG2E / math.sqrt(c.d),
        GROUP=c.h // c.hkv, D=c.d, BM=bm, BN=bn, CAUSAL=causal, HAS_MASK=c.has_mask,
        S_MAX_BITS=s["MAX_BITS"], S_MANT=s["MANT"], S_MIN_EXP=s["MIN_EXP"], HW=hw_rounding(q),
        num_warps=warps, num_stages=stages,
    )  # fmt: skip
    return out, lse


def attention_bwd_triton(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    do: torch.Tensor,
    q_scale_inv: torch.Tensor,
    k_scale_inv: torch.Tensor,
    v_scale_inv: torch.Tensor,
    do_scale_inv: torch.Tensor,
    lse: torch.Tensor,
    s_scale: torch.Tensor,
    s_dtype: torch.dtype,
    dp_scale: torch.Tensor,
    dp_amax: torch.Tensor,
    dp_dtype: torch.dtype,
    pad_mask: torch.Tensor | None,
    causal: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq, dk, dv) fp32 in the shapes of q, k, v (dq in q's layout, dk and dv in k's);
    ``dp_amax`` becomes ``max(dp_amax, max|dS|)`` in place."""
    c = _common(q, k, v, pad_mask)
    # each gradient in its operand's layout (dk and dv both in k's), so no copy follows
    dq = torch.empty_like(q, dtype=torch.float32)
    dk = torch.empty_like(k, dtype=torch.float32)
    dv = torch.empty_like(k, dtype=torch.float32)
    q, k, v, do = _readable(q), _readable(k), _readable(v), _readable(do)
    gpu, hw = is_gpu(q), hw_rounding(q)
    delta = torch.empty(c.b, c.h, c.sq, dtype=torch.float32, device=q.device)
    br = 64 if gpu else 16
    _bwd_delta_kernel[(c.b * c.h, cdiv(c.sq, br))](
        do, out, delta, do_scale_inv, c.h, c.sq, *do.stride()[:3], *out.stride()[:3], D=c.d, BR=br
    )
    s, dp = _fmt(s_dtype, "s"), _fmt(dp_dtype, "dp")
    mask_args = (c.mask, *c.mask_strides)
    sizes = (c.h, c.sq, c.sk, LOG2E / math.sqrt(c.d), 1.0 / math.sqrt(c.d))
    qt, dot = _k_major(q), _k_major(do)
    for table, is_dv in ((GPU_BWD_DV, True), (GPU_BWD_DK, False)):
        bm, bn, warps, stages = _tiles(table, c.d, gpu)
        _bwd_dkdv_kernel[(c.b * c.hkv, cdiv(c.sk, bn))](
            _rows(q, bm), _columns(qt, bm), _rows(k, bn), _rows(v, bn), _rows(do, bm),
            _columns(dot, bm), lse, delta, dk, dv, *dk.stride()[:3],
            q_scale_inv, k_scale_inv, v_scale_inv, do_scale_inv, s_scale, dp_scale,
            *mask_args, *sizes,
            GROUP=c.h // c.hkv, D=c.d, BM=bm, BN=bn, CAUSAL=causal, HAS_MASK=c.has_mask,
            S_MAX_BITS=s["MAX_BITS"], S_MANT=s["MANT"], S_MIN_EXP=s["MIN_EXP"],
            DP_MAX_BITS=dp["MAX_BITS"], DP_MANT=dp["MANT"], DP_MIN_EXP=dp["MIN_EXP"], HW=hw,
            DV=is_dv, num_warps=warps, num_stages=stages,
        )  # fmt: skip
    bm, bn, warps, stages = _tiles(GPU_BWD_DQ, c.d, gpu)
    _bwd_dq_kernel[(c.b * c.h, cdiv(c.sq, bm))](
        _rows(q, bm), _rows(k, bn), _columns(_k_major(k), bn), _rows(v, bn), _rows(do, bm), lse,
        delta, dq, *dq.stride()[:3],
        q_scale_inv, k_scale_inv, v_scale_inv, do_scale_inv, dp_scale, dp_amax.view(torch.int32),
        *mask_args, *sizes,
        GROUP=c.h // c.hkv, D=c.d, BM=bm, BN=bn, CAUSAL=causal, HAS_MASK=c.has_mask,
        DP_MAX_BITS=dp["MAX_BITS"], DP_MANT=dp["MANT"], DP_MIN_EXP=dp["MIN_EXP"], HW=hw,
        num_warps=warps, num_stages=stages,
    )  # fmt: skip
    return dq, dk, dv


# ---- the ops: the kernels or the definition, fakes, registration -------------------------------
def _kernels_run(q: Tensor) -> bool:
    """The Triton kernels take CUDA tensors of a head dim they are built for, on a GPU with FP8
    tensor cores (sm89+; older GPUs only emulate FP8, with DIST_QUANT_EMULATE_FP8=1)."""
    return q.shape[-1] in GPU_HEAD_DIMS and hw_rounding(q)


def _like(layout: Tensor, x: Tensor, dtype: torch.dtype) -> Tensor:
    """``x`` in ``dtype`` and ``layout``'s strides, as the kernels write their outputs (the fakes
    promise those strides to torch.compile)."""
    return torch.empty_like(layout, dtype=dtype).copy_(x)


def _fold_amax(amax: Tensor, value: Tensor) -> None:
    """``amax = max(amax, value)`` in place (NaN propagates, as the kernels' integer max does)."""
    amax.copy_(torch.maximum(amax, value.float().reshape(1)))


# Each op registers one implementation as both its reference and its CUDA kernel: the kernels where
# they run, the float64 definition everywhere else (the CPU, but also CUDA tensors of other head
# dims and GPUs before sm89), so a separate CUDA function would repeat it.
def _fp8_attention_fwd_impl(
    q: Tensor, k: Tensor, v: Tensor, q_scale_inv: Tensor, k_scale_inv: Tensor,
    v_scale_inv: Tensor, s_scale: Tensor, s_amax: Tensor, s_dtype: torch.dtype,
    pad_mask: Tensor | None, causal: bool, out_dtype: torch.dtype,
) -> tuple[Tensor, Tensor, Tensor]:  # fmt: skip
    operands = (q, k, v, q_scale_inv, k_scale_inv, v_scale_inv, s_scale)
    if _kernels_run(q):
        out, lse = attention_fwd_triton(*operands, s_amax, s_dtype, pad_mask, causal, out_dtype)
        return out, lse, s_scale.clone()
    r = ref.attention_fwd(*operands, s_dtype, pad_mask, causal)
    _fold_amax(s_amax, r.s_amax)
    return _like(q, r.out, out_dtype), r.lse.float(), s_scale.clone()


def _fp8_attention_fwd_fake(
    q: Tensor, k: Tensor, v: Tensor, q_scale_inv: Tensor, k_scale_inv: Tensor,
    v_scale_inv: Tensor, s_scale: Tensor, s_amax: Tensor, s_dtype: torch.dtype,
    pad_mask: Tensor | None, causal: bool, out_dtype: torch.dtype,
) -> tuple[Tensor, Tensor, Tensor]:  # fmt: skip
    lse = q.new_empty(q.shape[:-1], dtype=torch.float32)
    return torch.empty_like(q, dtype=out_dtype), lse, s_scale.new_empty(s_scale.shape)


def _fp8_attention_bwd_impl(
    q: Tensor, k: Tensor, v: Tensor, out: Tensor, do: Tensor, q_scale_inv: Tensor,
    k_scale_inv: Tensor, v_scale_inv: Tensor, do_scale_inv: Tensor, lse: Tensor, s_scale: Tensor,
    s_dtype: torch.dtype, dp_scale: Tensor, dp_amax: Tensor, dp_dtype: torch.dtype,
    pad_mask: Tensor | None, causal: bool,
) -> tuple[Tensor, Tensor, Tensor]:  # fmt: skip
    operands = (q, k, v, out, do, q_scale_inv, k_scale_inv, v_scale_inv, do_scale_inv, lse)
    if _kernels_run(q):
        return attention_bwd_triton(
            *operands, s_scale, s_dtype, dp_scale, dp_amax, dp_dtype, pad_mask, causal
        )
    r = ref.attention_bwd(*operands, s_scale, s_dtype, dp_scale, dp_dtype, pad_mask, causal)
    _fold_amax(dp_amax, r.dp_amax)
    return (
        _like(q, r.dq, torch.float32),
        _like(k, r.dk, torch.float32),
        _like(k, r.dv, torch.float32),
    )


def _fp8_attention_bwd_fake(q: Tensor, k: Tensor, v: Tensor, *_: object) -> tuple[Tensor, ...]:
    """The gradients' shapes are the operands', dq in q's layout, dk and dv in k's (the op's
    schema comes from the implementation)."""
    return tuple(torch.empty_like(t, dtype=torch.float32) for t in (q, k, k))


# The public functions are the ops themselves (no argument needs normalising), with the launchers'
# arguments and results: the forward returns (out in `out_dtype`, lse fp32 base 2, a copy of
# `s_scale` for the backward) and folds max P into `s_amax`; the backward returns (dq, dk, dv)
# fp32 and folds max |dS| into `dp_amax`. Opaque under compile: the launchers launch through
# Triton's JIT, not `_launch`.
fp8_attention_fwd = register_op(
    "fp8_attention_fwd", ("s_amax",), _fp8_attention_fwd_impl, _fp8_attention_fwd_impl,
    _fp8_attention_fwd_fake, traceable=False,
)  # fmt: skip
fp8_attention_bwd = register_op(
    "fp8_attention_bwd", ("dp_amax",), _fp8_attention_bwd_impl, _fp8_attention_bwd_impl,
    _fp8_attention_bwd_fake, traceable=False,
)  # fmt: skip
