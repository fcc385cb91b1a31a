"""`quantize_forward(model)`: run a model's forward inside `dq.autocast` without touching the
training loop, for frameworks whose loop dist-quant does not own (torchtitan's Trainer, Hugging
Face's Trainer, Ray Train workers).

A forward pre-hook on the root module enters `dq.autocast` (the outermost region: delayed-scaling
amaxes are reduced over `amax_reduction_group` and the scales updated when it exits, as in a hand
written loop) and a forward hook registered with `always_call=True` exits it, also when the
forward raised (then the region's amaxes are discarded, as `autocast` does for a failed block).
When the model runs inside an autocast of the caller's, the hooks' region nests in it.

`recipe` is published with `apply_recipe` at the first forward, unless every dist-quant module
already has one (a checkpoint load, a coordinator switch): a framework builds its model on the
meta device and materialises it later, and a recipe published before `to_empty` would keep
scaling buffers that were never initialised.
"""

from __future__ import annotations

import sys
from typing import Any

from torch import nn

from dist_quant.context import autocast
from dist_quant.recipes import Recipe
from dist_quant.runtime import apply_recipe, dist_quant_modules


class QuantizedForward:
    """The hooks `quantize_forward` installs; `remove()` takes them off."""

    def __init__(self, model: nn.Module, recipe: Recipe | None, amax_reduction_group: Any) -> None:
        if recipe is not None and not isinstance(recipe, Recipe):
            raise ValueError(f"quantize_forward: recipe must be a Recipe or None, got {recipe!r}")
        self.recipe = recipe
        self.amax_reduction_group = amax_reduction_group
        self._open: list[Any] = []  # entered autocast contexts, innermost last
        self._handles = [
            model.register_forward_pre_hook(self._enter),
            model.register_forward_hook(self._exit, always_call=True),
        ]

    def _enter(self, model: nn.Module, args: Any) -> None:
        if self.recipe is not None:
            if any(m.quant_binding.runtime is None for m in dist_quant_modules(model)):
                apply_recipe(model, self.recipe)
            self.recipe = None  # once: later recipes come from switches and checkpoints
        ctx = autocast(amax_reduction_group=self.amax_reduction_group)
        ctx.__enter__()
        self._open.append(ctx)

    def _exit(self, model: nn.Module, args: Any, output: Any) -> None:
        if not self._open:  # the pre-hook raised before entering
            return
        ctx = self._open.pop()
        exc = sys.exc_info()  # torch calls always_call hooks inside its `except` on a failure
        try:
            ctx.__exit__(*exc)
        except BaseException as e:
            if e is not exc[1]:
                raise

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()


def quantize_forward(
    model: nn.Module, *, recipe: Recipe | None = None, amax_reduction_group: Any = None
) -> QuantizedForward:
    """Run `model`'s forward inside `dq.autocast(amax_reduction_group=...)`; `recipe` is published
    at the first forward where a dist-quant module has none. Returns the hooks (`.remove()`)."""
    if not isinstance(model, nn.Module):
        raise ValueError(f"quantize_forward: model must be an nn.Module, got {model!r}")
    return QuantizedForward(model, recipe, amax_reduction_group)
