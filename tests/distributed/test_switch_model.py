"""A real model switched cluster-wide: 4 ranks, TP=2 x DP=2, delayed -> current scaling at a
requested step, through the default planner (`dist_quant.runtime.plan_model`) and recipe loader
(`recipe_from_dict`).

What it catches: a rank publishing one step early or late (its quantizer classes per step would
differ from its peers', and a TP group would run one step with two recipes), and a switch that
leaves anything of the old recipe behind (a stale cached FP8 weight, a delayed scale still in
use). The second check is exact: from step S on, every rank's losses must equal, bit for bit, a
run that starts on current scaling at step S from the same weights and optimizer state. Exact,
because current scaling keeps no state across steps, so identical inputs give identical bits.
"""

import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "coordinator"))  # switch_harness

from dist_quant.coordinator import attach, request_switch  # noqa: E402
from harness import run_ranks  # noqa: E402
from switch_harness import Background, read_endpoint_when_ready  # noqa: E402
from switch_replay import replay, train_through_switch  # noqa: E402

import dist_quant as dq  # noqa: E402
from dist_quant.checkpoint import load_full_state_dict_into_shards  # noqa: E402

pytestmark = pytest.mark.distributed

WIDTH, HIDDEN, TOKENS = 32, 64, 16
STEPS, AT_STEP = 30, 15


def mlp(tp_pg=None) -> nn.Module:
    return nn.Sequential(
        dq.Linear(
            WIDTH, HIDDEN, tp_group=tp_pg, parallel_mode="column" if tp_pg else None, name="fc1"
        ),
        nn.GELU(),
        dq.Linear(
            HIDDEN, WIDTH, tp_group=tp_pg, parallel_mode="row" if tp_pg else None, name="fc2"
        ),
    )


def build(tp_pg) -> nn.Module:
    """The shards of one unsharded model, the same on every rank."""
    torch.manual_seed(100)
    full = mlp().state_dict()
    model = mlp(tp_pg)
    load_full_state_dict_into_shards(model, full, tp_pg)
    return model


def train_step(model, opt, step, dp_rank, tp_pg, dp_pg, dp_size) -> tuple[float, str]:
    g = torch.Generator().manual_seed(10_000 * step + dp_rank)
    x = torch.randn(TOKENS, WIDTH, generator=g)  # replicated within the TP group
    target = torch.randn(TOKENS, WIDTH, generator=g)
    # Delayed amaxes reduced over TP so both shards of one tensor use one scale.
    with dq.autocast(amax_reduction_group=tp_pg):
        y = model(x)
    loss = ((y - target) ** 2).mean()
    opt.zero_grad()
    loss.backward()
    for p in model.parameters():
        dist.all_reduce(p.grad, group=dp_pg)  # data-parallel gradient sum -> mean below
        p.grad /= dp_size
    opt.step()
    return loss.item(), type(model[0].quant_binding.runtime.fwd_quantizers[0]).__name__


def switch_worker(rank: int, world: int, cfg: dict) -> dict:
    tp_pgs = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    dp_pgs = [dist.new_group([0, 2]), dist.new_group([1, 3])]
    tp_rank, dp_rank = rank % 2, rank // 2
    tp_pg, dp_pg = tp_pgs[dp_rank], dp_pgs[tp_rank]
    args = (dp_rank, tp_pg, dp_pg, world // 2)

    model = build(tp_pg)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    dq.apply_recipe(model, dq.DelayedScaling(amax_history_len=4))
    participant = attach(model, tp_group=tp_pg, run_dir=cfg["run_dir"])

    def step_fn(m, o, step):
        return train_step(m, o, step, *args)

    def switched(m):
        return isinstance(dq.current_recipe(m), dq.Float8CurrentScaling)

    losses, kinds, snapshot = train_through_switch(
        model, opt, participant, step_fn, steps=STEPS, step_s=cfg["step_s"], switched=switched
    )
    if snapshot is None:
        raise AssertionError(f"rank {rank} never switched to current scaling")
    ref = build(tp_pg)
    ref_opt = torch.optim.Adam(ref.parameters(), lr=1e-3)
    ref_losses = replay(snapshot, ref, ref_opt, dq.Float8CurrentScaling(), step_fn, STEPS)
    return {"S": snapshot[0], "losses": losses, "kinds": kinds, "ref_losses": ref_losses}


def test_tp2_dp2_switch_delayed_to_current_at_requested_step_matches_fresh_run(tmp_path):
    cfg = {"run_dir": str(tmp_path / "run"), "step_s": 0.02}
    job = Background(run_ranks, switch_worker, 4, cfg, timeout_s=150)
    read_endpoint_when_ready(Path(cfg["run_dir"]), timeout=120)
    result = request_switch(
        dq.Float8CurrentScaling(), at_step=AT_STEP, run_dir=cfg["run_dir"], timeout_s=30
    )
    assert result.committed and result.step == AT_STEP, result
    ranks = job.result(timeout=160)

    expected_kinds = ["Float8Quantizer"] * AT_STEP + ["Float8CurrentScalingQuantizer"] * (
        STEPS - AT_STEP
    )
    for r, out in enumerate(ranks):
        assert out["S"] == AT_STEP, r
        assert out["kinds"] == expected_kinds, (r, out["kinds"])
        assert out["losses"][AT_STEP:] == out["ref_losses"], r
    # TP peers compute one loss; DP replicas see other data.
    assert ranks[0]["losses"] == ranks[1]["losses"] and ranks[2]["losses"] == ranks[3]["losses"]
    assert ranks[0]["losses"] != ranks[2]["losses"]
