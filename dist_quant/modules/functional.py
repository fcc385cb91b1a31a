"""The quantized linear GEMM triple (fprop, dgrad, wgrad) shared by every linear-like module.

    fprop: y  = x  @ W^T      x (M, K) rowwise,  W (N, K) rowwise
    dgrad: dx = dy @ W        dy (M, N) rowwise, W^T (K, N) = W columnwise
    wgrad: dW = dy^T @ x      dy^T (N, M) = dy columnwise, x^T (K, M) = x columnwise

Each operand is quantized once by its slot's quantizer; the saved activations are the quantized
ones, flattened into tensors for `ctx.save_for_backward` (so saved-tensor hooks, hence non-reentrant
checkpointing and CPU offload, see them). Identity quantizers leave an operand in high precision.

A recipe's per-pass overrides (`LinearSlots.forward_mode` / `backward_mode`, `kinds.PassMode`):
- forward HIGH_PRECISION: fprop is `F.linear` on the original operands (as under "bf16"), which
  are saved; the backward quantizes x^T and W^T from them with the input and weight quantizers;
- backward HIGH_PRECISION: the forward saves x and W unquantized and the backward is exactly an
  unconverted `F.linear`'s (`dx = dy.mm(W)`, `dW = (x^T.mm(dy))^T`, in the activations' dtype);
- backward DEQUANTIZED: the same GEMMs on the forward's quantized x and W, dequantized to the
  activations' dtype; the output gradient is never quantized.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F

from dist_quant.forward import enrol_backward_from
from dist_quant.gemm import gemm, per_tensor_gemm
from dist_quant.kernels import swiglu, swiglu_backward
from dist_quant.kinds import ParallelMode, PassMode
from dist_quant.parallel import (
    TPLayout,
    all_gather_quantized,
    all_gather_seq,
    all_reduce_sum,
    copy_to_tp_region,
    gather_from_sequence_parallel_region,
    reduce_from_tp_region,
    reduce_scatter_seq,
    reduce_scatter_to_sequence_parallel_region,
)
from dist_quant.quantizers import (
    Float8CurrentScalingQuantizer,
    Float8Quantizer,
    IdentityQuantizer,
    PerTensorCast,
    Quantizer,
)
from dist_quant.tensor import Float8Tensor, QuantizedTensor, from_saved, to_saved

# Quantizers whose `cast` the per-tensor path calls (exact types: a subclass may override
# `quantize`, which only the general path calls)
_PER_TENSOR = (Float8Quantizer, Float8CurrentScalingQuantizer)


@dataclass(frozen=True)
class LinearSlots:
    """The quantizers of one GEMM triple; `output`/`grad_input` apply only at an FP8 boundary."""

    input: Quantizer
    weight: Quantizer
    grad_output: Quantizer
    output: Quantizer | None = None
    grad_input: Quantizer | None = None
    bwd_groups: tuple = ()
    reduction_group: Any = None
    """The plan's amax reduction group: the backward's `bwd_groups` reduce over it."""
    enrol_key: int | torch.Tensor = -1
    """The owning module's `QuantBinding.enrol_key` (its tag tensor in a traced plan): a traced
    backward enrols through it."""
    forward_mode: PassMode = PassMode.QUANTIZED
    """The recipe's `forward_override` (see the module docstring)."""
    backward_mode: PassMode = PassMode.QUANTIZED
    """The recipe's `backward_override` (see the module docstring)."""
    high_precision: bool = field(init=False)
    """Every GEMM operand stays in high precision (decided once, when the plan is built)."""
    per_tensor: bool = field(init=False)
    """Every GEMM operand is per-tensor FP8 (delayed or current scaling) and no pass is
    overridden: `quantized_linear` may take the per-tensor path."""

    def __post_init__(self) -> None:
        operands = (self.input, self.weight, self.grad_output)
        hp = all(isinstance(q, IdentityQuantizer) for q in operands)
        default_modes = self.forward_mode is self.backward_mode is PassMode.QUANTIZED
        per_tensor = default_modes and all(type(q) in _PER_TENSOR for q in operands)
        object.__setattr__(self, "high_precision", hp)  # frozen: set once, here
        object.__setattr__(self, "per_tensor", per_tensor)


def rowwise(t: Any) -> Any:
    return t.rowwise_operand() if isinstance(t, QuantizedTensor) else t


