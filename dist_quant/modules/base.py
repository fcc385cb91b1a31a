"""`QuantizedModule`: what every dist-quant module shares.

A module that owns quantizers declares its slots (`num_quantizers`, `get_quantizer_roles`), and asks
`active_runtime()` at the start of each forward. That call is the hot path: when neither the recipe
revision nor the module's role revision moved since the last forward, it is two integer comparisons.
Otherwise it resolves the recipe (pinned by `apply_recipe` / the coordinator, else autocast's, else
the default) and, if the runtime key changed, plans, validates and publishes this module alone.
"""

from __future__ import annotations

import warnings
import weakref
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from dist_quant import context as _context
from dist_quant import recompute
from dist_quant.modules.enrol import enrol_forward, module_key
from dist_quant.quantizers import IdentityQuantizer, Quantizer
from dist_quant.roles import QuantizerRole

if TYPE_CHECKING:
    from dist_quant.recipes import Recipe
    from dist_quant.runtime import ModuleRuntime


def check_sizes(owner: str, **sizes: object) -> None:
    """The one check of every module constructor's sizes: ValueError naming `owner`, the first
    argument that is not an int >= 1 and its value. A bool is not a size (`Linear(True, 4)` is a
    bug, not `Linear(1, 4)`), nor is a float, however whole."""
    for field, value in sizes.items():
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{owner}: {field} must be an int >= 1, got {value!r}")


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
        self._dq_planned = False
        self._dq_enrol_key = module_key(self)
        self._dq_resolved_for: Any = None  # autocast's recipe key at the last eager resolve
        self._dq_planned_roles = -1  # the role revision the runtime was planned with
        _context.track_unplanned(self)

    def __setstate__(self, state: dict[str, Any]) -> None:
        # a copy or an unpickled module keeps its names but not its planned root: the next plan
        # (or call under autocast) records the root again; it enrols as itself
        super().__setstate__(state)
        self._dq_enrol_key = module_key(self)
        _context.track_unplanned(self)

    # ---- names and roles -------------------------------------------------------------------
    @property
    def role_name(self) -> str:
        """The hierarchical name used in roles: explicit `name=`, else the path in the model."""
        if self._dq_explicit_name is not None:
            return self._dq_explicit_name
        return self._dq_path_name or ""

    @property
    def is_planned(self) -> bool:
        """Whether this module's names and boundary roles are fixed (it was part of a planned
        model: `apply_recipe`, a call under autocast, `attach`, a checkpoint load)."""
        return self._dq_planned

    def _set_path_name(self, name: str) -> None:
        # The first path wins: a module keeps the name its roles were first built with.
        if self._dq_explicit_name is None and self._dq_path_name is None:
            self._dq_path_name = name
            self._roles_changed()

    def _roles_changed(self) -> None:
        self._dq_role_revision += 1

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

    # ---- checkpoints: recipe and scaling state (format and rules in checkpoint/module_state.py) --
    def get_extra_state(self) -> dict[str, Any]:
        from dist_quant.checkpoint.module_state import module_extra_state

        return module_extra_state(self)

    def set_extra_state(self, state: Any) -> None:
        """Validates everything first; raises ValueError / RecipeUpdateError leaving it unchanged."""
        from dist_quant.checkpoint.module_state import load_module_extra_state

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
        self._dq_planned_roles = self._dq_role_revision  # planned just now, from these roles

    def active_runtime(self) -> ModuleRuntime | None:
        """The runtime for this forward, or None when autocast is off (exact high precision).
        In an activation-checkpoint recompute: the forward's (`dist_quant.recompute`)."""
        if torch.compiler.is_compiling():
            return self._current_runtime()  # a recompute of a compiled region is eager
        if recompute.intercepts():
            return recompute.runtime_for(self, self._current_runtime)
        runtime = self._dq_forward_runtime = self._current_runtime()
        return runtime

    def _current_runtime(self) -> ModuleRuntime | None:
        ctx = _context.current_context()
        if ctx is None or not ctx.enabled:
            return None
        if torch.compiler.is_compiling():
            return self._traced_runtime(ctx)
        seen = (_context.recipe_revision(), self._dq_role_revision)
        if seen == self._dq_seen and self._dq_runtime is not None:
            return self._dq_runtime
        return self._resolve_runtime(ctx, seen)

    def _traced_runtime(self, ctx: _context.AutocastContext) -> ModuleRuntime:
        """`active_runtime` while torch.compile traces: the revision counter is not read (a graph
        would be specialised on its value and recompiled at every bump); freshness is decided from
        values the graph's guards can hold (autocast's recipe key, the role revision), so a switch
        retraces. Planning allocates state and cannot be traced: a stale runtime is resolved
        eagerly, outside the graph (a graph break; under fullgraph=True, dynamo refuses it)."""
        rt = self._dq_runtime
        stale = (
            rt is None
            or self._dq_planned_roles != self._dq_role_revision
            or (self._dq_pinned_recipe is None and self._dq_resolved_for != ctx.recipe_key)
        )
        return _resolve_outside_graph(self) if stale else rt

    def _resolve_runtime(
        self, ctx: _context.AutocastContext, seen: tuple[int, int]
    ) -> ModuleRuntime:
        from dist_quant.runtime import (
            dist_quant_modules,
            plan_module,
            plan_modules,
            publish_candidates,
        )

        if not self._dq_planned:
            # built or first called where no planned model reaches it: it is its own root
            assign_role_names(self)

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
                # A new recipe switches every unpinned module of the planned model at once, so
                # that a failure anywhere leaves the whole model on its old recipe (as
                # apply_recipe does).
                root = planned_root(self)
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
        self._dq_resolved_for = ctx.recipe_key
        self._dq_planned_roles = seen[1]
        return self._dq_runtime

    def register_amax_groups(self, runtime: ModuleRuntime) -> None:
        """Enrol this forward's delayed-scaling groups in the autocast region's reduction (an op, so
        that a compiled forward enrols on every call, not once while tracing); not in a recompute:
        the forward enrolled them."""
        if recompute.replaying():
            return
        groups = runtime.delayed_groups(fwd=True) or runtime.delayed_groups(fwd=False)
        if groups:
            enrol_forward(groups[0].scale, self._dq_enrol_key)

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
        if (
            isinstance(quantizer, IdentityQuantizer)
            or is_first_microbatch is None
            or torch.compiler.is_compiling()  # a traced forward cannot keep Python-side copies
        ):
            return quantizer.quantize(weight)
        tag = (runtime.key, weight._version, weight.data_ptr())
        cached = self._dq_weight_cache.get(slot)
        if is_first_microbatch is False and cached is not None and cached[0] == tag:
            return cached[1]
        qw = quantizer.quantize(weight)
        self._dq_weight_cache[slot] = (tag, qw)
        return qw


