"""The training loop of the cluster-switch model tests, and the fresh run they compare it with.

`train_through_switch` trains through step boundaries while the coordinator may switch the model,
and keeps the weights and optimizer state from just before the first step on the target recipe;
`replay` starts a fresh build of the same shards on that recipe from them. From the switch step on,
the two runs must lose the same, bit for bit.
"""

from __future__ import annotations

import copy
import time
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

import dist_quant as dq

TrainStep = Callable[[nn.Module, torch.optim.Optimizer, int], tuple[float, str]]
Snapshot = tuple[int, list[torch.Tensor], dict[str, Any]]


def train_through_switch(
    model: nn.Module,
    opt: torch.optim.Optimizer,
    participant: Any,
    train_step: TrainStep,
    *,
    steps: int,
    step_s: float,
    switched: Callable[[nn.Module], bool],
) -> tuple[list[float], list[str], Snapshot | None]:
    """`(losses, kinds, snapshot)` of `steps` steps, each after `participant.step_boundary`;
    `snapshot` is `(step, weights, optimizer state)` of the first step `switched(model)` holds at,
    or None if it never did. Closes the participant."""
    losses, kinds, snapshot = [], [], None
    for step in range(steps):
        participant.step_boundary(step)
        if snapshot is None and switched(model):
            params = [p.detach().clone() for p in model.parameters()]
            snapshot = (step, params, copy.deepcopy(opt.state_dict()))
        loss, kind = train_step(model, opt, step)
        losses.append(loss)
        kinds.append(kind)
        time.sleep(step_s)
    participant.close()
    return losses, kinds, snapshot


def replay(
    snapshot: Snapshot,
    model: nn.Module,
    opt: torch.optim.Optimizer,
    recipe: dq.Recipe,
    train_step: TrainStep,
    stop: int,
) -> list[float]:
    """The losses of `model` (a fresh build of the switched model's shards, `opt` its optimizer)
    started on `recipe` at the snapshot's step from its weights and optimizer state, up to `stop`."""
    start, params, opt_state = snapshot
    with torch.no_grad():
        for p, saved in zip(model.parameters(), params, strict=True):
            p.copy_(saved)
    opt.load_state_dict(opt_state)
    dq.apply_recipe(model, recipe)
    return [train_step(model, opt, s)[0] for s in range(start, stop)]
