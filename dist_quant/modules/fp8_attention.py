"""FP8 attention on per-tensor FP8 slots: the flash kernels on CUDA, their float64 definition on CPU.

`DotProductAttention` calls `flash_fp8_attention` when its `qkv`, `s`, `do` and `dp` slots all hold
per-tensor FP8 quantizers (delayed or current scaling); other kinds (MXFP8, or identity on one of
those four) keep the emulation in `attention.py`. The math is `kernels/reference_attention.py`'s,
run by the `dist_quant::fp8_attention_fwd/_bwd` ops (Triton on CUDA for head dims 64 and 128).

What each slot does here:
- `qkv` casts q, k and v (each its own scale under current scaling; one shared scale, and one amax
  slot for the three, under delayed scaling), at KV-head shape for k and v;
- `s` rounds P inside the kernels. P's scale: delayed scaling, the slot's scale (its amax history
  records max P, at most 1); current scaling, the scale of an amax of exactly 1, P's bound (the
  kernel's P is exp2(t - M) <= 1 with M an integer at or above the row max), so
  `fp8_max` (448 for E4M3), or 256 with `use_power_2_scales`: no pass over P is needed;
- `o` rounds the output on its way out (a forward fake quantization, as for the emulation);
- `do` casts the incoming output gradient (the backward's FP8 dO);
- `dp` rounds dS inside the kernels. Delayed scaling: the slot's scale, and max|dS| goes to its
  amax history. Current scaling: the amax is not known before dS is computed, and a second pass
  would recompute two of the five GEMMs; the scale is the current-scaling scale of an upper bound
  instead, `2 * max_i |dO_i| * max_j |v_j|` (row norms over the head dim, of the dequantized FP8
  operands; |dS_ij| = P_ij |dO_i . (v_j - out_i)| and `out_i` is a convex combination of the v_j).
  The bound is loose by the Cauchy-Schwarz factor (a few binades), which E5M2's 32 binades absorb;
  it is all-reduced over the quantizer's amax group like an amax;
- `dqkv` rounds dq, dk and dv on their way back (a fake quantization, as for the emulation).
The casts inside the kernels are not seen by cast observers (telemetry's per-role statistics).

Two GPU paths. Opted in (``DIST_QUANT_FP8_ATTENTION=cudnn``), where the `o` and `dqkv` slots are
delayed-scaling FP8 (scales known before the tensors exist), the `dp` slot holds the `do` slot's
format, and cuDNN takes the call (``kernels/attention_cudnn.py``: Hopper or newer, head dim 128,
no padding mask, the `cudnn` extra installed), cuDNN's fused FP8 SDPA runs: it writes the
output in the `o` slot's FP8 and the gradients in the `dqkv` slot's, the rounding those slots
would give, done inside the kernel, and folds their amaxes into the slots. Everywhere else the
Triton kernels (or their definition) run and the `o` and `dqkv` slots round the results after.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from dist_quant import kernels as fp8_kernels
from dist_quant.forward import enrol_backward_from
from dist_quant.kernels.attention import fp8_attention_bwd, fp8_attention_fwd
from dist_quant.kernels.attention_cudnn import (
    cudnn_runs,
    fp8_attention_bwd_cudnn,
    fp8_attention_fwd_cudnn,
)
from dist_quant.modules.functional import fake_quantize
from dist_quant.quantizers import (
    Float8CurrentScalingQuantizer,
    Float8Quantizer,
    Quantizer,
    allreduce_current_amax,
)

_PER_TENSOR = (Float8Quantizer, Float8CurrentScalingQuantizer)


@dataclass(frozen=True)
class AttentionSlots:
    """The six quantizers of one FP8 attention call (None: stays in high precision)."""

    qkv: Quantizer | None
    s: Quantizer | None
    o: Quantizer | None
    do: Quantizer | None
    dp: Quantizer | None
    dqkv: Quantizer | None
    bwd_groups: tuple
    reduction_group: Any
    """The plan's amax reduction group, which the backward's groups reduce over."""
    enrol_key: int | torch.Tensor
    """The module's enrolment key (its tag tensor in a traced plan), for the backward's groups."""
    flash: bool = field(init=False)
    """qkv, s, do and dp are all per-tensor FP8: `flash_fp8_attention` runs (decided at plan)."""
    fp8_results: bool = field(init=False)
    """o and dqkv are delayed-scaling FP8 as well, and dp in do's format: cuDNN may write the
    output and gradients in their formats (the call's shapes and device decide the rest)."""

    def __post_init__(self) -> None:
        inner = (self.qkv, self.s, self.do, self.dp)
        flash = all(type(q) in _PER_TENSOR for q in inner)
        object.__setattr__(self, "flash", flash)
        results = all(type(q) is Float8Quantizer for q in (self.o, self.dqkv))
        # cuDNN rounds dS in dO's format (H200, cuDNN 9.19: within 1-2e-2 of the definition in
        # dO's format, 7-9e-2 in the other), so the dp slot must name that format too
        same_ds = flash and self.dp.fp8_dtype == self.do.fp8_dtype
        object.__setattr__(self, "fp8_results", flash and results and same_ds)


class _FakeQuant(torch.autograd.Function):
    """Forward: round `x` through `fwd_q`; backward: round the gradient through `bwd_q`. Either may
    be None (pass through): the straight-through estimator of a quantize-dequantize pair."""

    @staticmethod
    def forward(
        ctx: Any,
        x: torch.Tensor,
        fwd_q: Quantizer | None,
        bwd_q: Quantizer | None,
        slots: AttentionSlots,
    ) -> torch.Tensor:
        ctx.bwd_q, ctx.slots = bwd_q, slots
        return fake_quantize(fwd_q, x) if fwd_q is not None else x.clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        if ctx.bwd_q is not None:
            grad = fake_quantize(ctx.bwd_q, grad.contiguous())
            slots = ctx.slots
            if slots.bwd_groups:
                enrol_backward_from(grad, slots.enrol_key, slots.bwd_groups, slots.reduction_group)
        return grad, None, None, None


def round_slots(
    x: torch.Tensor, fwd_q: Quantizer | None, bwd_q: Quantizer | None, slots: AttentionSlots
) -> torch.Tensor:
    """`x` rounded through `fwd_q` forward and its gradient through `bwd_q` backward (the
    emulation's rounding of one slot pair; None: not rounded)."""
    if fwd_q is None and bwd_q is None:
        return x
    for q in (fwd_q, bwd_q):
        # the rowwise bytes are all a fake quantization reads; set here, outside the Function,
        # where torch.compile may trace the change (inside, `fake_quantize`'s set is then a no-op)
        if q is not None:
            q.set_usage(rowwise=True, columnwise=False)
    return _FakeQuant.apply(x, fwd_q, bwd_q, slots)


def _inner_scale(
    q: Quantizer, amax_bound: torch.Tensor | None, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """(scale, amax buffer) for a tensor the kernels round themselves (P or dS). Delayed: the
    slot's own scale and amax slot. Current: the scale of `amax_bound` (None: 1, P's bound) and a
    scratch amax buffer the kernel's record goes to."""
    if isinstance(q, Float8Quantizer):
        return q.scale, q.amax
    if amax_bound is None:
        amax_bound = torch.ones(1, device=device)
    scale, _ = fp8_kernels.current_scale(
        amax_bound,
        q.fp8_dtype,
        amax_epsilon=q.amax_epsilon,
        use_power_2_scales=q.use_power_2_scales,
    )
    return scale, torch.zeros(1, device=device)


def _ds_bound(
    do8: torch.Tensor,
    do_scale_inv: torch.Tensor,
    v8: torch.Tensor,
    v_scale_inv: torch.Tensor,
    dp: Quantizer,
) -> torch.Tensor:
    """(1,) fp32: `2 * max_i |dO_i| * max_j |v_j|`, row norms over the head dim of the dequantized
    FP8 operands, each maximum taken over the quantizer's amax group (a product of per-rank
    maxima would not be the whole tensor's bound)."""
    do_max = (do8.float().norm(dim=-1).amax() * do_scale_inv).reshape(1)
    v_max = (v8.float().norm(dim=-1).amax() * v_scale_inv).reshape(1)
    # each a rank's maximum -> the group's, one amax element per all-reduce as every
    # current-scaling reduction
    allreduce_current_amax(do_max, dp.amax_reduction_group)
    allreduce_current_amax(v_max, dp.amax_reduction_group)
    return 2.0 * do_max * v_max


class _FlashFP8Attention(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        pad_mask: torch.Tensor | None,
        causal: bool,
        slots: AttentionSlots,
        on_cudnn: bool,
    ) -> torch.Tensor:
        # each cast keeps its input's storage order (the kernels read any of them in place): a
        # (b, heads, s, d) view of (s, b, heads, d) activations is cast without a transposing copy
        casts = [slots.qkv.cast(t, transpose=False) for t in (q, k, v)]
        operands = (*(c.data for c in casts), *(c.scale_inv for c in casts))
        s_scale, s_amax = _inner_scale(slots.s, None, q.device)
        if on_cudnn:
            o = slots.o
            out8, lse, s_scale_fwd, out_scale_inv = fp8_attention_fwd_cudnn(
                *operands, s_scale, s_amax, o.scale, o.amax, o.fp8_dtype, causal
            )
            out = fp8_kernels.dequantize(out8, out_scale_inv, q.dtype)
            saved_out = (out8, out_scale_inv)
        else:
            out, lse, s_scale_fwd = fp8_attention_fwd(
                *operands, s_scale, s_amax, slots.s.fp8_dtype, pad_mask, causal, q.dtype
            )
            saved_out = (out,)
        # the backward rounds P with the forward's scale (a copy: see kernels/attention.py)
        ctx.save_for_backward(*operands, *saved_out, lse, s_scale_fwd, pad_mask)
        ctx.causal, ctx.slots, ctx.on_cudnn = causal, slots, on_cudnn
        ctx.dtypes = (q.dtype, k.dtype, v.dtype)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        q8, k8, v8, q_si, k_si, v_si, *saved_out, lse, s_scale, pad_mask = ctx.saved_tensors
        slots = ctx.slots
        do = slots.do.cast(grad, transpose=False)
        if slots.bwd_groups:
            # the plan's copies: the backward reduces over the group its forward's plan was built for
            enrol_backward_from(grad, slots.enrol_key, slots.bwd_groups, slots.reduction_group)
        bound = None
        if not isinstance(slots.dp, Float8Quantizer):
            bound = _ds_bound(do.data, do.scale_inv, v8, v_si, slots.dp)
        dp_scale, dp_amax = _inner_scale(slots.dp, bound, grad.device)
        operands = (q8, k8, v8)
        scale_invs = (q_si, k_si, v_si, do.scale_inv)
        if ctx.on_cudnn:
            out8, out_scale_inv = saved_out
            g = slots.dqkv
            grads8 = fp8_attention_bwd_cudnn(
                *operands, out8, out_scale_inv, do.data, *scale_invs, lse, s_scale, dp_scale,
                dp_amax, g.scale, g.amax, g.fp8_dtype, ctx.causal,
            )  # fmt: skip
            grad_scale_inv = torch.reciprocal(g.scale)
            dq, dk, dv = (
                fp8_kernels.dequantize(g8, grad_scale_inv, dtype)
                for g8, dtype in zip(grads8, ctx.dtypes)
            )
            return dq, dk, dv, None, None, None, None
        (out,) = saved_out
        grads = fp8_attention_bwd(
            *operands, out, do.data, *scale_invs, lse, s_scale, slots.s.fp8_dtype, dp_scale,
            dp_amax, slots.dp.fp8_dtype, pad_mask, ctx.causal,
        )  # fmt: skip
        dq, dk, dv = (fake_quantize(slots.dqkv, g).to(dtype) for g, dtype in zip(grads, ctx.dtypes))
        return dq, dk, dv, None, None, None, None


def flash_fp8_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pad_mask: torch.Tensor | None, causal: bool,
    slots: AttentionSlots,
) -> torch.Tensor:  # fmt: skip
    """FP8 attention on (batch, heads, seq, head_dim) tensors, k and v at KV-head shape; output in
    q's dtype, rounded through the `o` slot (by cuDNN itself where it runs). `pad_mask` True where
    a key is masked out (broadcastable to (b, 1, sq, sk)); `causal` top-left aligned."""
    on_cudnn = slots.fp8_results and cudnn_runs(q, k, pad_mask, slots.s.fp8_dtype)
    if on_cudnn:
        return _FlashFP8Attention.apply(q, k, v, pad_mask, causal, slots, True)
    if slots.dqkv is not None:
        # set here, outside the Function, where torch.compile may trace the change
        slots.dqkv.set_usage(rowwise=True, columnwise=False)
    out = _FlashFP8Attention.apply(q, k, v, pad_mask, causal, slots, False)
    return round_slots(out, slots.o, None, slots)
