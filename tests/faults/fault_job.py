"""The rank side of the fault scenarios: a real dist-quant model, its twin, and recipe factories that
misbehave on one rank.

Every rank trains two identical models on the same batches: `model` is attached to the job's
coordinator; `twin` is not, and at every step boundary takes whatever recipe `model` runs with a
plain in-process `apply_recipe`. So the twin is what a switch must amount to: nothing (an aborted
switch) or exactly an `apply_recipe` at the commit step. Each step compares the two losses bit for
bit, and at the end every parameter, gradient and scaling buffer: a prepare that touched an active
buffer, a candidate published half-way or at another step shows up as a difference.

Ranks run no collective while training (only `attach`'s one all-gather): a killed rank must not
take the survivors down with it, so that what the survivors run after the fault can be checked.
The coordinator engineer's tests (tests/distributed/test_switch_store.py) cover switches between
ranks that meet in collectives every step.

Each rank writes its record to `<run_dir>/rank<r>.json` (readable when a peer was killed on
purpose and the harness reports that death instead of returning results).
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import torch
import torch.distributed as dist
from dist_quant.coordinator import SwitchError, attach
from torch import nn

import dist_quant as dq
from dist_quant import factories
from dist_quant.runtime import current_recipe, recipe_key_of

WIDTH, HIDDEN, TOKENS = 16, 32, 8
LR = 0.05


def build() -> nn.Module:
    torch.manual_seed(5)  # the same weights on every rank and for both twins
    return nn.Sequential(
        dq.Linear(WIDTH, HIDDEN, name="fc1"), nn.GELU(), dq.Linear(HIDDEN, WIDTH, name="fc2")
    )


def train_step(model: nn.Module, rank: int, step: int) -> torch.Tensor:
    """Forward, backward and a plain SGD update (not torch.optim: building the first optimizer
    in a fresh process imports torch._dynamo, seconds per rank)."""
    g = torch.Generator().manual_seed(1000 * step + rank)
    x, target = torch.randn(TOKENS, WIDTH, generator=g), torch.randn(TOKENS, WIDTH, generator=g)
    model.zero_grad(set_to_none=True)
    with dq.autocast():
        loss = (model(x) - target).square().mean()
    loss.backward()
    with torch.no_grad():
        for p in model.parameters():
            p -= LR * p.grad
    return loss.detach()


def state_tensors(model: nn.Module) -> list[torch.Tensor]:
    out = [t for p in model.parameters() for t in (p.detach(), p.grad) if t is not None]
    for m in model.modules():
        rt = getattr(getattr(m, "quant_binding", None), "runtime", None)
        if rt is not None:
            for state in (rt.fwd_state, rt.bwd_state):
                out += [t for _, t in sorted(state.persistent_buffers().items())]
    return out


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and torch.equal(
        a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8)
    )


def recipe_name(model: nn.Module) -> str:
    recipe = current_recipe(model)
    return "mixed" if recipe is None else type(recipe).__name__


def fault_worker(rank: int, world: int, cfg: dict) -> dict:
    """Train until `<cfg["stop_file"]>` holds a step number N, then until step > N and at least
    three steps after seeing it. cfg: run_dir, stop_file, faults, tp_group, grace_s, step_s."""
    run_dir = Path(cfg["run_dir"])
    model, twin = build(), build()
    start = dq.DelayedScaling(amax_history_len=4)
    dq.apply_recipe(model, start)
    dq.apply_recipe(twin, start)
    participant = attach(
        model,
        tp_group=cfg.get("tp_group"),
        transport="store",
        run_dir=run_dir,
        faults=tuple(cfg.get("faults", ())),
        decision_grace_s=cfg.get("grace_s", 0.5),
        **({"lease_s": cfg["lease_s"]} if "lease_s" in cfg else {}),
    )
    record = {"rank": rank, "recipes": [], "twin_equal": [], "kinds": [], "error": None}
    step, stop_after = 0, None
    try:
        while True:
            try:
                participant.step_boundary(step)
            except SwitchError as e:
                record["error"] = str(e)  # the rank must stop: the job restarts from a checkpoint
                break
            if recipe_key_of(twin) != recipe_key_of(model):
                dq.apply_recipe(twin, current_recipe(model))  # in-process, at the same boundary
            loss, twin_loss = train_step(model, rank, step), train_step(twin, rank, step)
            record["recipes"].append(recipe_name(model))
            record["twin_equal"].append(same_bits(loss, twin_loss))
            record["kinds"].append(type(model[0].quant_binding.runtime.fwd_quantizers[0]).__name__)
            if step == 0:
                (run_dir / f"ready{rank}").write_text(str(os.getpid()))  # tests may stop it
            stop = Path(cfg["stop_file"])
            if stop_after is None and stop.exists():
                stop_after = max(int(stop.read_text() or 0), step + 3)
            if stop_after is not None and step >= stop_after:
                break
            time.sleep(cfg.get("step_s", 0.01))
            step += 1
        record["state_equal"] = all(
            same_bits(a, b) for a, b in zip(state_tensors(model), state_tensors(twin), strict=True)
        )
        record["participant"] = participant.state
    finally:
        (run_dir / f"rank{rank}.json").write_text(json.dumps(record))
        participant.close()
    return record


# ---- factories named in requested recipes (imported by path in every rank) ----------------------

_slept: set[str] = set()


def _sleep_once_on_rank1(tag: str, seconds: float) -> None:
    """Plan slowly on rank 1: the first call of one plan sleeps (later slots answer at once)."""
    if dist.get_rank() == 1 and tag not in _slept:
        _slept.add(tag)
        time.sleep(seconds)


@dq.quantizer_factory(key="faults.plans_2s_on_rank1.v1")
def plans_2s_on_rank1(role):
    _sleep_once_on_rank1("2s", 2.0)
    return factories.current_scaling(role)


@dq.quantizer_factory(key="faults.plans_1s_on_rank1.v1")
def plans_1s_on_rank1(role):
    _sleep_once_on_rank1("1s", 1.0)
    return factories.current_scaling(role)


@dq.quantizer_factory(key="faults.dies_mid_plan_on_rank1.v1")
def dies_mid_plan_on_rank1(role):
    """Rank 1's process ends inside its factory, with fc1's candidate states already built."""
    if dist.get_rank() == 1 and role is not None and role.name == "fc2":
        os._exit(17)
    return factories.current_scaling(role)


@dq.quantizer_factory(key="faults.kind_by_rank.v1")
def kind_by_rank(role):
    """Current scaling on rank 0, MXFP8 on the others: one recipe key, two different plans."""
    if dist.get_rank() == 0:
        return factories.current_scaling(role)
    return factories.mxfp8(role)
