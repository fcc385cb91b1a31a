"""`QuantizedModule`: what every dist-quant module shares.

A module that owns quantizers declares its slots (`num_quantizers`, `get_quantizer_roles`), and asks
`active_runtime()` at the start of each forward. That call is the hot path: when neither the recipe
revision nor the module's role revision moved since the last forward, it is two integer comparisons.
Otherwise it resolves the recipe (pinned by `apply_recipe` / the coordinator, else autocast's, else
the default) and, if the runtime key changed, plans, validates and publishes this module alone.
"""

from __future__ import annotations

import warnings
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from dist_quant import context as _context
from dist_quant import recompute
from dist_quant.amax import name_groups
from dist_quant.quantizers import IdentityQuantizer, Quantizer
from dist_quant.roles import QuantizerRole

if TYPE_CHECKING:
    from dist_quant.recipes import Recipe
    from dist_quant.runtime import ModuleRuntime


def check_sizes(owner: str, **sizes: int) -> None:
    """ValueError naming `owner` and every size unless all are positive (constructor arguments)."""
    if any(v <= 0 for v in sizes.values()):
        names = " and ".join(sizes)
        got = ", ".join(str(v) for v in sizes.values())
        raise ValueError(f"{owner}: {names} must be positive, got {got}")


class QuantizedModule(nn.Module):
    """Base of dist-quant modules. Subclasses that own quantizers set `owns_quantizers = True`."""

    module_type: str = ""
    owns_quantizers: bool = False

    def __init__(self, name: str | None = None) -> None:
        super().__init__()
        if name is not None and not isinstance(name, str):
            raise ValueError(f"{type(self).__name__}(name=...) must be a str, got {name!r}")
        self._dq_explicit_name = name
        self._dq_path_name: str | None = None
        self._dq_output_role: QuantizerRole | None = None
        self._dq_grad_input_role: QuantizerRole | None = None
        self._dq_role_revision = 0
        self._dq_runtime: ModuleRuntime | None = None
        self._dq_forward_runtime: ModuleRuntime | None = None  # of the last forward, for recompute
        self._dq_seen = (-1, -1)
        self._dq_pinned_recipe: Recipe | None = None
        self._dq_warned_override = False
        self._dq_weight_cache: dict[str, tuple[tuple, Any]] = {}

    # ---- names and roles -------------------------------------------------------------------
    @property
    def role_name(self) -> str:
        """The hierarchical name used in roles: explicit `name=`, else the path in the model."""
        if self._dq_explicit_name is not None:
            return self._dq_explicit_name
        return self._dq_path_name or ""

    def _set_path_name(self, name: str) -> None:
        # The first path wins: a module keeps the name its roles were first built with.
        if self._dq_explicit_name is None and self._dq_path_name is None:
            self._dq_path_name = name
            self._roles_changed()

    def _roles_changed(self) -> None:
        self._dq_role_revision += 1

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
        return self._dq_output_role

    @output_quantizer_role.setter
    def output_quantizer_role(self, role: QuantizerRole | None) -> None:
        if role is not None and not isinstance(role, QuantizerRole):
            raise ValueError(f"output_quantizer_role must be a QuantizerRole or None, got {role!r}")
        if role != self._dq_output_role:
            self._dq_output_role = role
            self._roles_changed()

    @property
    def grad_input_quantizer_role(self) -> QuantizerRole | None:
        """Role of the grad-input slot: who consumes this module's input gradient."""
        return self._dq_grad_input_role

    @grad_input_quantizer_role.setter
    def grad_input_quantizer_role(self, role: QuantizerRole | None) -> None:
        if role is not None and not isinstance(role, QuantizerRole):
            raise ValueError(
                f"grad_input_quantizer_role must be a QuantizerRole or None, got {role!r}"
            )
        if role != self._dq_grad_input_role:
            self._dq_grad_input_role = role
            self._roles_changed()

    # ---- checkpoints: recipe and scaling state (format and rules in dist_quant/checkpoint.py) --
    def get_extra_state(self) -> dict[str, Any]:
        from dist_quant.checkpoint import module_extra_state

        return module_extra_state(self)

    def set_extra_state(self, state: Any) -> None:
        """Validates everything first; raises ValueError / RecipeUpdateError leaving it unchanged."""
        from dist_quant.checkpoint import load_module_extra_state

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

    def quantizer_device(self) -> torch.device:
        for p in self.parameters():
            return p.device
        return torch.device("cpu")

    # ---- runtime ----------------------------------------------------------------------------
    def _install_runtime(self, runtime: ModuleRuntime) -> None:
        self._dq_runtime = runtime
        # A cached FP8 weight is only valid under the runtime key it was quantized with.
        self._dq_weight_cache = {
            slot: entry
            for slot, entry in self._dq_weight_cache.items()
            if entry[0][0] == runtime.key
        }
        self._dq_seen = (-1, -1)

    def active_runtime(self) -> ModuleRuntime | None:
        """The runtime for this forward, or None when autocast is off (exact high precision).
        In an activation-checkpoint recompute: the forward's (`dist_quant.recompute`)."""
        if recompute.intercepts():
            return recompute.runtime_for(self, self._current_runtime)
        runtime = self._dq_forward_runtime = self._current_runtime()
        return runtime

    def _current_runtime(self) -> ModuleRuntime | None:
        ctx = _context.current_context()
        if ctx is None or not ctx.enabled:
            return None
        seen = (_context.recipe_revision(), self._dq_role_revision)
        if seen == self._dq_seen and self._dq_runtime is not None:
            return self._dq_runtime
        return self._resolve_runtime(ctx, seen)

    def _resolve_runtime(
        self, ctx: _context.AutocastContext, seen: tuple[int, int]
    ) -> ModuleRuntime:
        from dist_quant.runtime import (
            dist_quant_modules,
            plan_module,
            plan_modules,
            publish_candidates,
        )

        if self._dq_pinned_recipe is not None:
            recipe = self._dq_pinned_recipe
            if (
                ctx.recipe is not None
                and ctx.recipe_key != recipe.key()
                and not self._dq_warned_override
            ):
                self._dq_warned_override = True
                warnings.warn(
                    f"module {self.role_name!r} runs the recipe pinned by apply_recipe / the "
                    "coordinator; autocast's recipe argument is ignored for it",
                    stacklevel=3,
                )
        else:
            recipe = ctx.recipe if ctx.recipe is not None else _context.default_recipe()
        key = recipe.key()
        try:
            if self._dq_runtime is not None and self._dq_runtime.recipe_key == key:
                candidates = [plan_module(self, recipe, key)]  # only this module's roles moved
            else:
                # A new recipe switches every unpinned module of the model at once, so that a
                # failure anywhere leaves the whole model on its old recipe (same as apply_recipe).
                root = ctx.region.root
                modules = [self]
                if root is not None and self._dq_pinned_recipe is None:
                    unpinned = [m for m in dist_quant_modules(root) if m._dq_pinned_recipe is None]
                    if any(m is self for m in unpinned):
                        modules = unpinned
                candidates = plan_modules(modules, recipe, key)
        except Exception:
            ctx.region.failed = True
            raise
        if any(not c.unchanged for c in candidates):
            publish_candidates(candidates, key)
            seen = (_context.recipe_revision(), self._dq_role_revision)
        self._dq_seen = seen
        return self._dq_runtime

    def register_amax_groups(self, runtime: ModuleRuntime) -> None:
        """Enrol this forward's delayed-scaling groups in the autocast region's reduction (not in a
        recompute: the forward enrolled them)."""
        if recompute.replaying():
            return
        groups = runtime.delayed_groups(fwd=True)
        # the name orders the packed amax buffers and names this module if ranks disagree
        name_groups(groups, self.role_name)
        name_groups(runtime.delayed_groups(fwd=False), self.role_name)
        if groups:
            _context.current_context().region.add(groups)

    def _amax_reduction_group(self) -> Any:
        """The group this forward's quantizers reduce over (the recorded one in a recompute)."""
        return recompute.reduction_group(self)

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
        if isinstance(quantizer, IdentityQuantizer) or is_first_microbatch is None:
            return quantizer.quantize(weight)
        tag = (runtime.key, weight._version, weight.data_ptr())
        cached = self._dq_weight_cache.get(slot)
        if is_first_microbatch is False and cached is not None and cached[0] == tag:
            return cached[1]
        qw = quantizer.quantize(weight)
        self._dq_weight_cache[slot] = (tag, qw)
        return qw


def assign_role_names(model: nn.Module) -> None:
    """Give every unnamed dist-quant module its path in `model`; under an explicitly named module the
    path restarts at that name (`name="mlp"` -> `mlp.fc1`)."""

    def walk(module: nn.Module, prefix: str) -> None:
        for child_name, child in module.named_children():
            path = f"{prefix}.{child_name}" if prefix else child_name
            if isinstance(child, QuantizedModule):
                child._set_path_name(path)
                path = child.role_name
            walk(child, path)

    if isinstance(model, QuantizedModule):
        walk(model, model.role_name)
    else:
        walk(model, "")