@torch.compiler.disable
def _resolve_outside_graph(module: QuantizedModule) -> ModuleRuntime:
    """A compiled forward found `module`'s runtime stale (a lazy `autocast(recipe=...)` switch or a
    role change): plan it eagerly. Under `torch.compile(..., fullgraph=True)` this graph break is
    refused; switch with `apply_recipe` (or the coordinator) instead, whose publish retraces."""
    return module.active_runtime()


_planned_roots: weakref.WeakKeyDictionary[QuantizedModule, weakref.ref[nn.Module]] = (
    weakref.WeakKeyDictionary()
)
_walked: weakref.WeakKeyDictionary[nn.Module, int] = weakref.WeakKeyDictionary()


def planned_root(module: QuantizedModule) -> nn.Module | None:
    """The outermost model `module` was planned in (its unit of a lazy recipe switch), if alive."""
    ref = _planned_roots.get(module)
    return None if ref is None else ref()


def assign_role_names(model: nn.Module, names: Mapping[nn.Module, str] | None = None) -> None:
    """Plan `model`'s structure: every dist-quant module under it that has no name yet takes its
    path in `model` (under an explicitly named module the path restarts at that name:
    `name="mlp"` -> `mlp.fc1`), or the name `names` gives it (a checkpoint's); a module planned for
    the first time then wires its boundary roles. Names already set are kept: a module keeps the
    name its roles were first built with, and replanning from an inner module gives the same paths.

    A module reached at two paths (the same object used twice) keeps the first path in
    `named_modules` order, with a warning naming both. `model` becomes the planned root (the unit
    of a lazy recipe switch) of every module under it, unless it was planned inside a larger model.
    """
    names = names or {}
    # torch.compile's wrapper holds the model as `_orig_mod`: names are the model's own paths
    model = getattr(model, "_orig_mod", model)
    prefix_of: dict[str, str] = {}  # structural path -> the role-name prefix of its children
    first_path: dict[int, str] = {}
    warned: set[str] = set()  # paths of reported second uses, and everything below them
    reached: list[QuantizedModule] = []
    for path, module in model.named_modules(remove_duplicate=False):
        parent, _, leaf = path.rpartition(".")
        if not path:
            candidate = ""
        else:
            base = prefix_of[parent]
            candidate = f"{base}.{leaf}" if base else leaf
        if id(module) in first_path:
            if path and parent in warned:
                warned.add(path)
            elif isinstance(module, QuantizedModule):
                warned.add(path)
                warnings.warn(
                    f"{type(module).__name__} {module.role_name!r} is used at two places in "
                    f"the model ({first_path[id(module)]!r} and {path!r}): both uses share one "
                    f"module, its quantizer roles (named {module.role_name!r}, the first path) "
                    "and its scaling state",
                    stacklevel=3,
                )
        else:
            first_path[id(module)] = path
            if isinstance(module, QuantizedModule):
                module._set_path_name(names.get(module, candidate))
                reached.append(module)
        prefix_of[path] = module.role_name if isinstance(module, QuantizedModule) else candidate
    inside = set(first_path)
    for module in reached:
        if not module._dq_planned:
            module._dq_planned = True
            module._wire_boundary_roles()
        root = planned_root(module)
        if root is None or id(root) in inside:
            _planned_roots[module] = weakref.ref(model)
        _context.mark_planned(module)


