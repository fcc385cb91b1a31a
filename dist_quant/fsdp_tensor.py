"""`GatheredFloat8Weight`: the unsharded parameter FSDP2 builds from an FP8 weight all-gather.

`dist_quant.fsdp` casts each rank's weight shard to FP8 before FSDP2's all-gather; FSDP2 registers
the gathered result on the module as this tensor. It holds the full weight's FP8 bytes and the
scale they were cast with, never the high-precision values, so only a dq Linear-family forward
under autocast can use it (`gathered_weight_operand`); any other op on it raises.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from dist_quant.quantizers import Float8CurrentScalingQuantizer, Float8Quantizer, Quantizer
from dist_quant.tensor import Float8Tensor

_aten = torch.ops.aten
_SAME_TENSOR_OPS = {_aten.detach.default, _aten.alias.default}
_RESHAPE_OPS = {_aten.as_strided.default, _aten.view.default}


def gatherable_in_fp8(quantizer: Quantizer) -> bool:
    """Whether a weight slot's quantizer lets FSDP2 all-gather the weight in FP8 exactly: one
    per-tensor scale every rank can apply to its own shard before the gather. Delayed scaling
    (the scale comes from the history) and current scaling whose amax the gather itself reduces
    (no reduction group of the quantizer's own); not MXFP8 or block scaling (per-block scales of
    the whole weight) nor high precision (nothing to gather in FP8)."""
    return isinstance(quantizer, Float8Quantizer) or (
        isinstance(quantizer, Float8CurrentScalingQuantizer)
        and quantizer.amax_reduction_group is None
    )


class GatherOrigin:
    """What an FP8 all-gather of one weight was cast for: its name, the weight slot's quantizer,
    the FSDP shard group and the TP group of a TP shard (else None).

    It is the context dynamo guards a compiled forward on (`__tensor_flatten__`), so it compares
    by structure (the quantizer's class and FP8 format, TP or not), not by module: identical
    blocks compiled one at a time share one graph, as they do without FP8 all-gather. The
    per-module checks of `gathered_weight_operand` then run when a graph is traced, and the
    graph's guards on each module's quantizers retrace it after a switch."""

    __slots__ = ("name", "quantizer", "group", "tp_group")

    def __init__(self, name: str, quantizer: Quantizer, group: Any, tp_group: Any) -> None:
        self.name, self.quantizer, self.group, self.tp_group = name, quantizer, group, tp_group

    def _structure(self) -> tuple:
        q = self.quantizer
        return (type(q), q.fp8_dtype, self.tp_group is None)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, GatherOrigin) and self._structure() == other._structure()

    def __hash__(self) -> int:
        return hash(self._structure())

    def __deepcopy__(self, memo: dict) -> GatherOrigin:
        # dynamo's guard keeps a deep copy of the context; it names live objects (process groups
        # cannot be copied), and an origin is never mutated, so the copy is the origin itself
        return self


class GatheredFloat8Weight(Tensor):
    """A full (unsharded) weight as FP8 bytes plus its fp32 `scale_inv`; `dtype` is the weight's
    high-precision dtype (what its gradient has). `float8_tensor()` gives the bytes and scale.

    A traceable wrapper subclass: its inner tensors are the bytes, the scale inverse and (delayed
    scaling) the shard amax the forward folds into the weight's history, so a torch.compile'd
    forward takes it as a tensor input whose gradient it keeps."""

    @staticmethod
    def __new__(
        cls,
        data: Tensor,
        scale_inv: Tensor,
        shard_amax: Tensor | None,
        origin: GatherOrigin,
        dtype: torch.dtype,
    ) -> GatheredFloat8Weight:
        return Tensor._make_wrapper_subclass(
            cls, data.shape, dtype=dtype, device=data.device, requires_grad=False
        )

    def __init__(
        self,
        data: Tensor,
        scale_inv: Tensor,
        shard_amax: Tensor | None,
        origin: GatherOrigin,
        dtype: torch.dtype,
    ) -> None:
        self.update(data, scale_inv, shard_amax, origin)

    def float8_tensor(self) -> Float8Tensor:
        """The gathered bytes (`data`, the full weight's shape) and the `scale_inv` they carry."""
        return Float8Tensor(self._data, self._scale_inv, dtype=self.dtype)

    def update(
        self, data: Tensor, scale_inv: Tensor, shard_amax: Tensor | None, origin: GatherOrigin
    ) -> None:
        """A new all-gather into the same unsharded parameter (FSDP2 reuses it)."""
        self._data, self._scale_inv, self._shard_amax = data, scale_inv, shard_amax
        self._origin = origin

    def __tensor_flatten__(self) -> tuple[list[str], tuple]:
        inner = ["_data", "_scale_inv"] + ([] if self._shard_amax is None else ["_shard_amax"])
        return inner, (self._origin, self.dtype)

    @staticmethod
    def __tensor_unflatten__(
        inner: dict[str, Tensor], ctx: tuple, outer_size: Any, outer_stride: Any
    ) -> GatheredFloat8Weight:
        origin, dtype = ctx
        return GatheredFloat8Weight(
            inner["_data"], inner["_scale_inv"], inner.get("_shard_amax"), origin, dtype
        )

    def _same(self) -> GatheredFloat8Weight:
        return GatheredFloat8Weight(
            self._data, self._scale_inv, self._shard_amax, self._origin, self.dtype
        )

    @classmethod
    def __torch_dispatch__(cls, func: Any, types: Any, args: tuple = (), kwargs: Any = None):
        this = args[0] if args and isinstance(args[0], GatheredFloat8Weight) else None
        if this is not None and (
            func in _SAME_TENSOR_OPS
            or (func in _RESHAPE_OPS and tuple(args[1]) == tuple(this.shape))
        ):
            return this._same()
        name = this._origin.name if this is not None else "a weight"
        raise RuntimeError(
            f"{name} was all-gathered in FP8 by dist_quant.fsdp (enable_fp8_all_gather): it holds "
            f"FP8 bytes, not high-precision values, and only a dq module's forward under "
            f"dq.autocast with per-tensor scaling can use it; {func} cannot"
        )

    __torch_function__ = torch._C._disabled_torch_function_impl

    def __repr__(self) -> str:
        return (
            f"GatheredFloat8Weight({self._origin.name}, shape={tuple(self.shape)}, "
            f"fp8_dtype={self._data.dtype})"
        )


class _EmptyGemm(torch.autograd.Function):
    """`x @ weight.T + bias` for an input without rows and a weight gathered in FP8: the empty
    output and the zero gradients F.linear gives a high-precision weight (FSDP2 reduce-scatters
    every weight of a group, so each needs one), without reading the FP8 bytes."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
        ctx.x_meta = (x.shape, x.dtype, x.device)
        ctx.w_meta = (weight.shape, weight.dtype, weight.device)
        ctx.b_meta = None if bias is None else (bias.shape, bias.dtype, bias.device)
        return x.new_empty((*x.shape[:-1], weight.shape[0]))

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, Tensor, Tensor | None]:
        def zeros(meta: tuple) -> Tensor:
            shape, dtype, device = meta
            return torch.zeros(shape, dtype=dtype, device=device)

        return (
            zeros(ctx.x_meta),
            zeros(ctx.w_meta),
            None if ctx.b_meta is None else zeros(ctx.b_meta),
        )


def empty_gemm(x: Tensor, weight: GatheredFloat8Weight, bias: Tensor | None) -> Tensor:
    """A GEMM of an empty input (`x` has no rows; a GroupedLinear expert without tokens) with a
    weight gathered in FP8: the output `(0, out_features)` and zero weight and bias gradients."""
    if x.numel() != 0:
        raise ValueError(f"empty_gemm: the input of {weight._origin.name} has {x.numel()} elements")
    return _EmptyGemm.apply(x, weight, bias)


def _group_covers(reduction_group: Any, shard_group: Any) -> bool:
    """Whether the amax reduction group holds every rank of the FSDP shard group."""
    shard = set(dist.get_process_group_ranks(shard_group))
    if len(shard) == 1:
        return True
    return reduction_group is not None and shard <= set(
        dist.get_process_group_ranks(reduction_group)
    )


def _same_slot(gathered: Quantizer, forward: Quantizer, tp_group: Any) -> bool:
    """Whether the forward's weight quantizer is the one the all-gather cast for: the same
    object, or (a TP shard under current scaling) the TP module's copy of it that reduces its amax
    over the TP group, which the all-gather's scale was reduced over too."""
    if gathered is forward:
        return True
    fields = ("fp8_dtype", "amax_epsilon", "use_power_2_scales")
    return (
        tp_group is not None
        and type(gathered) is Float8CurrentScalingQuantizer
        and type(forward) is Float8CurrentScalingQuantizer
        and gathered.amax_reduction_group is None
        and forward.amax_reduction_group is tp_group
        and all(getattr(gathered, f) == getattr(forward, f) for f in fields)
    )


def gathered_weight_operand(
    weight: GatheredFloat8Weight,
    quantizer: Quantizer,
    reduction_group: Any,
    owner: Callable[[], str],
) -> Float8Tensor:
    """The GEMM operand of a weight gathered in FP8, in place of `quantizer.quantize(full_weight)`
    (the same bytes and scale). Delayed scaling: this rank's shard amax enters the history slot;
    the amax reduction over `reduction_group` (which must cover the FSDP ranks) makes it the full
    weight's amax, as quantizing the full weight on every rank would."""
    origin = weight._origin
    if not _same_slot(origin.quantizer, quantizer, origin.tp_group):
        raise RuntimeError(
            f"{owner()}: {origin.name} was all-gathered in FP8 for another quantizer than this "
            f"forward's weight slot ({quantizer!r}); the recipe changed between the all-gather "
            "and the forward. Switch recipes between steps (apply_recipe / the coordinator)."
        )
    if isinstance(quantizer, Float8Quantizer):
        if not _group_covers(reduction_group, origin.group):
            raise RuntimeError(
                f"{owner()}: delayed scaling with an FP8 weight all-gather needs an "
                "amax_reduction_group (dq.autocast) that covers the FSDP ranks, so the weight's "
                "history records the full weight's amax; pass the data-parallel group (or WORLD)"
            )
        # running max of the step, NaN kept (as Float8Quantizer.quantize folds it); in a
        # recompute the checkpoint frame restores the amax rows afterwards, as for any cast
        torch.maximum(quantizer.amax, weight._shard_amax, out=quantizer.amax)
    elif not isinstance(quantizer, Float8CurrentScalingQuantizer):
        raise RuntimeError(f"{owner()}: {origin.name} is FP8 but its slot runs {quantizer!r}")
    # a copy: FSDP2 frees the gathered storage after the forward, the backward needs the bytes
    return Float8Tensor(weight._data.clone(), weight._scale_inv, dtype=weight.dtype)