def columnwise(t: Any) -> Any:
    return t.columnwise_operand() if isinstance(t, QuantizedTensor) else t.t()


def fake_quantize(q: Quantizer | None, t: torch.Tensor) -> torch.Tensor:
    """Round `t` through an FP8 boundary slot and back (what the consumer would receive)."""
    if q is None or isinstance(q, IdentityQuantizer):
        return t
    if type(q) in _PER_TENSOR:
        # the bytes alone, whatever the usage flags say: setting them would be a mutation inside
        # the autograd.Functions that call this, which torch.compile refuses
        cast = q.cast(t, transpose=False)
        return Float8Tensor(cast.data, cast.scale_inv, dtype=t.dtype).dequantize(t.dtype)
    q.set_usage(rowwise=True, columnwise=False)
    return q.quantize(t).dequantize(t.dtype)


class SwiGLU(torch.autograd.Function):
    """``silu(gate) * up`` of ``h = [gate, up]`` and its gradient, one kernel each way
    (``kernels/swiglu.py``: the bits of eager torch's ops on the halves, without their strided
    passes and the gradients' concat); keeps ``h`` for the backward, not the silu it recomputes."""

    @staticmethod
    def forward(ctx: Any, h: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(h)
        return swiglu(h)

    @staticmethod
    def backward(ctx: Any, dy: torch.Tensor) -> torch.Tensor:
        (h,) = ctx.saved_tensors
        return swiglu_backward(dy, h)


class SwiGLUGradHandoff:
    """fc1 -> SwiGLU -> fc2 on the per-tensor path (one per LayerNormMLP forward): fc2's backward
    casts ``h``'s gradient itself with fc1's grad-output quantizer
    (``Quantizer.cast_swiglu_backward``: no high-precision ``dh``) and leaves the cast here; fc1's
    backward takes it instead of casting its incoming gradient, which is then an all-zero
    stand-in (autograd needs a tensor of ``h``'s shape; nothing else reads ``h``'s gradient).

    fc1's forward arms it (``quantizer``, ``transpose``) only where its own backward would cast
    that gradient per-tensor and use it for nothing else: its ``_PerTensorLinear`` path, no bias
    gradient (the bias gradient sums the high-precision ``dh``)."""

    __slots__ = ("cast", "quantizer", "transpose")

    def __init__(self) -> None:
        # fc1's grad-output quantizer (a _PER_TENSOR type: _PerTensorLinear's slots), once armed
        self.quantizer: Float8Quantizer | Float8CurrentScalingQuantizer | None = None
        self.transpose = False  # fc1 computes its weight gradient: the cast's transpose too
        self.cast: PerTensorCast | None = None  # dh's cast, from fc2's backward to fc1's


class _QuantizedLinear(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any,
        x: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        slots: LinearSlots,
        weight_q: Any,
        fp8_output: bool,
        fp8_grad_input: bool,
        tp: TPLayout | None,
    ) -> torch.Tensor:
        in_features = weight.shape[1]
        x2d = x.reshape(-1, in_features)  # (tokens, in_features)
        fwd_quantized = slots.forward_mode is PassMode.QUANTIZED
        gathers = tp is not None and tp.gathers_input()
        # a high-precision pass reads the original operands (gathered in high precision)
        keep_hp = PassMode.HIGH_PRECISION in (slots.forward_mode, slots.backward_mode)
        x_hp = all_gather_seq(x2d, tp.group) if keep_hp and gathers else x2d
        w_hp = weight.to(x.dtype) if keep_hp else None  # (out, in)
        if not fwd_quantized:
            x_q, weight_q = x_hp, w_hp
        elif gathers and not keep_hp:
            # (tokens/tp, in) shard -> (tokens, in) quantized, FP8 bytes gathered as uint8
            x_q = all_gather_quantized(
                x2d,
                slots.input,
                tp.group,
                columnwise=weight.requires_grad and slots.backward_mode is PassMode.QUANTIZED,
                what=lambda: f"module {tp.name!r} input",
            )
        else:
            x_q = slots.input.quantize(x_hp)  # usage set by quantized_linear
        if tp is not None and tp.mode is ParallelMode.ROW:
            y = gemm(rowwise(x_q), rowwise(weight_q), out_dtype=torch.float32)  # (tokens, out)
            # fp32 partial sums over this rank's input features -> full sums (SP: own rows only);
            # reduced in the GEMM's accumulation dtype, so TP only reorders the additions
            y = (
                reduce_scatter_seq(y, tp.group)
                if tp.sequence_parallel
                else all_reduce_sum(y, tp.group)
            )
            if bias is not None:
                y = y + bias.float()  # once, after the reduction
            y = y.to(x.dtype)
        elif not fwd_quantized:
            y = F.linear(x_hp, w_hp, None if bias is None else bias.to(x.dtype))  # as "bf16"
        else:
            # bias added in fp32 before the one rounding to x.dtype (the GEMM epilogue on CUDA):
            # the same bits as an fp32 output + bias + cast, without writing the fp32 output
            y = gemm(rowwise(x_q), rowwise(weight_q), out_dtype=x.dtype, bias=bias)
        if fp8_output:
            y = fake_quantize(slots.output, y)
        ctx.slots, ctx.tp = slots, tp
        # the backward reads x only as the wgrad operand and W only for dgrad: each is saved only
        # where it is needed, in the form the backward's mode reads (see the module docstring)
        x_orig = x_hp if keep_hp else None
        x_kept = _kept(slots, x_q, x_orig, columnwise) if weight.requires_grad else None
        w_kept = _kept(slots, weight_q, w_hp, lambda w: w) if x.requires_grad else None
        x_saved, x_layout = to_saved(x_kept)
        w_saved, w_layout = to_saved(w_kept)
        ctx.save_for_backward(*x_saved, *w_saved)
        ctx.layouts = (x_layout, w_layout)
        ctx.shapes = (x.shape, x.dtype, weight.dtype, None if bias is None else bias.dtype)
        ctx.fp8_grad_input = fp8_grad_input
        if tp is not None and tp.sequence_parallel:
            return y.reshape(-1, *x.shape[1:-1], weight.shape[0])  # dim 0 gathered / scattered
        return y.reshape(*x.shape[:-1], weight.shape[0])

    @staticmethod
    def backward(ctx: Any, dy: torch.Tensor) -> tuple:
        slots: LinearSlots = ctx.slots
        tp: TPLayout | None = ctx.tp
        x_layout, w_layout = ctx.layouts
        saved = ctx.saved_tensors
        x_t = from_saved(saved[: x_layout.num_tensors], x_layout)  # see _saved_input
        weight_q = from_saved(saved[x_layout.num_tensors :], w_layout)  # see _saved_weight
        x_shape, x_dtype, w_dtype, b_dtype = ctx.shapes
        need_dx, need_dw, need_db = ctx.needs_input_grad[:3]
        dy2d = dy.reshape(-1, dy.shape[-1]).contiguous()  # (tokens, out_features)
        if slots.backward_mode is not PassMode.QUANTIZED:
            return _unquantized_backward(ctx, dy2d, x_t, weight_q)
        if slots.forward_mode is not PassMode.QUANTIZED:
            # the forward kept the original x and W: quantize the wgrad / dgrad operands now
            # (usage: columnwise only, set before the Function ran: a backward must not mutate)
            x_t = None if x_t is None else columnwise(slots.input.quantize(x_t))
            weight_q = None if weight_q is None else slots.weight.quantize(weight_q)
        if tp is not None and tp.gathers_grad_output():
            # (tokens/tp, out) shard -> (tokens, out) quantized, FP8 bytes gathered as uint8
            dy_q = all_gather_quantized(
                dy2d,
                slots.grad_output,
                tp.group,
                columnwise=need_dw,
                what=lambda: f"module {tp.name!r} grad_output",
            )
        else:
            slots.grad_output.set_usage(rowwise=need_dx, columnwise=need_dw)
            dy_q = slots.grad_output.quantize(dy2d)
        if slots.bwd_groups:
            enrol_backward_from(dy2d, slots.enrol_key, slots.bwd_groups, slots.reduction_group)
        dx = dw = db = None
        if need_dx:
            if tp is not None and tp.mode is ParallelMode.COLUMN:
                dx = gemm(rowwise(dy_q), columnwise(weight_q), out_dtype=torch.float32)
                # fp32 partial input grads (one per output-feature shard) -> full sums (SP: own rows)
                if tp.sequence_parallel:
                    dx = reduce_scatter_seq(dx, tp.group)
                else:
                    dx = all_reduce_sum(dx, tp.group)
                dx = dx.to(x_dtype)
            else:
                dx = gemm(rowwise(dy_q), columnwise(weight_q), out_dtype=x_dtype)
            if ctx.fp8_grad_input:
                dx = fake_quantize(slots.grad_input, dx)
            dx = dx.reshape(x_shape)
        if need_dw:
            dw = gemm(columnwise(dy_q), x_t, out_dtype=w_dtype)
        if need_db and b_dtype is not None:
            # a row-parallel bias under SP sees only this rank's rows: a partial sum, completed by
            # allreduce_sequence_parallel_grads (the bias is marked sequence_parallel)
            db = dy2d.float().sum(0).to(b_dtype)
        return dx, dw, db, None, None, None, None, None


def _kept(slots: LinearSlots, quantized: Any, original: Any, usage: Callable) -> Any:
    """What the backward keeps of an operand (the input for wgrad, the weight for dgrad): its
    rowwise operand for a dequantized backward, the original (gathered) tensor where either pass
    runs in high precision (the backward quantizes it, or uses it as it is), else the quantized
    form the backward reads (`usage`: the input's columnwise operand, the weight container)."""
    if slots.backward_mode is PassMode.DEQUANTIZED:
        return rowwise(quantized)
    if original is not None:
        return original
    return usage(quantized)


def _unquantized_backward(ctx: Any, dy2d: torch.Tensor, x_saved: Any, w_saved: Any) -> tuple:
    """The backward of a HIGH_PRECISION or DEQUANTIZED backward mode: `F.linear`'s own GEMMs on the
    saved operands (original, or dequantized to the activations' dtype) and the unquantized
    output gradient, with the TP collectives of the layout in the activations' dtype."""
    slots: LinearSlots = ctx.slots
    tp: TPLayout | None = ctx.tp
    x_shape, x_dtype, w_dtype, b_dtype = ctx.shapes
    need_dx, need_dw, need_db = ctx.needs_input_grad[:3]
    x_hp = _as_dense(x_saved, x_dtype)  # (tokens, in)
    w_hp = _as_dense(w_saved, x_dtype)  # (out, in)
    dy_full = dy2d
    if tp is not None and tp.gathers_grad_output():
        dy_full = all_gather_seq(dy2d, tp.group)  # (tokens/tp, out) shards -> (tokens, out)
    dx = dw = db = None
    if need_dx:
        dx = dy_full.mm(w_hp)  # (tokens, in)
        if tp is not None and tp.mode is ParallelMode.COLUMN:
            # partial input grads (one per output-feature shard) -> full sums (SP: own rows)
            if tp.sequence_parallel:
                dx = reduce_scatter_seq(dx, tp.group)
            else:
                dx = all_reduce_sum(dx, tp.group)
        if ctx.fp8_grad_input:
            dx = fake_quantize(slots.grad_input, dx)
        dx = dx.reshape(x_shape)
    if need_dw:
        dw = x_hp.t().mm(dy_full).t().to(w_dtype)  # as addmm's backward: (in, out) transposed
    if need_db and b_dtype is not None:
        db = dy2d.sum(0).to(b_dtype)
    return dx, dw, db, None, None, None, None, None


def _as_dense(saved: Any, dtype: torch.dtype) -> Any:
    if saved is None or isinstance(saved, torch.Tensor):
        return saved
    return saved.dequantize(dtype)


def quantized_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    slots: LinearSlots,
    weight_q: Any,
    *,
    fp8_output: bool = False,
    fp8_grad_input: bool = False,
    tp: TPLayout | None = None,
    swiglu_input: bool = False,
    swiglu_handoff: SwiGLUGradHandoff | None = None,
) -> torch.Tensor:
    """`x @ weight.T + bias` with the operands quantized by `slots` (weight pre-quantized).

    With `tp` the GEMM is one rank's part of a tensor-parallel GEMM (`weight` is the shard) and runs
    the collectives of its layout; the slots' quantizers must come from `tp.shard_quantizers`.

    With `swiglu_input`, `x` is `h = [gate, up]` and the GEMM's input is `swiglu(h)`: on the
    per-tensor path the input cast reads `h` (`cast_swiglu`), so the activation is never written in
    high precision; on any other path `SwiGLU` computes it first. The same bits either way.
    `swiglu_handoff` (LayerNormMLP, both GEMMs): fc1's call (no `swiglu_input`) arms it where its
    backward can take its gradient's cast from fc2's (`SwiGLUGradHandoff`), fc2's call fills it.
    """
    if tp is not None and tp.sequence_parallel:
        check_sequence_shardable(x, tp)
    if (
        slots.per_tensor
        and tp is None
        and not (fp8_output or fp8_grad_input)
        and type(weight_q) is Float8Tensor
    ):
        if (
            swiglu_handoff is not None
            and not swiglu_input
            and not (bias is not None and bias.requires_grad)
        ):
            swiglu_handoff.quantizer = slots.grad_output
            swiglu_handoff.transpose = weight.requires_grad
        return _PerTensorLinear.apply(
            x, weight, bias, slots, weight_q, swiglu_input, swiglu_handoff
        )
    if swiglu_input:
        x = SwiGLU.apply(x)
    # The usage flags are set here, not in the autograd.Function, where torch.compile refuses a
    # mutation (it traces the backward with the forward); the backward's own set_usage then
    # stores nothing, its needs being the inputs' requires_grad.
    fwd_quantized = slots.forward_mode is PassMode.QUANTIZED
    bwd_quantized = slots.backward_mode is PassMode.QUANTIZED
    if not fwd_quantized:
        # the input is quantized only in the backward, as the wgrad operand
        if weight.requires_grad:
            slots.input.set_usage(rowwise=False, columnwise=True)
    elif tp is None or not tp.gathers_input() or not bwd_quantized:
        # (an overridden backward needs no columnwise copy; under HIGH_PRECISION the forward
        # gathers the input in high precision and quantizes the whole of it here)
        slots.input.set_usage(rowwise=True, columnwise=weight.requires_grad and bwd_quantized)
    if (
        bwd_quantized
        and (x.requires_grad or weight.requires_grad)
        and (tp is None or not tp.gathers_grad_output())
    ):
        slots.grad_output.set_usage(rowwise=x.requires_grad, columnwise=weight.requires_grad)
    return _QuantizedLinear.apply(x, weight, bias, slots, weight_q, fp8_output, fp8_grad_input, tp)


