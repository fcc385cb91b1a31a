"""FP8 weight all-gather for FSDP2 (`fully_shard`), through its tensor-subclass extension.

`fully_shard_model(model, blocks)` shards every block and then the model, with FP8 all-gather on by
default when the model's recipe scales every GEMM weight per tensor. `enable_fp8_all_gather(model)`,
called before `fully_shard`, is the switch itself: it wraps the GEMM weights of the dq
Linear-family modules in `FP8AllGatherWeight`. Before each all-gather FSDP2 asks the wrapper for
what to send (`fsdp_pre_all_gather`): this rank's shard cast to FP8 with the scale the weight slot
of the module's current recipe would use for the full weight, as uint8 (gloo cannot move float8;
1 byte per element). After it (`fsdp_post_all_gather`) the bytes become a `GatheredFloat8Weight`,
which the module's forward uses as its quantized weight without casting again. Gradients are
plain high-precision tensors, so FSDP2's reduce-scatter of them is unchanged.

Why the bytes equal casting the full weight: the cast is elementwise and every rank uses one scale.
(Under FSDP2 x TP "the full weight" is this rank's whole TP shard, which is what the TP forward
casts; FSDP2 shards and gathers the TP shard.)
  delayed scaling: the slot's scale, identical on every rank when autocast's amax_reduction_group
      covers the FSDP ranks (checked at the forward); the shard's amax enters the history and that
      reduction turns it into the full weight's amax. A GroupedLinear expert is quantized only on
      ranks that route tokens to it, so its history must get the full weight's amax from those
      ranks alone: its shards' amaxes are all-reduced over the FSDP group (with the current-scaling
      scales in `precompute_fp8_weight_scales`, else in the all-gather) and only a forward with
      tokens for the expert folds the result in.
  current scaling: fp8_max / amax(full weight), from one all-reduce(MAX) of the shards' amaxes
      (then over the TP group for a TP shard, as the TP forward's weight quantizer reduces it):
      batched over every weight by `precompute_fp8_weight_scales(model)` after the optimizer step
      (a weight changed since falls back to its own all-reduce in its all-gather).
Other recipes (MXFP8, block scaling, identity) have no per-tensor scale to share. Once the weights
are wrapped, every recipe planned for their modules is validated against this: `apply_recipe`, a
coordinator switch (refused on every rank before the commit, so the job keeps its recipe) and a
lazy `autocast(recipe=...)` raise `RecipeUpdateError` naming the module and the weight, and
`enable_fp8_all_gather` refuses a model whose applied recipe is one of them.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.utils._pytree as pytree
from torch import Tensor, nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from dist_quant import kernels as fp8_kernels
from dist_quant.forward import current_runtime
from dist_quant.fsdp_tensor import GatheredFloat8Weight, GatherOrigin, gatherable_in_fp8
from dist_quant.modules import GroupedLinear, LayerNormLinear, LayerNormMLP, Linear
from dist_quant.modules.base import QuantizedModule
from dist_quant.quantizers import (
    Float8CurrentScalingQuantizer,
    Float8Quantizer,
    allreduce_current_amax,
)

# parameter name -> index of its forward weight slot (the modules' `get_quantizer_roles` order)
_WEIGHT_SLOTS: dict[type, dict[str, int]] = {
    Linear: {"weight": 1},
    LayerNormLinear: {"weight": 1},
    LayerNormMLP: {"fc1_weight": 1, "fc2_weight": 4},
}

_aten = torch.ops.aten
# FSDP2 chunks, pads, views and copies the parameter while sharding it: those results stay wrapped
_KEEP_WRAPPED = {
    _aten.empty_like.default,
    _aten.new_zeros.default,
    _aten.slice.Tensor,
    _aten.split.Tensor,
    _aten.copy_.default,
    _aten.view.default,
    _aten.as_strided.default,
    _aten._to_copy.default,
    _aten.clone.default,
    _aten.detach.default,
    _aten.alias.default,
}


def _weight_slots(module: nn.Module) -> dict[str, int]:
    """GEMM weight parameter name -> its forward slot index; empty for other modules."""
    if type(module) is GroupedLinear:  # slots: inputs, then weights, then outputs, per expert
        return {f"weight{i}": module.num_gemms + i for i in range(module.num_gemms)}
    return _WEIGHT_SLOTS.get(type(module), {})


class _WeightInfo:
    """Shared by every wrapper derived from one parameter (FSDP2's views and copies of it)."""

    def __init__(self, owner: QuantizedModule, slot: int, name: str) -> None:
        self.owner, self.slot, self.name = owner, slot, name
        # the TP group the forward's weight quantizer reduces a current-scaling amax over
        self.tp_group = owner.tp_group if getattr(owner, "tp_size", 1) > 1 else None
        # delayed scaling folds the full weight's amax, not the shard's (see the module docstring)
        self.folds_full_amax = type(owner) is GroupedLinear
        self.precomputed: tuple | None = None  # (scale, scale_inv, quantizer, version, dtype)
        self.precomputed_amax: tuple | None = None  # (full amax, quantizer, version, dtype)
        # the forward's (scale, scale_inv, quantizer, shard amax)
        self.last_cast: tuple | None = None
        # the shard's dtype as gathered (FSDP2 mixed precision casts it first)
        self.gather_dtype: torch.dtype | None = None


class FP8AllGatherWeight(Tensor):
    """A high-precision weight (or FSDP2's shard of it) whose FSDP2 all-gather moves FP8 bytes."""

    @staticmethod
    def __new__(cls, hp: Tensor, info: _WeightInfo) -> FP8AllGatherWeight:
        return Tensor._make_wrapper_subclass(
            cls,
            hp.size(),
            strides=hp.stride(),
            storage_offset=hp.storage_offset(),
            dtype=hp.dtype,
            layout=hp.layout,
            device=hp.device,
            requires_grad=hp.requires_grad,
        )

    def __init__(self, hp: Tensor, info: _WeightInfo) -> None:
        self._hp = hp
        self._info = info

    @classmethod
    def __torch_dispatch__(cls, func: Any, types: Any, args: tuple = (), kwargs: Any = None):
        infos = []

        def unwrap(t: FP8AllGatherWeight) -> Tensor:
            infos.append(t._info)
            return t._hp

        args, kwargs = pytree.tree_map_only(cls, unwrap, (args, kwargs or {}))
        out = func(*args, **kwargs)
        if func not in _KEEP_WRAPPED:
            return out
        return pytree.tree_map_only(Tensor, lambda t: cls(t, infos[0]), out)

    __torch_function__ = torch._C._disabled_torch_function_impl

    def __reduce_ex__(self, protocol: Any) -> Any:
        # saved (torch.save, DCP) as the plain high-precision tensor: a checkpoint holds weights,
        # not this wrapper, and loads into a model with or without FP8 all-gather
        return self._hp.__reduce_ex__(protocol)

    def __repr__(self) -> str:
        return f"FP8AllGatherWeight({self._info.name}, {self._hp!r})"

    # ---- FSDP2's all-gather extension --------------------------------------------------------
    def fsdp_pre_all_gather(
        self, mesh: Any, outer_size: torch.Size, outer_stride: tuple, module: nn.Module, mp_policy
    ) -> tuple[tuple[Tensor, ...], Any]:
        info = self._info
        if outer_size[0] % mesh.size():
            raise ValueError(
                f"{info.name}: FP8 all-gather needs dim 0 ({outer_size[0]}) divisible by the "
                f"FSDP size {mesh.size()} (FSDP2 would pad the shards)"
            )
        group = mesh.get_group()
        shard = self._hp if mp_policy.param_dtype is None else self._hp.to(mp_policy.param_dtype)
        info.gather_dtype = shard.dtype
        shard_amax = None
        if torch._C._current_graph_task_id() != -1 and info.last_cast is not None:
            # a re-gather for the backward: the forward kept its own copy of the bytes; cast
            # with the forward's scale. The forward's shard amax goes along: a recompute folds it
            # as the forward did (one graph structure for both), and its frame restores the rows
            scale, scale_inv, quantizer, shard_amax = info.last_cast
        else:
            quantizer = _weight_quantizer(info)
            if isinstance(quantizer, Float8Quantizer):
                scale = quantizer.scale.clone()  # the update after this step must not move it
                scale_inv = torch.reciprocal(scale)
                shard_amax = fp8_kernels.amax(shard).reshape(1)
                if info.folds_full_amax:
                    shard_amax = _full_amax(self, shard, shard_amax, quantizer, group)
            else:
                scale, scale_inv = _current_scale(self, shard, quantizer, group)
            info.last_cast = (scale, scale_inv, quantizer, shard_amax)
        data = fp8_kernels.cast_to_fp8(shard, scale, quantizer.fp8_dtype)
        origin = GatherOrigin(info.name, quantizer, group, info.tp_group)
        return (data.view(torch.uint8),), (scale_inv, shard_amax, origin)

    def fsdp_post_all_gather(
        self,
        all_gather_outputs: tuple[Tensor, ...],
        metadata: Any,
        param_dtype: torch.dtype,
        *,
        out: Tensor | None = None,
    ) -> tuple[Tensor, tuple[Tensor, ...]] | None:
        (data_u8,) = all_gather_outputs  # (out_features, in_features) bytes of every rank
        scale_inv, shard_amax, origin = metadata
        gathered = (data_u8.view(origin.quantizer.fp8_dtype), scale_inv, shard_amax, origin)
        if out is not None:  # FSDP2 reuses the unsharded parameter from the first all-gather
            out.update(*gathered)
            return None
        return GatheredFloat8Weight(*gathered, dtype=param_dtype), (data_u8,)


def _weight_quantizer(info: _WeightInfo) -> Float8Quantizer | Float8CurrentScalingQuantizer:
    """The weight slot's quantizer under the recipe the coming forward runs (resolved as the
    forward resolves it), or RuntimeError where FP8 all-gather cannot be exact."""
    owner = info.owner
    runtime = current_runtime(owner)
    if runtime is None:
        raise RuntimeError(
            f"{info.name}: FP8 all-gather (dist_quant.fsdp) needs the forward under dq.autocast; "
            "this all-gather ran with autocast off"
        )
    quantizer = runtime.fwd_quantizers[info.slot]
    if gatherable_in_fp8(quantizer):
        return quantizer
    raise RuntimeError(
        f"{info.name}: FP8 all-gather needs per-tensor (delayed or current) scaling of the "
        f"weight, but module {owner.role_name!r} runs {type(runtime.recipe).__name__} "
        f"({quantizer!r}): its blocks or high precision cannot be cast before the all-gather. "
        "Build the model without enable_fp8_all_gather for this recipe."
    )


def _current_scale(
    weight: FP8AllGatherWeight, shard: Tensor, quantizer: Float8CurrentScalingQuantizer, group: Any
) -> tuple[Tensor, Tensor]:
    pre = weight._info.precomputed
    if (
        pre is not None
        and pre[2] is quantizer
        and pre[3] == weight._hp._version
        and pre[4] == shard.dtype
    ):
        return pre[0], pre[1]
    amax = fp8_kernels.amax(shard).reshape(1)
    allreduce_current_amax(amax, group)  # FSDP shard amax -> the (TP-local) weight's amax
    allreduce_current_amax(amax, weight._info.tp_group)  # TP shard amax -> the whole weight's
    return _scale_of(amax, quantizer)


def _full_amax(
    weight: FP8AllGatherWeight, shard: Tensor, shard_amax: Tensor, q: Float8Quantizer, group: Any
) -> Tensor:
    """The full weight's amax for a delayed-scaling slot that folds it (GroupedLinear)."""
    pre = weight._info.precomputed_amax
    if pre is not None and pre[1] is q and pre[2] == weight._hp._version and pre[3] == shard.dtype:
        return pre[0]
    allreduce_current_amax(shard_amax, group)  # shard amaxes -> the full weight's
    return shard_amax


def _scale_of(amax: Tensor, q: Float8CurrentScalingQuantizer) -> tuple[Tensor, Tensor]:
    return fp8_kernels.current_scale(
        amax, q.fp8_dtype, amax_epsilon=q.amax_epsilon, use_power_2_scales=q.use_power_2_scales
    )


def enable_fp8_all_gather(model: nn.Module) -> int:
    """Wrap the GEMM weights of `model`'s dq Linear, LayerNormLinear, LayerNormMLP and
    GroupedLinear modules (tensor-parallel ones included) so that FSDP2 all-gathers them in FP8;
    call it before `fully_shard`. Returns how many weights it wrapped. Raises ValueError (wrapping
    nothing) for an already sharded model."""
    found = []
    for module in model.modules():
        slots = _weight_slots(module)
        if not slots:
            continue
        name = module.role_name or type(module).__name__
        for param_name in slots:
            param = getattr(module, param_name)
            if isinstance(param, FP8AllGatherWeight):
                continue
            if type(param) is not nn.Parameter:
                raise ValueError(
                    f"enable_fp8_all_gather: {name}.{param_name} is a {type(param).__name__}, "
                    "not a plain Parameter (call it before fully_shard)"
                )
            runtime = module.quant_binding.runtime
            slot = slots[param_name]
            if runtime is not None and not gatherable_in_fp8(runtime.fwd_quantizers[slot]):
                raise ValueError(
                    f"enable_fp8_all_gather: {name}.{param_name} runs "
                    f"{type(runtime.recipe).__name__} ({runtime.fwd_quantizers[slot]!r}); an FP8 "
                    "all-gather needs per-tensor (delayed or current) scaling of the weight"
                )
            found.append((module, param_name, slot, f"{name}.{param_name}", param))
    for module, param_name, slot, qualified, param in found:
        wrapped = FP8AllGatherWeight(param.data, _WeightInfo(module, slot, qualified))
        setattr(module, param_name, nn.Parameter(wrapped, requires_grad=param.requires_grad))
        module.quant_binding.gather_weight_in_fp8(slot, qualified)
    return len(found)


@torch.no_grad()
def precompute_fp8_weight_scales(model: nn.Module) -> int:
    """After the optimizer step: the current-scaling scales of every FP8-gathered weight of
    `model` (and the full amaxes of delayed-scaling GroupedLinear experts), from one
    all-reduce(MAX) of their shards' amaxes per FSDP group, plus one over each TP group of
    tensor-parallel ones (torchao's `precompute_float8_dynamic_scale_for_fsdp` idea). Other
    delayed-scaling weights need none (their scale comes from the history). Every rank must
    call it. Returns how many weights it precomputed."""
    by_group: dict[tuple, list] = {}
    for module in model.modules():
        for param_name in _weight_slots(module):
            param = getattr(module, param_name)
            local = param.to_local() if hasattr(param, "to_local") else param
            if not isinstance(local, FP8AllGatherWeight) or module.quant_binding.runtime is None:
                continue
            quantizer = module.quant_binding.runtime.fwd_quantizers[local._info.slot]
            delayed_full = isinstance(quantizer, Float8Quantizer) and local._info.folds_full_amax
            if not (isinstance(quantizer, Float8CurrentScalingQuantizer) or delayed_full):
                continue
            group = param.device_mesh.get_group() if hasattr(param, "device_mesh") else None
            by_group.setdefault((group, local._info.tp_group), []).append((local, quantizer))
    for (group, tp_group), weights in by_group.items():
        dtypes = [w._info.gather_dtype or w._hp.dtype for w, _ in weights]
        amaxes = torch.stack(
            [fp8_kernels.amax(w._hp.to(d)).reshape(()) for (w, _), d in zip(weights, dtypes)]
        )
        if group is not None and dist.get_world_size(group) > 1:
            dist.all_reduce(amaxes, op=dist.ReduceOp.MAX, group=group)  # shards -> full weights
        allreduce_current_amax(amaxes, tp_group)  # TP shards -> whole weights
        for i, ((w, q), dtype) in enumerate(zip(weights, dtypes)):
            amax = amaxes[i : i + 1]
            if isinstance(q, Float8Quantizer):
                w._info.precomputed_amax = (amax, q, w._hp._version, dtype)
            else:
                scale, scale_inv = _scale_of(amax, q)
                w._info.precomputed = (scale, scale_inv, q, w._hp._version, dtype)
    return sum(len(w) for w in by_group.values())


def _per_tensor_weights(model: nn.Module) -> bool:
    """Whether every GEMM weight slot of `model` runs per-tensor scaling under its applied recipe
    (a module without one says no)."""
    found = False
    for module in model.modules():
        slots = _weight_slots(module)
        if not slots:
            continue
        runtime = module.quant_binding.runtime
        if runtime is None:
            return False
        if not all(gatherable_in_fp8(runtime.fwd_quantizers[slot]) for slot in slots.values()):
            return False
        found = True
    return found


def fully_shard_model(
    model: nn.Module,
    blocks: Any,
    *,
    fp8_all_gather: bool | None = None,
    **fully_shard_kwargs: Any,
) -> bool:
    """`fully_shard` each of `blocks` and then `model` (keyword arguments go to every call).
    Without `mesh=`, the mesh is every rank on the device the model's parameters are on (FSDP2's
    own default is the accelerator, which would move a CPU model onto the GPU).
    `fp8_all_gather=None` turns FP8 weight all-gather on when every GEMM weight of `model` runs
    delayed or current scaling under the recipe applied to it (`dq.apply_recipe` first); True
    forces it (raising where it cannot be exact), False keeps the high-precision all-gather.
    Returns whether it is on."""
    if fp8_all_gather is None:
        fp8_all_gather = _per_tensor_weights(model)
    if fp8_all_gather:
        enable_fp8_all_gather(model)
    if "mesh" not in fully_shard_kwargs:
        device = next((p.device for p in model.parameters()), torch.device("cpu"))
        if device.type != "meta":
            mesh = init_device_mesh(device.type, (dist.get_world_size(),))
            fully_shard_kwargs = {**fully_shard_kwargs, "mesh": mesh}
    for block in blocks:
        fully_shard(block, **fully_shard_kwargs)
    fully_shard(model, **fully_shard_kwargs)
    return fp8_all_gather
