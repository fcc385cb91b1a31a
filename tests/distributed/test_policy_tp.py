"""A policy rule that makes the ranks of a TP group quantize one tensor differently is refused
cluster-wide, naming the rule, and nothing is published (issue 36): 2 gloo ranks, TP=2.

The rule's recipe is a factory answering by rank (current scaling on rank 0, high precision on
rank 1) under one stated key, so both ranks plan without error and agree on the recipe key; only
the plan digests can tell, and the abort must say which rule answered differently.
"""

import sys
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "coordinator"))  # switch_harness

from dist_quant.coordinator import attach, request_switch  # noqa: E402
from harness import run_ranks  # noqa: E402
from switch_harness import Background, read_endpoint_when_ready  # noqa: E402

import dist_quant as dq  # noqa: E402
from dist_quant import factories  # noqa: E402

pytestmark = pytest.mark.distributed

WIDTH, HIDDEN, TOKENS = 32, 64, 8
RULE = {
    "name": "by-rank",
    "modules": "fc2",
    "recipe": {"type": "CustomRecipe", "qfactory": f"{__name__}:per_rank"},
}
POLICY = {"type": "policy", "default": "current", "rules": [RULE]}


@dq.quantizer_factory(key="tests.policy_tp.per_rank.v1")
def per_rank(role):
    """Current scaling on rank 0, high precision elsewhere: a TP group that cannot agree."""
    if dist.get_rank() == 0:
        return factories.current_scaling(role)
    return factories.high_precision(role)


def worker(rank: int, world: int, cfg: dict) -> dict:
    tp_pg = dist.new_group([0, 1])
    torch.manual_seed(0)
    model = nn.Sequential(
        dq.Linear(WIDTH, HIDDEN, tp_group=tp_pg, parallel_mode="column", name="fc1"),
        dq.Linear(HIDDEN, WIDTH, tp_group=tp_pg, parallel_mode="row", name="fc2"),
    )
    dq.apply_recipe(model, dq.DelayedScaling(amax_history_len=4))
    participant = attach(model, tp_group=tp_pg, run_dir=cfg["run_dir"])
    done = Path(cfg["run_dir"]) / "done"
    step, deadline = 0, time.monotonic() + 60
    while not done.exists() and time.monotonic() < deadline:
        participant.step_boundary(step)
        with dq.autocast(amax_reduction_group=tp_pg):
            model(torch.randn(TOKENS, WIDTH)).sum().backward()
        step += 1
        time.sleep(0.02)
    participant.close()
    return {"recipe": type(dq.current_recipe(model)).__name__}


def test_a_rule_that_splits_a_tp_group_is_refused_naming_the_rule(tmp_path):
    cfg = {"run_dir": str(tmp_path / "run")}
    job = Background(run_ranks, worker, 2, cfg, timeout_s=120)
    read_endpoint_when_ready(Path(cfg["run_dir"]), timeout=90)
    try:
        result = request_switch(POLICY, run_dir=cfg["run_dir"], timeout_s=30)
    finally:
        (Path(cfg["run_dir"]) / "done").touch()
    ranks = job.result(timeout=120)

    assert not result.committed
    assert sorted(result.reasons) == [0, 1]  # a group of two has no majority: both named
    for rank in (0, 1):
        assert "TP group [0, 1]" in result.reasons[rank]
        assert result.reasons[rank].endswith("the rules answering differently: 'by-rank'")
    assert [r["recipe"] for r in ranks] == ["DelayedScaling", "DelayedScaling"]  # none published
