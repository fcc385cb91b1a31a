"""`quantize_forward`: a model's forward inside dq.autocast without touching the training loop,
compared with the same loop written with `with dq.autocast():` by hand."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import dist_quant as dq
from dist_quant import context
from dist_quant.integrations.hooks import quantize_forward


def make() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(dq.Linear(16, 32), nn.Tanh(), dq.Linear(32, 8))


def batch(step: int) -> torch.Tensor:
    return torch.randn(8, 16, generator=torch.Generator().manual_seed(step))


def run(model: nn.Module, steps: int, hooked: bool) -> list[torch.Tensor]:
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = []
    for step in range(steps):
        opt.zero_grad()
        if hooked:
            loss = model(batch(step)).square().mean()
        else:
            with dq.autocast():
                loss = model(batch(step)).square().mean()
        loss.backward()
        opt.step()
        losses.append(loss.detach())
    return losses


def test_hooked_forward_trains_as_the_hand_written_autocast_loop():
    by_hand = make()
    dq.apply_recipe(by_hand, dq.DelayedScaling(amax_history_len=4))
    hooked = make()
    quantize_forward(hooked, recipe=dq.DelayedScaling(amax_history_len=4))
    want, got = run(by_hand, 4, hooked=False), run(hooked, 4, hooked=True)
    assert [float(x) for x in got] == [float(x) for x in want]
    with dq.autocast(recipe=dq.HighPrecision()):
        assert float(make()(batch(0)).square().mean()) != float(want[0])  # FP8 did run


def test_a_failed_forward_closes_its_autocast_and_a_published_recipe_is_kept():
    model = make()
    dq.apply_recipe(model, dq.Float8CurrentScaling())
    hooks = quantize_forward(model, recipe=dq.DelayedScaling())
    with pytest.raises(ValueError):
        model(torch.randn(8, 15))  # wrong width: the first Linear raises
    assert not context.in_autocast()
    model(batch(0))
    assert isinstance(dq.current_recipe(model), dq.Float8CurrentScaling)  # not replaced
    hooks.remove()
    assert not model._forward_pre_hooks and not model._forward_hooks
