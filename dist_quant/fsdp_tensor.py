"""`GatheredFloat8Weight`: the unsharded parameter FSDP2 builds from an FP8 weight all-gather.

`dist_quant.fsdp` casts each rank's weight shard to FP8 before FSDP2's all-gather; FSDP2 registers
the gathered result on the module as this tensor. It holds the full weight's FP8 bytes and the
scale they were cast with, never the high-precision values, so only a dq Linear-family forward
under autocast can use it (`gathered_weight_operand`); any other op on it raises.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from dist_quant.quantizers import Float8CurrentScalingQuantizer, Float8Quantizer, Quantizer
from dist_quant.tensor import Float8Tensor

_aten = torch.ops.aten
_SAME_TENSOR_OPS = {_aten.detach.default, _aten.alias.default}
_RESHAPE_OPS = {_aten.as_strided.default, _aten.view.default}


class GatheredFloat8Weight(Tensor):
    """A full (unsharded) weight as FP8 bytes plus its fp32 `scale_inv`; `dtype` is the weight's
    high-precision dtype (what its gradient has). `float8_tensor()` gives the bytes and scale."""

    @staticmethod
    def __new__(cls, fp8: Float8Tensor, meta: dict[str, Any]) -> GatheredFloat8Weight:
        return Tensor._make_wrapper_subclass(
            cls, fp8.shape, dtype=fp8.dtype, device=fp8.device, requires_grad=False
        )

    def __init__(self, fp8: Float8Tensor, meta: dict[str, Any]) -> None:
        self._fp8 = fp8
        # quantizer: the slot it was cast for; shard_amax: the amax a delayed-scaling forward
        # folds into the history (this rank's shard's, or the full weight's for GroupedLinear);
        # group: the FSDP shard group; tp_group: the TP group of a TP shard, else None; name
        self._meta = meta

    def float8_tensor(self) -> Float8Tensor:
        """The gathered bytes (`data`, the full weight's shape) and the `scale_inv` they carry."""
        return self._fp8

    def update(self, fp8: Float8Tensor, meta: dict[str, Any]) -> None:
        """A new all-gather into the same unsharded parameter (FSDP2 reuses it)."""
        self._fp8, self._meta = fp8, meta

    @classmethod
    def __torch_dispatch__(cls, func: Any, types: Any, args: tuple = (), kwargs: Any = None):
        this = args[0] if args and isinstance(args[0], GatheredFloat8Weight) else None
        if this is not None and (
            func in _SAME_TENSOR_OPS
            or (func in _RESHAPE_OPS and tuple(args[1]) == tuple(this.shape))
        ):
            return GatheredFloat8Weight(this._fp8, this._meta)
        name = this._meta["name"] if this is not None else "a weight"
        raise RuntimeError(
            f"{name} was all-gathered in FP8 by dist_quant.fsdp (enable_fp8_all_gather): it holds "
            f"FP8 bytes, not high-precision values, and only a dq module's forward under "
            f"dq.autocast with per-tensor scaling can use it; {func} cannot"
        )

    __torch_function__ = torch._C._disabled_torch_function_impl

    def __repr__(self) -> str:
        return (
            f"GatheredFloat8Weight({self._meta['name']}, shape={tuple(self.shape)}, "
            f"fp8_dtype={self._fp8.fp8_dtype})"
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


@torch.compiler.disable(
    reason="a weight all-gathered in FP8 by FSDP2 (GatheredFloat8Weight) is not a traceable "
    "tensor subclass: traced, its gradient would be dropped"
)
def empty_gemm(x: Tensor, weight: GatheredFloat8Weight, bias: Tensor | None) -> Tensor:
    """A GEMM of an empty input (`x` has no rows; a GroupedLinear expert without tokens) with a
    weight gathered in FP8: the output `(0, out_features)` and zero weight and bias gradients."""
    if x.numel() != 0:
        raise ValueError(
            f"empty_gemm: the input of {weight._meta['name']} has {x.numel()} elements"
        )
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
    owner: str,
    *,
    fold_amax: bool = True,
) -> Float8Tensor:
    """The GEMM operand of a weight gathered in FP8, in place of `quantizer.quantize(full_weight)`
    (the same bytes and scale). Delayed scaling: this rank's shard amax enters the history slot;
    the amax reduction over `reduction_group` (which must cover the FSDP ranks) makes it the full
    weight's amax, as quantizing the full weight on every rank would."""
    meta = weight._meta
    if not _same_slot(meta["quantizer"], quantizer, meta["tp_group"]):
        raise RuntimeError(
            f"{owner}: {meta['name']} was all-gathered in FP8 for another quantizer than this "
            f"forward's weight slot ({quantizer!r}); the recipe changed between the all-gather "
            "and the forward. Switch recipes between steps (apply_recipe / the coordinator)."
        )
    if isinstance(quantizer, Float8Quantizer):
        if not _group_covers(reduction_group, meta["group"]):
            raise RuntimeError(
                f"{owner}: delayed scaling with an FP8 weight all-gather needs an "
                "amax_reduction_group (dq.autocast) that covers the FSDP ranks, so the weight's "
                "history records the full weight's amax; pass the data-parallel group (or WORLD)"
            )
        if fold_amax:  # running max of the step, NaN kept (as Float8Quantizer.quantize folds it)
            torch.maximum(quantizer.amax, meta["shard_amax"], out=quantizer.amax)
    elif not isinstance(quantizer, Float8CurrentScalingQuantizer):
        raise RuntimeError(f"{owner}: {meta['name']} is FP8 but its slot runs {quantizer!r}")
    fp8 = weight._fp8
    # a copy: FSDP2 frees the gathered storage after the forward, the backward needs the bytes
    return Float8Tensor(fp8.data.clone(), fp8.scale_inv, dtype=fp8.dtype)