def _plan_called_module(module: nn.Module) -> None:
    """Autocast's call planner: `module` was just called while unplanned modules exist; it plans
    the unplanned modules below it (itself included), as the root they are found under. Each
    module's subtree is searched once per generation of the unplanned set."""
    generation = _context.unplanned_generation()
    if _walked.get(module) == generation:
        return
    _walked[module] = generation
    if any(_context.is_unplanned(m) for m in module.modules()):
        assign_role_names(module)


_context.set_call_planner(_plan_called_module)


@contextmanager
def provisional_role_names(model: nn.Module) -> Iterator[None]:
    """Inside the block, `assign_role_names` may plan `model` (to stage a checkpoint load against
    the roles it will have); on exit every module's names, boundary roles, role revision and
    planned state are as they were before."""
    modules = [m for m in model.modules() if isinstance(m, QuantizedModule)]
    saved = [
        (
            m,
            m._dq_path_name,
            m._dq_output_role,
            m._dq_grad_input_role,
            m._dq_role_revision,
            m._dq_planned,
            _planned_roots.get(m),
            _context.is_unplanned(m),
        )
        for m in modules
    ]
    try:
        yield
    finally:
        for m, path, out_role, gin_role, revision, planned, root, unplanned in saved:
            m._dq_path_name, m._dq_output_role, m._dq_grad_input_role = path, out_role, gin_role
            m._dq_role_revision, m._dq_planned = revision, planned
            if root is None:
                _planned_roots.pop(m, None)
            else:
                _planned_roots[m] = root
            if unplanned:
                _context.track_unplanned(m)
