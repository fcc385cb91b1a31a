"""Compiled autograd (`torch._dynamo.compiled_autograd`) runs the backward as one compiled graph.
It drops the autograd engine's final callbacks queued while that graph runs, and delayed scaling
reduces its gradient amaxes and updates its backward scales in such a callback: under compiled
autograd the scales would silently stop following the gradients. Such a backward is refused,
naming the module, before the step changes any scaling state. Recipes without delayed state
enrol nothing and give eager's gradients bit for bit.
"""

from __future__ import annotations

import copy

import pytest
import torch
from model_state import scaling_buffers
from torch import nn
from torch._dynamo import compiled_autograd

import dist_quant as dq

pytestmark = pytest.mark.usefixtures("fresh_dynamo")


def _model(recipe: str) -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(dq.Linear(32, 64), nn.GELU(), dq.Linear(64, 32))
    dq.apply_recipe(model, dq.recipe_from_dict(recipe))
    return model


def _input(step: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(300 + step)
    return (torch.randn(16, 32, generator=g) * (1 + step)).requires_grad_()


def _backward(model: nn.Module, x: torch.Tensor, *, compiled: bool) -> torch.Tensor:
    with dq.autocast():
        y = model(x)
    loss = y.float().square().mean()
    if compiled:
        with compiled_autograd._enable(torch.compile(backend="aot_eager")):
            loss.backward()
    else:
        loss.backward()
    return y.detach()


@pytest.mark.parametrize("recipe", ["current", "bf16", "mxfp8", "block"])
def test_compiled_autograd_gives_eager_gradients_for_recipes_without_delayed_state(recipe) -> None:
    eager = _model(recipe)
    compiled = copy.deepcopy(eager)
    for step in range(3):
        x_e, x_c = _input(step), _input(step)
        assert torch.equal(
            _backward(eager, x_e, compiled=False), _backward(compiled, x_c, compiled=True)
        )
        assert torch.equal(x_e.grad, x_c.grad), f"step {step}: input gradients differ"
        for (name, p_e), p_c in zip(eager.named_parameters(), compiled.parameters(), strict=True):
            assert torch.equal(p_e.grad, p_c.grad), f"step {step}: {name}.grad differs"
            p_e.grad, p_c.grad = None, None


def test_a_delayed_scaling_backward_under_compiled_autograd_is_refused_leaving_the_scales() -> None:
    model = _model("delayed")
    _backward(model, _input(0), compiled=False)  # a step with history, so a change would show
    with dq.autocast():
        y = model(_input(1))
    before = {k: v.clone() for k, v in scaling_buffers(model).items()}
    with pytest.raises(
        RuntimeError, match=r"module '2': a delayed-scaling backward ran under compiled autograd"
    ):
        with compiled_autograd._enable(torch.compile(backend="aot_eager")):
            y.float().square().mean().backward()
    after = scaling_buffers(model)
    for name, value in before.items():
        assert torch.equal(after[name], value), f"{name} changed by the refused backward"


def test_a_compiled_delayed_model_under_compiled_autograd_fails_loudly() -> None:
    """The compiled backward updates the amax history of a buffer saved by the forward in place;
    torch 2.13's compiled autograd mis-counts such saved inputs and raises (IndexError in its
    backward prologue) before the enrolment op can refuse. Either error is loud, never a step
    with stale scales."""
    model = _model("delayed")
    model.compile(backend="aot_eager", fullgraph=True)
    with pytest.raises((RuntimeError, IndexError)):
        _backward(model, _input(0), compiled=True)


def test_after_a_refused_backward_the_next_eager_step_runs_as_if_only_the_forward_had_run() -> None:
    refused, forward_only = _model("delayed"), _model("delayed")
    with pytest.raises(RuntimeError, match="compiled autograd"):
        _backward(refused, _input(0), compiled=True)
    with dq.autocast():
        forward_only(_input(0))
    for step in (1, 2):
        _backward(refused, _input(step), compiled=False)
        _backward(forward_only, _input(step), compiled=False)
    buf_r, buf_f = scaling_buffers(refused), scaling_buffers(forward_only)
    assert buf_r.keys() == buf_f.keys()
    for name in buf_f:
        assert torch.equal(buf_r[name], buf_f[name]), f"{name} differs"
