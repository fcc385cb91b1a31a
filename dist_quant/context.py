"""`autocast`: the region in which dist-quant modules quantize their GEMM operands.

Regions nest; the innermost decides `enabled` and `recipe`, the outermost owns the forward amax
reduction (delayed scaling: every slot that ran in the region is reduced and updated once, at the
outermost exit). A recipe revision counter lets a module's forward decide with one integer comparison
whether its runtime is still current.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

if TYPE_CHECKING:
    from dist_quant.recipes import Recipe
    from dist_quant.state import DelayedGroup


@dataclass
class AmaxRegion:
    """Delayed-scaling groups that ran in one outermost autocast region, in first-run order."""

    reduction_group: Any
    fwd_groups: dict[int, DelayedGroup] = field(default_factory=dict)
    failed: bool = False
    root: nn.Module | None = None

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
_named_roots: weakref.WeakSet[nn.Module] = weakref.WeakSet()


def _name_modules_on_first_call(region: AmaxRegion) -> Any:
    """Unnamed modules take their path in the model the first time it runs under autocast: the
    first module called inside the outermost region is taken as the model's root."""
    handle = None

    def hook(module: nn.Module, args: Any) -> None:
        handle.remove()
        region.root = module
        if module not in _named_roots:
            from dist_quant.modules.base import assign_role_names

            assign_role_names(module)
            _named_roots.add(module)

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
    from dist_quant.recipes import DelayedScaling, Float8CurrentScaling

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
    naming = _name_modules_on_first_call(region) if outer is None else None
    ok = False
    try:
        yield
        ok = True
    finally:
        _local.stack.pop()
        if naming is not None:
            naming.remove()
        if outer is None:
            if ok and not region.failed:
                from dist_quant.amax import reduce_and_update

                reduce_and_update(list(region.fwd_groups.values()), region.reduction_group)
            elif region.fwd_groups:
                # A failed step (e.g. a lazy recipe change that raised) leaves the recorded amaxes
                # unreduced: reducing a half-updated set of buffers would corrupt every rank's scales.
                from dist_quant.amax import discard_step

                discard_step(list(region.fwd_groups.values()))