class _PerTensorLinear(torch.autograd.Function):
    """`_QuantizedLinear` for the commonest case, every operand per-tensor FP8 on one rank with
    no FP8 boundary, with the host time cut: the casts hand over their bytes and scale inverses
    (`Quantizer.cast`) and the GEMMs take them (`per_tensor_gemm`), with no containers, operands
    or layouts built in between. The same casts and GEMMs on the same operands as the general
    path, hence the same bits; saved tensors are the FP8 bytes, as there.

    With `swiglu`, `x` is `h = [gate, up]` (LayerNormMLP's fc1 output) and the input cast is
    `cast_swiglu(h)`: the bytes of casting `swiglu(h)`, which is never written in high precision;
    `h` is saved and the backward turns the GEMM's input gradient into `h`'s (`swiglu_backward`),
    as `SwiGLU` would after the unfused GEMM. With an armed `handoff` that gradient is cast to
    fc1's grad-output FP8 right there (`SwiGLUGradHandoff`), and fc1's backward takes the cast."""

    @staticmethod
    def forward(
        ctx: Any,
        x: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        slots: LinearSlots,
        weight_q: Float8Tensor,
        swiglu: bool,
        handoff: SwiGLUGradHandoff | None,
    ) -> torch.Tensor:
        out_features, in_features = weight.shape
        width = 2 * in_features if swiglu else in_features
        # (tokens, width); a 2D input is used as it is (a view op costs host time)
        x2d = x if x.dim() == 2 else x.reshape(-1, width)
        need_wgrad = weight.requires_grad
        if swiglu:
            x_data, x_t, x_scale_inv = slots.input.cast_swiglu(x2d, transpose=need_wgrad)
        else:
            x_data, x_t, x_scale_inv = slots.input.cast(x2d, transpose=need_wgrad)
        w_scale_inv = weight_q.scale_inv
        y = per_tensor_gemm(
            x_data,
            x_scale_inv,
            weight_q.data,
            w_scale_inv,
            out_dtype=x.dtype,
            bias=bias,
        )
        ctx.slots, ctx.handoff, ctx.swiglu = slots, handoff, swiglu
        # as the general path: x only as the wgrad operand x^T, W^T only for dgrad
        x_saved = (x_t, x_scale_inv) if need_wgrad else (None, None)
        w_saved = (weight_q.transpose_data(), w_scale_inv) if x.requires_grad else (None, None)
        h_saved = x2d if swiglu and x.requires_grad else None  # (tokens, 2 * in_features)
        ctx.save_for_backward(*x_saved, *w_saved, h_saved)
        ctx.shapes = (x.shape, x.dtype, weight.dtype, None if bias is None else bias.dtype)
        return y if x2d is x else y.reshape(*x.shape[:-1], out_features)

    @staticmethod
    def backward(ctx: Any, dy: torch.Tensor) -> tuple:
        slots: LinearSlots = ctx.slots
        x_t, x_scale_inv, w_t, w_scale_inv, h = ctx.saved_tensors
        x_shape, x_dtype, w_dtype, b_dtype = ctx.shapes
        need_dx, need_dw, need_db = ctx.needs_input_grad[:3]
        handoff: SwiGLUGradHandoff | None = ctx.handoff
        handed = None
        if handoff is not None and not ctx.swiglu:  # fc1: fc2's backward may have cast dy
            handed, handoff.cast = handoff.cast, None
        if handed is not None:  # dy is the all-zero stand-in: not read, not made contiguous
            dy2d = dy
            dy_data, dy_t, dy_scale_inv = handed
        else:
            dy2d = (dy if dy.dim() == 2 else dy.reshape(-1, dy.shape[-1])).contiguous()
            dy_data, dy_t, dy_scale_inv = slots.grad_output.cast(dy2d, transpose=need_dw)
        if slots.bwd_groups:
            enrol_backward_from(dy2d, slots.enrol_key, slots.bwd_groups, slots.reduction_group)
        dx = dw = db = None
        if need_dx:
            dx = per_tensor_gemm(dy_data, dy_scale_inv, w_t, w_scale_inv, out_dtype=x_dtype)
            if h is not None and handoff is not None and handoff.quantizer is not None:
                # fc1's grad-output cast of h's gradient, fused with SwiGLU's backward
                handoff.cast = handoff.quantizer.cast_swiglu_backward(
                    dx, h, transpose=handoff.transpose
                )
                dx = dx.new_zeros(()).expand(x_shape)
            elif h is not None:  # the activation's gradient -> h's (tokens, 2 * in_features)
                dx = swiglu_backward(dx, h)
            if len(x_shape) != 2 and dx.shape != x_shape:
                dx = dx.reshape(x_shape)
        if need_dw:
            dw = per_tensor_gemm(dy_t, dy_scale_inv, x_t, x_scale_inv, out_dtype=w_dtype)
        if need_db and b_dtype is not None:
            db = dy2d.float().sum(0).to(b_dtype)
        return dx, dw, db, None, None, None, None


