"""Delayed-scaling amax reduction across ranks (2 ranks, gloo on CPU).

What these catch: an amax that is not the max over the group (ranks quantizing one tensor with
different scales), more than one all-reduce per direction (a per-module reduction that grows with
depth), a reduction that hangs or mixes unrelated amaxes when ranks ran different modules, and
`reduce_amax=False` still talking to other ranks. Expected amaxes are re-derived in the test from the
inputs every rank can regenerate (seeded per rank), never read back from the code under test.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from harness import expect_error, run_ranks
from tp_check import CountMaxAllReduce

import dist_quant as dq
from dist_quant.amax import AmaxReductionMismatch

pytestmark = pytest.mark.distributed

WIDTH, TOKENS, HIST = 16, 8, 4
E4M3_MAX, E5M2_MAX = 448.0, 57344.0


def stack(depth: int) -> torch.nn.Sequential:
    torch.manual_seed(0)  # identical weights on every rank
    return torch.nn.Sequential(*[dq.Linear(WIDTH, WIDTH) for _ in range(depth)])


def data(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank `rank`'s input and output gradient at `step`; rank r's values are (1 + r) times larger
    so the max over ranks is never the local one on rank 0."""
    g = torch.Generator().manual_seed(1000 * step + rank)
    x = torch.randn(TOKENS, WIDTH, generator=g) * (1 + rank)
    dy = torch.randn(TOKENS, WIDTH, generator=g) * (1 + rank) * 1e-3
    return x, dy


def train_step(model, x, dy, recipe, group, counts: dict | None = None) -> None:
    with CountMaxAllReduce() as fwd:
        with dq.autocast(recipe=recipe, amax_reduction_group=group):
            y = model(x.requires_grad_(True))
    with CountMaxAllReduce() as bwd:
        y.backward(dy)
    if counts is not None:
        counts.setdefault("fwd", []).append(fwd.calls)
        counts.setdefault("bwd", []).append(bwd.calls)


def fwd_state(module):
    return module.quant_binding.runtime.fwd_state


def bwd_state(module):
    return module.quant_binding.runtime.bwd_state


def _reduction_and_count(rank: int, world: int) -> dict:
    group = dist.group.WORLD
    recipe = dq.DelayedScaling(amax_history_len=HIST)
    shallow, deep = stack(2), stack(12)
    counts: dict = {}
    deep_counts: dict = {}
    for step in range(3):
        x, dy = data(step, rank)
        train_step(shallow, x, dy, recipe, group, counts)
        train_step(deep, x, dy, recipe, group, deep_counts)
        # newest history entry (row -1 after the roll) of layer 0's input slot and of the last
        # layer's grad_output slot: the max over every rank's tensor, re-derived from the data
        xs = [data(step, r)[0] for r in range(world)]
        dys = [data(step, r)[1] for r in range(world)]
        want_x = max(float(t.abs().max()) for t in xs)
        want_dy = max(float(t.abs().max()) for t in dys)
        got_x = float(fwd_state(shallow[0]).amax_history[-1, 0])
        got_dy = float(bwd_state(shallow[1]).amax_history[-1, 0])
        assert got_x == torch.tensor(want_x, dtype=torch.float32).item(), (step, got_x, want_x)
        assert got_dy == torch.tensor(want_dy, dtype=torch.float32).item(), (step, got_dy, want_dy)
        # the scale follows from the reduced history: fp8_max / max(history), in fp32
        hist_max = fwd_state(shallow[0]).amax_history[:, 0].max()
        want_scale = torch.tensor(E4M3_MAX, dtype=torch.float32) / hist_max
        assert torch.equal(fwd_state(shallow[0]).scale[0], want_scale)
    # every rank ends with bit-identical scales and histories in every layer, both directions
    for model in (shallow, deep):
        for layer in model:
            for st in (fwd_state(layer), bwd_state(layer)):
                mine = torch.cat([st.scale, st.amax_history.reshape(-1)])
                everyone = [torch.empty_like(mine) for _ in range(world)]
                dist.all_gather(everyone, mine)
                assert all(torch.equal(mine, o) for o in everyone)
    return {"shallow": counts, "deep": deep_counts}


