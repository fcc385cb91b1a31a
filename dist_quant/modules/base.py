"""`QuantizedModule`: what every dist-quant module shares.

A module that owns quantizers declares its slots (`num_quantizers`, `get_quantizer_roles`) and its
forward plan (`plan_forward`: per GEMM, the slot objects its forward runs), and reads its
`quant_binding` (`dist_quant.binding.QuantBinding`) once per forward through `forward_plan()`. That
is the hot path: one autocast context read and one integer comparison (the recipe revision) when
nothing moved since the last forward, then the plan the runtime built at publish. Otherwise it
resolves the recipe (pinned by `apply_recipe` / the coordinator, else autocast's, else the default)
and, if the runtime key changed, plans, validates and publishes this module (or its planned root).
"""

from __future__ import annotations

import warnings
from typing import Any

import torch
from torch import nn

from dist_quant import context as _context
from dist_quant import recompute
from dist_quant.binding import (  # noqa: F401 - provisional_role_names: the modules layer's name
    ForwardPlan,
    QuantBinding,
    assign_role_names,
    planned_root,
    provisional_role_names,
)
from dist_quant.checkpoint.module_state import load_module_extra_state, module_extra_state
from dist_quant.fsdp_tensor import gatherable_in_fp8
from dist_quant.kinds import PassMode
from dist_quant.modules.enrol import enrol_forward, enrol_forward_now, module_key
from dist_quant.quantizers import IdentityQuantizer, Quantizer
from dist_quant.recipes import Recipe
from dist_quant.roles import QuantizerRole
from dist_quant.runtime import (
    ModuleRuntime,
    dist_quant_modules,
    plan_module,
    plan_modules,
    publish_candidates,
)


def check_sizes(owner: str, **sizes: object) -> None:
    """The one check of every module constructor's sizes: ValueError naming `owner`, the first
    argument that is not an int >= 1 and its value. A bool is not a size (`Linear(True, 4)` is a
    bug, not `Linear(1, 4)`), nor is a float, however whole."""
    for field, value in sizes.items():
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{owner}: {field} must be an int >= 1, got {value!r}")


