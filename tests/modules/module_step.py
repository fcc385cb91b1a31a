"""The step the module tests run: one forward and backward of a module under autocast."""

from __future__ import annotations

import torch

import dist_quant as dq


def run(
    mod: torch.nn.Module,
    x: torch.Tensor,
    dy: torch.Tensor,
    recipe: dq.Recipe | None = None,
    enabled: bool = True,
    forward_args: tuple = (),
) -> list[torch.Tensor]:
    """`[y, dx, *parameter grads]` of `mod(x, *forward_args)` with upstream gradient `dy`, under
    `autocast(enabled, recipe)`; `x` is copied, so its gradient is this step's alone."""
    x = x.detach().clone().requires_grad_(True)
    mod.zero_grad(set_to_none=True)
    with dq.autocast(enabled=enabled, recipe=recipe):
        y = mod(x, *forward_args)
    y.backward(dy)
    return [y.detach(), x.grad] + [p.grad for p in mod.parameters()]