def test_amax_is_max_over_ranks_with_one_allreduce_per_direction_independent_of_depth():
    """Every step after the first issues exactly one all-reduce(MAX) per direction, for 2 layers
    and for 12 layers alike, although the job alternates the two models. On the first step the
    forward of each model grows the group's buffer (a second all-reduce); its backward has fewer
    slots than its forward and fits."""
    results = run_ranks(_reduction_and_count, 2)
    for counts in results:
        for model in ("shallow", "deep"):
            assert counts[model] == {"fwd": [2, 1, 1], "bwd": [1, 1, 1]}, counts


def _mismatch(rank: int, world: int) -> dict:
    group = dist.group.WORLD
    recipe = dq.DelayedScaling(amax_history_len=HIST)
    model = stack(2)
    torch.manual_seed(1)
    extra = dq.Linear(WIDTH, WIDTH, name="extra_head")
    out: dict = {}

    def step(s: int, extra_fwd_on: set, extra_bwd_on: set) -> None:
        x, dy = data(s, rank)
        with dq.autocast(recipe=recipe, amax_reduction_group=group):
            y = model(x.requires_grad_(True))
            if rank in extra_fwd_on:
                z = extra(y)
                y = y + (z if rank in extra_bwd_on else z.detach())
        y.backward(dy)

    everyone = set(range(world))
    step(0, everyone, everyone)
    step(1, everyone, everyone)
    before = {
        "scale": fwd_state(model[0]).scale.clone(),
        "history": fwd_state(model[0]).amax_history[1:].clone(),
    }
    # forward: the head runs on rank 0 only
    out["fwd"] = expect_error(lambda: step(2, {0}, {0}), AmaxReductionMismatch)
    st = fwd_state(model[0])
    out["state_kept"] = torch.equal(st.scale, before["scale"]) and torch.equal(
        st.amax_history[1:], before["history"]
    )
    out["row0_discarded"] = bool((st.amax_history[0] == 0).all())
    # backward: both ranks run the head forward, only rank 0 backpropagates through it
    out["bwd"] = expect_error(lambda: step(3, everyone, {0}), AmaxReductionMismatch)
    # the job can go on after the error: a consistent step reduces normally
    step(4, everyone, everyone)
    out["recovered"] = True
    return out


def test_module_run_on_some_ranks_raises_on_every_rank_naming_it():
    results = run_ranks(_mismatch, 2)
    for rank, out in enumerate(results):
        for direction in ("fwd", "bwd"):
            msg = out[direction]
            assert "'extra_head' ran on ranks [0] but not on ranks [1]" in msg, (rank, msg)
            assert f"on rank {rank} of 2" in msg
        assert "(forward)" in out["fwd"] and "(backward)" in out["bwd"]
        assert out["state_kept"] and out["row0_discarded"] and out["recovered"]


def _first_step_mismatch(rank: int, world: int) -> str:
    model = stack(1)
    torch.manual_seed(1)
    extra = dq.Linear(WIDTH, WIDTH, name="only_on_rank1")
    x, _ = data(0, rank)

    def step() -> None:
        with dq.autocast(recipe=dq.DelayedScaling(), amax_reduction_group=dist.group.WORLD):
            y = model(x)
            if rank == 1:
                extra(y)

    return expect_error(step, AmaxReductionMismatch)


def test_mismatch_on_the_very_first_step_is_caught_too():
    for msg in run_ranks(_first_step_mismatch, 2):
        assert "'only_on_rank1' ran on ranks [1] but not on ranks [0]" in msg


def _no_reduction(rank: int, world: int) -> dict:
    model = stack(2)
    x, dy = data(0, rank)
    counts: dict = {}
    train_step(
        model,
        x,
        dy,
        dq.DelayedScaling(amax_history_len=HIST, reduce_amax=False),
        dist.group.WORLD,
        counts,
    )
    return {"counts": counts, "amax": float(fwd_state(model[0]).amax_history[-1, 0])}


def test_reduce_amax_false_keeps_local_amax_and_issues_no_collective():
    results = run_ranks(_no_reduction, 2)
    for rank, out in enumerate(results):
        assert out["counts"] == {"fwd": [0], "bwd": [0]}
        local = float(data(0, rank)[0].abs().max())
        assert out["amax"] == torch.tensor(local, dtype=torch.float32).item()