class QuantizedModule(nn.Module):
    """Base of dist-quant modules. Subclasses that own quantizers set `owns_quantizers = True`.

    `quant_binding` is the module's quantization binding (installed runtime, pinned recipe, forward
    plan, cached weights, role names): see `dist_quant.binding.QuantBinding`."""

    module_type: str = ""
    owns_quantizers: bool = False

    def __init__(self, name: str | None = None) -> None:
        super().__init__()
        if name is not None and not isinstance(name, str):
            raise ValueError(f"{type(self).__name__}(name=...) must be a str, got {name!r}")
        self.quant_binding = QuantBinding(name, module_key(self))
        _context.track_unplanned(self)

    def __setstate__(self, state: dict[str, Any]) -> None:
        # a copy or an unpickled module keeps its names but not its planned root: the next plan
        # (or call under autocast) records the root again; it enrols as itself
        super().__setstate__(state)
        self.quant_binding = self.quant_binding.copied(module_key(self))
        _context.track_unplanned(self)

    # ---- names and roles -------------------------------------------------------------------
    @property
    def role_name(self) -> str:
        """The hierarchical name used in roles: explicit `name=`, else the path in the model."""
        return self.quant_binding.role_name

    @property
    def is_planned(self) -> bool:
        """Whether this module's names and boundary roles are fixed (it was part of a planned
        model: `apply_recipe`, a call under autocast, `attach`, a checkpoint load)."""
        return self.quant_binding.planned

    def _wire_boundary_roles(self) -> None:
        """Called once, when the module is first planned and every module below it is named: a
        block sets the roles of the slots between its children here (see MultiheadAttention)."""

    def num_quantizers(self, *, fwd: bool) -> int:
        raise NotImplementedError(f"{type(self).__name__} owns no quantizers")

    def get_quantizer_roles(self, *, fwd: bool, num_quantizers: int) -> list[QuantizerRole | None]:
        raise NotImplementedError(f"{type(self).__name__} owns no quantizers")

    def _check_num_quantizers(self, fwd: bool, num_quantizers: int) -> None:
        expected = self.num_quantizers(fwd=fwd)
        if num_quantizers != expected:
            direction = "forward" if fwd else "backward"
            raise ValueError(
                f"{type(self).__name__} {self.role_name!r} has {expected} {direction} quantizer "
                f"slots, asked for {num_quantizers}"
            )

    @property
    def output_quantizer_role(self) -> QuantizerRole | None:
        """Role of the output slot: who consumes this module's output (e.g. `dpa/qkv`)."""
        return self.quant_binding.output_role

    @output_quantizer_role.setter
    def output_quantizer_role(self, role: QuantizerRole | None) -> None:
        if role is not None and not isinstance(role, QuantizerRole):
            raise ValueError(f"output_quantizer_role must be a QuantizerRole or None, got {role!r}")
        binding = self.quant_binding
        if role != binding.output_role:
            binding.output_role = role
            binding.roles_changed()

    @property
    def grad_input_quantizer_role(self) -> QuantizerRole | None:
        """Role of the grad-input slot: who consumes this module's input gradient."""
        return self.quant_binding.grad_input_role

    @grad_input_quantizer_role.setter
    def grad_input_quantizer_role(self, role: QuantizerRole | None) -> None:
        if role is not None and not isinstance(role, QuantizerRole):
            raise ValueError(
                f"grad_input_quantizer_role must be a QuantizerRole or None, got {role!r}"
            )
        binding = self.quant_binding
        if role != binding.grad_input_role:
            binding.grad_input_role = role
            binding.roles_changed()

    # ---- checkpoints: recipe and scaling state (format and rules in checkpoint/module_state.py) --
    def get_extra_state(self) -> dict[str, Any]:
        return module_extra_state(self)

    def set_extra_state(self, state: Any) -> None:
        """Validates everything first; raises ValueError / RecipeUpdateError leaving it unchanged."""
        load_module_extra_state(self, state)

    # ---- validation hook for runtime.validate_candidate -------------------------------------
    def validate_quantizers(
        self, quantizers: list, roles: tuple, *, fwd: bool, recipe: Recipe
    ) -> None:
        """Raise ValueError naming the role if a slot got a quantizer this module cannot use under
        `recipe` (plan time: nothing has been quantized yet)."""
        for q, role in zip(quantizers, roles):
            if not isinstance(q, Quantizer):
                raise TypeError(f"slot {role} got {type(q).__name__}, not a Quantizer")
        if not fwd:
            return
        gathered = self.quant_binding.fp8_gathered_weights
        if gathered and PassMode.of_recipe(recipe) != (PassMode.QUANTIZED, PassMode.QUANTIZED):
            raise ValueError(
                f"{type(recipe).__name__} overrides a pass (forward_override / backward_override),"
                f" but FSDP2 all-gathers {', '.join(map(repr, gathered.values()))} in FP8 "
                "(dist_quant.fsdp.enable_fp8_all_gather), whose bytes only a quantized forward "
                "and backward can use; drop the override or build the model without "
                "enable_fp8_all_gather"
            )
        for slot, weight in gathered.items():
            if not gatherable_in_fp8(quantizers[slot]):
                raise ValueError(
                    f"role {roles[slot]} got {quantizers[slot]!r} from {type(recipe).__name__}, "
                    f"but FSDP2 all-gathers the weight {weight!r} in FP8 "
                    "(dist_quant.fsdp.enable_fp8_all_gather), which needs per-tensor (delayed or "
                    "current) scaling of it: per-block scales or high precision cannot be cast "
                    "before the all-gather. Keep a per-tensor recipe, or build the model without "
                    "enable_fp8_all_gather"
                )

    def quantizer_device(self) -> torch.device:
        for p in self.parameters():
            return p.device
        return torch.device("cpu")

    def plan_forward(self, runtime: ModuleRuntime, reduction_group: Any) -> ForwardPlan:
        """What a forward under `runtime` needs (built at plan time, or by the first forward under
        a new amax reduction group): subclasses with GEMMs add their slot objects. The default
        enrols the runtime's delayed-scaling groups, if any, and runs no GEMM."""
        return ForwardPlan(runtime, reduction_group, (), delayed_anchor(runtime))

    # ---- the forward's binding ---------------------------------------------------------------
    def forward_plan(self) -> ForwardPlan | None:
        """This forward's plan, or None when autocast is off (exact high precision); enrols the
        plan's delayed-scaling groups in the autocast region. In an activation-checkpoint
        recompute: the forward's runtime (`dist_quant.recompute`), enrolling nothing."""
        binding = self.quant_binding
        if torch.compiler.is_compiling() or recompute.intercepts():
            return self._intercepted_plan()
        ctx = _context.current_context()
        if ctx is None or not ctx.enabled:
            binding.last_forward_runtime = None
            return None
        if binding.seen_revision != _context.recipe_revision():  # -1 while no runtime is installed
            self._resolve_runtime(ctx)
        plan = binding.forward_plan
        group = ctx.region.reduction_group
        if plan is None or plan.reduction_group is not group:
            plan = self._store_plan(binding.runtime, group)
        binding.last_forward_runtime = plan.runtime
        if plan.enrol_anchor is not None:
            enrol_forward_now(binding.enrol_key, plan.runtime, ctx)
        return plan

    def _store_plan(self, runtime: ModuleRuntime, reduction_group: Any) -> ForwardPlan:
        binding = self.quant_binding
        plan = binding.forward_plan = self.plan_forward(runtime, reduction_group)
        binding.last_reduction_group = reduction_group
        return plan

    def _intercepted_plan(self) -> ForwardPlan | None:
        """`forward_plan` while torch.compile traces, in a checkpoint frame, or during backward."""
        runtime = self.active_runtime()
        if runtime is None:
            return None
        binding = self.quant_binding
        if torch.compiler.is_compiling():
            # built in the graph's trace, not stored on the module (a traced forward must not
            # mutate it)
            plan = self.plan_forward(runtime, _context.current_context().region.reduction_group)
        else:
            group = recompute.reduction_group(self)  # the recorded one in a recompute
            plan = binding.forward_plan
            if plan is None or plan.runtime is not runtime or plan.reduction_group is not group:
                if runtime is binding.runtime:
                    plan = self._store_plan(runtime, group)
                else:
                    plan = self.plan_forward(runtime, group)
        if plan.enrol_anchor is not None and not recompute.replaying():
            # an op, so that a compiled forward enrols on every call, not once while tracing; not
            # in a recompute: the forward enrolled them
            enrol_forward(plan.enrol_anchor, binding.enrol_tag)
        return plan

    def active_runtime(self) -> ModuleRuntime | None:
        """The runtime for this forward, or None when autocast is off (exact high precision).
        In an activation-checkpoint recompute: the forward's (`dist_quant.recompute`)."""
        if torch.compiler.is_compiling():
            return self._current_runtime()  # a recompute of a compiled region is eager
        if recompute.intercepts():
            return recompute.runtime_for(self, self._current_runtime)
        runtime = self.quant_binding.last_forward_runtime = self._current_runtime()
        return runtime

    def _current_runtime(self) -> ModuleRuntime | None:
        ctx = _context.current_context()
        if ctx is None or not ctx.enabled:
            return None
        if torch.compiler.is_compiling():
            return self._traced_runtime(ctx)
        binding = self.quant_binding
        if binding.seen_revision == _context.recipe_revision() and binding.runtime is not None:
            return binding.runtime
        return self._resolve_runtime(ctx)

    def _traced_runtime(self, ctx: _context.AutocastContext) -> ModuleRuntime:
        """`active_runtime` while torch.compile traces: the revision counter is not read (a graph
        would be specialised on its value and recompiled at every bump); freshness is decided from
        values the graph's guards can hold (autocast's recipe key, the role revision), so a switch
        retraces. Planning allocates state and cannot be traced: a stale runtime is resolved
        eagerly, outside the graph (a graph break; under fullgraph=True, dynamo refuses it)."""
        binding = self.quant_binding
        rt = binding.runtime
        stale = (
            rt is None
            or binding.planned_roles != binding.role_revision
            or (binding.pinned_recipe is None and binding.resolved_for != ctx.recipe_key)
        )
        return _resolve_outside_graph(self) if stale else rt

    def _resolve_runtime(self, ctx: _context.AutocastContext) -> ModuleRuntime:
        binding = self.quant_binding
        if not binding.planned:
            # built or first called where no planned model reaches it: it is its own root
            assign_role_names(self)
        revision = _context.recipe_revision()
        pinned = binding.pinned_recipe
        if pinned is not None:
            recipe = pinned
            if (
                ctx.recipe is not None
                and ctx.recipe_key != recipe.key()
                and not binding.warned_override
            ):
                binding.warned_override = True
                warnings.warn(
                    f"module {self.role_name!r} runs the recipe pinned by apply_recipe / the "
                    "coordinator; autocast's recipe argument is ignored for it",
                    stacklevel=4,
                )
        else:
            recipe = ctx.recipe if ctx.recipe is not None else _context.default_recipe()
        key = recipe.key()
        try:
            if binding.runtime is not None and binding.runtime.recipe_key == key:
                candidates = [plan_module(self, recipe, key)]  # only this module's roles moved
            else:
                # A new recipe switches every unpinned module of the planned model at once, so
                # that a failure anywhere leaves the whole model on its old recipe (as
                # apply_recipe does).
                root = planned_root(self)
                modules = [self]
                if root is not None and pinned is None:
                    unpinned = [
                        m for m in dist_quant_modules(root) if m.quant_binding.pinned_recipe is None
                    ]
                    if any(m is self for m in unpinned):
                        modules = unpinned
                candidates = plan_modules(modules, recipe, key)
        except Exception:
            ctx.region.failed = True
            raise
        if any(not c.unchanged for c in candidates):
            publish_candidates(candidates, key)
            revision = _context.recipe_revision()
        binding.seen_revision = revision
        binding.resolved_for = ctx.recipe_key
        binding.planned_roles = binding.role_revision
        return binding.runtime

    # ---- cached quantized weights ------------------------------------------------------------
    def quantize_weight(
        self,
        slot: str,
        weight: torch.Tensor,
        quantizer: Quantizer,
        runtime: ModuleRuntime,
        is_first_microbatch: bool | None,
    ) -> Any:
        """Quantize `weight`, or reuse the cached copy across microbatches.

        `is_first_microbatch=None` always quantizes; True quantizes and caches; False reuses the cache
        when it was built under the same runtime key from the same weight version, else re-quantizes.
        """
        if (
            is_first_microbatch is None
            or isinstance(quantizer, IdentityQuantizer)
            or torch.compiler.is_compiling()  # a traced forward cannot keep Python-side copies
        ):
            return quantizer.quantize(weight)
        tag = (runtime.key, weight._version, weight.data_ptr())
        binding = self.quant_binding
        if is_first_microbatch is False:
            cached = binding.cached_weight(slot, tag)
            if cached is not None:
                return cached
        qw = quantizer.quantize(weight)
        binding.cache_weight(slot, tag, qw)
        return qw


def delayed_anchor(runtime: ModuleRuntime) -> torch.Tensor | None:
    """The tensor a forward enrols `runtime`'s delayed-scaling groups with (one of their scales),
    or None when it has none in either direction."""
    groups = runtime.delayed_groups(fwd=True) or runtime.delayed_groups(fwd=False)
    return groups[0].scale if groups else None


@torch.compiler.disable
def _resolve_outside_graph(module: QuantizedModule) -> ModuleRuntime:
    """A compiled forward found `module`'s runtime stale (a lazy `autocast(recipe=...)` switch or a
    role change): plan it eagerly. Under `torch.compile(..., fullgraph=True)` this graph break is
    refused; switch with `apply_recipe` (or the coordinator) instead, whose publish retraces."""
    return module.active_runtime()