def check_sequence_shardable(x: torch.Tensor, tp: TPLayout) -> None:
    """Under SP dim 0 is the sequence; a row-parallel GEMM scatters it over the ranks."""
    if x.dim() < 2:
        raise ValueError(
            f"{tp.name}: sequence parallelism needs a (sequence, ..., features) input, got shape "
            f"{tuple(x.shape)}"
        )
    if tp.mode is ParallelMode.ROW and x.shape[0] % tp.size:
        raise ValueError(
            f"{tp.name}: sequence length {x.shape[0]} (dim 0) is not divisible by the "
            f"tensor-parallel size {tp.size}"
        )


def parallel_linear_hp(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, tp: TPLayout
) -> torch.Tensor:
    """The high-precision tensor-parallel GEMM (autocast off, or identity quantizers everywhere):
    `F.linear` between the autograd collectives of `tp`'s layout."""
    b = None if bias is None else bias.to(x.dtype)
    if tp.sequence_parallel:
        check_sequence_shardable(x, tp)
    if tp.mode is ParallelMode.COLUMN:
        if tp.sequence_parallel:
            x = gather_from_sequence_parallel_region(x, tp.group)
        else:
            x = copy_to_tp_region(x, tp.group)
        return F.linear(x, weight.to(x.dtype), b)
    y = F.linear(x, weight.to(x.dtype))  # partial sums over this rank's input features
    if tp.sequence_parallel:
        y = reduce_scatter_to_sequence_parallel_region(y, tp.group)
    else:
        y = reduce_from_tp_region(y, tp.group)
    return y if b is None else y + b
