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


def assert_recipes_agree_bit_for_bit(
    a: torch.nn.Module,
    b: torch.nn.Module,
    x: torch.Tensor,
    dy: torch.Tensor,
    recipe_a: dq.Recipe,
    recipe_b: dq.Recipe,
    forward_args: tuple = (),
) -> None:
    """Three steps of two equal modules, `a` under `recipe_a` and `b` under `recipe_b`, give the
    same bits; the input grows each step, so delayed scaling's scales of steps 2 and 3 come from
    its history."""
    for step in range(3):
        ra = run(a, x * (step + 1), dy, recipe_a, forward_args=forward_args)
        rb = run(b, x * (step + 1), dy, recipe_b, forward_args=forward_args)
        for ta, tb in zip(ra, rb, strict=True):
            assert torch.equal(ta, tb)
