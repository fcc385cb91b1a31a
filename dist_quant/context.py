"""`autocast`: the region in which dist-quant modules quantize their GEMM operands.

Regions nest; the innermost decides `enabled` and `recipe`, the outermost owns the forward amax
reduction (delayed scaling: every slot that ran in the region is reduced and updated once, at the
outermost exit). A recipe revision counter lets a module's forward decide with one integer comparison
whether its runtime is still current.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from dist_quant import binding
from dist_quant.amax import discard_step, reduce_and_update
from dist_quant.recipes import DelayedScaling, Float8CurrentScaling, Recipe

if TYPE_CHECKING:
    from dist_quant.state import DelayedGroup


@dataclass
class AmaxRegion:
    """Delayed-scaling groups that ran in one outermost autocast region, in first-run order."""

    reduction_group: Any
    fwd_groups: dict[int, DelayedGroup] = field(default_factory=dict)
    failed: bool = False
    planning_hook: RemovableHandle | None = None  # while unplanned modules exist (see below)

    def add(self, groups: list[DelayedGroup]) -> None:
        for g in groups:
            self.fwd_groups.setdefault(id(g), g)


@dataclass(frozen=True)
class AutocastContext:
    """One entered `autocast(...)`; `recipe_key` is computed once at entry."""

    enabled: bool
    recipe: Recipe | None
    recipe_key: Any
    region: AmaxRegion


class _Local(threading.local):
    def __init__(self) -> None:
        self.stack: list[AutocastContext] = []


_local = _Local()
_revision_lock = threading.Lock()
_recipe_revision = 0
_last_entered_key: Any = object()


def track_unplanned(module: nn.Module) -> None:
    """`module` (a dist-quant module just built or unpickled) has not been planned yet: while any
    such module lives, outermost autocast regions plan each module as it is called."""
    binding.add_unplanned(module)
    ctx = current_context()
    if ctx is not None and ctx.region.planning_hook is None:  # built inside a region
        ctx.region.planning_hook = _plan_modules_as_called(ctx.region)


def _plan_modules_as_called(region: AmaxRegion) -> RemovableHandle | None:
    """A global forward pre-hook, only while unplanned dist-quant modules exist and only for this
    region: every module called gets the chance to plan the unplanned modules of its subtree, so
    each top-level block called in the region names its own subtree (not only the first one).
    It removes itself as soon as nothing is left to plan, so a planned model pays nothing."""
    if not binding.any_unplanned():
        return None
    handle: RemovableHandle | None = None

    def hook(module: nn.Module, args: Any) -> None:
        if torch.compiler.is_compiling():
            # Dynamo traces global hooks into the graph, and planning mutates module-keyed
            # tables (a crash under fullgraph once any unplanned module lives elsewhere). A
            # compiled module is planned before tracing: torch calls global hooks on the
            # OptimizedModule itself eagerly, and that call plans its whole subtree.
            return
        ctx = current_context()
        if ctx is None or ctx.region is not region:
            return  # another thread's region, whose own hook plans its modules
        if binding.any_unplanned():
            binding.plan_called_module(module)
        if not binding.any_unplanned():
            handle.remove()
            region.planning_hook = None

    handle = nn.modules.module.register_module_forward_pre_hook(hook)
    return handle


def recipe_revision() -> int:
    """Bumped whenever the recipe a module would resolve to may have changed."""
    return _recipe_revision


def bump_recipe_revision() -> None:
    global _recipe_revision
    with _revision_lock:
        _recipe_revision += 1


def current_context() -> AutocastContext | None:
    return _local.stack[-1] if _local.stack else None


def in_autocast() -> bool:
    return bool(_local.stack)


def default_recipe() -> Recipe:
    """`DelayedScaling()` on Hopper (sm90), where its fused kernels pay off; `Float8CurrentScaling()`
    elsewhere, including CPU emulation, because it needs no history to be correct from step one."""
    if torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0):
        return DelayedScaling()
    return Float8CurrentScaling()


@contextmanager
def autocast(
    enabled: bool = True,
    recipe: Recipe | None = None,
    amax_reduction_group: Any = None,
) -> Iterator[None]:
    """Quantize dist-quant modules' GEMM operands inside this block.

    `recipe=None` keeps each module's published recipe (from `apply_recipe` or the coordinator), or
    the default recipe for modules that have none. `amax_reduction_group` is the process group over
    which delayed-scaling amaxes are all-reduced at the outermost exit: pass the tensor-parallel group
    (or TP x DP) so every rank sharing a tensor uses the same scale; None reduces nothing.
    """
    global _last_entered_key
    if not isinstance(enabled, bool):
        raise ValueError(f"autocast(enabled=...) must be a bool, got {enabled!r}")
    key = recipe.key() if recipe is not None else None
    if key != _last_entered_key:
        _last_entered_key = key
        bump_recipe_revision()
    outer = current_context()
    if outer is not None:
        region = outer.region
        if amax_reduction_group is not None and amax_reduction_group is not region.reduction_group:
            raise ValueError(
                "a nested autocast cannot change amax_reduction_group: the outermost region "
                "reduces every slot once"
            )
    else:
        region = AmaxRegion(reduction_group=amax_reduction_group)
    _local.stack.append(AutocastContext(enabled, recipe, key, region))
    if outer is None:
        region.planning_hook = _plan_modules_as_called(region)
    ok = False
    try:
        yield
        ok = True
    finally:
        _local.stack.pop()
        if outer is None and region.planning_hook is not None:
            region.planning_hook.remove()
        if outer is None:
            if ok and not region.failed:
                reduce_and_update(list(region.fwd_groups.values()), region.reduction_group)
            elif region.fwd_groups:
                # A failed step (e.g. a lazy recipe change that raised) leaves the recorded amaxes
                # unreduced: reducing a half-updated set of buffers would corrupt every rank's scales.
                discard_step(list(region.fwd_groups.values()))


@contextmanager
def reenter(ctx: AutocastContext | None) -> Iterator[None]:
    """Run the block inside the already-exited autocast context `ctx` again, as one of its nested
    regions (no reduction at exit; the original region did it): an activation-checkpoint recompute
    sees the forward's context, so a compiled block runs the graph it ran in the forward. `None`
    (the forward ran outside autocast) enters nothing."""
    if ctx is None:
        yield
        return
    _local.stack.append(ctx)
    try:
        yield
    finally:
        _local.stack.pop()
