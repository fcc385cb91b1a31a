"""Empty shards: a tensor-parallel step in which every rank of the TP group holds zero rows (the
last, empty micro-batch of a data loader), on 2 ranks with gloo.

Each rank runs a sharded `Linear` (column and row parallel, with and without sequence
parallelism) next to an unsharded reference with the same full weights, for three steps: rows,
no rows, rows. The empty step must run on every rank (no hang in the amax reduction, no
quantized all-gather of nothing failing), give empty outputs and zero weight gradients, and keep
the delayed-scaling state in step with the reference bit for bit: the amax reduction of an empty
shard contributes 0, which moves no scale. The delayed state is compared exactly (maxima are
exact); the last step's outputs to 1e-5 normwise, the reordering of fp32 sums across ranks that
tests/distributed/test_tp_linear.py justifies.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from harness import run_ranks
from reliability import check_state

import dist_quant as dq
from dist_quant.checkpoint import load_full_state_dict_into_shards

pytestmark = pytest.mark.distributed

BATCH, IN, OUT = 2, 32, 16
LAYOUTS = [("column", False), ("column", True), ("row", False), ("row", True)]


def delayed_state(m: dq.Linear) -> list[torch.Tensor]:
    rt = m.quant_binding.runtime
    return [
        rt.fwd_state.amax_history,
        rt.fwd_state.scale,
        rt.bwd_state.amax_history,
        rt.bwd_state.scale,
    ]


def local(mode: str, sp: bool, x: torch.Tensor, dy: torch.Tensor, rank: int, size: int):
    if mode == "column":
        return (x.chunk(size, 0)[rank] if sp else x), dy.chunk(size, -1)[rank]
    return x.chunk(size, -1)[rank], (dy.chunk(size, 0)[rank] if sp else dy)


def step(model, x, dy, group):
    x = x.clone().requires_grad_(True)
    model.zero_grad(set_to_none=True)
    with dq.autocast(amax_reduction_group=group):
        y = model(x)
    y.backward(dy)
    return y.detach(), model.weight.grad


def _empty_step_on_every_rank(rank: int, size: int, recipe_name: str) -> list[str]:
    group = dist.group.WORLD
    problems = []
    for mode, sp in LAYOUTS:
        torch.manual_seed(0)
        ref = dq.Linear(IN, OUT, name="lin")
        tp = dq.Linear(
            IN, OUT, name="lin", tp_group=group, parallel_mode=mode, sequence_parallel=sp
        )
        load_full_state_dict_into_shards(tp, ref.state_dict(), group)
        recipe = (
            dq.DelayedScaling(amax_history_len=2)
            if recipe_name == "delayed"
            else dq.Float8CurrentScaling()
        )
        for m in (ref, tp):
            dq.apply_recipe(m, recipe)
        where = f"{mode}{'+SP' if sp else ''} {recipe_name}"
        for i, seq in enumerate([4, 0, 4]):
            g = torch.Generator().manual_seed(i)
            x, dy = (
                torch.randn(seq, BATCH, IN, generator=g),
                torch.randn(seq, BATCH, OUT, generator=g),
            )
            y_ref, _ = step(ref, x, dy, None)
            x_loc, dy_loc = local(mode, sp, x, dy, rank, size)
            y_tp, dw_tp = step(tp, x_loc, dy_loc, group)
            if seq == 0 and (y_tp.numel() != 0 or dw_tp.any()):
                problems.append(
                    f"{where}: empty step gave output {tuple(y_tp.shape)} or a weight grad"
                )
            if recipe_name == "delayed" and not all(
                torch.equal(a, b) for a, b in zip(delayed_state(tp), delayed_state(ref))
            ):
                problems.append(f"{where} step {i}: delayed state differs from the unsharded one")
        full = [torch.empty_like(y_tp) for _ in range(size)] if mode == "column" else None
        if full is not None:
            dist.all_gather(full, y_tp.contiguous(), group=group)  # column shards -> full output
            y_tp = torch.cat(full, -1)
        elif sp:
            y_ref = y_ref.chunk(size, 0)[rank]
        err = (y_tp - y_ref).norm() / y_ref.norm()
        if not err <= 1e-5:
            problems.append(f"{where}: the step after the empty one is off by {err:.2e}")
    return problems


def _both_recipes(rank: int, size: int) -> list[str]:
    return [
        p for name in ("delayed", "current") for p in _empty_step_on_every_rank(rank, size, name)
    ]


def test_a_tp_step_with_zero_rows_on_every_rank_runs_and_keeps_the_scales():
    problems = run_ranks(_both_recipes, 2, timeout_s=60)
    check_state(problems == [[], []], f"{problems}")
