"""FP8 attention switched on and off cluster-wide mid-run: 2 ranks, TP=2, a grouped-query
`TransformerLayer` on current scaling, BF16 attention -> FP8 attention (`fp8_dpa`) at a requested
step, then back at a later one, through the default planner and recipe loader.

What it catches: a rank running attention in FP8 one step early or late (its TP peer would run that
step's attention in the other precision), and a switch that keeps anything of the previous
attention path. Exact: from each switch step on, every rank's losses equal, bit for bit, a fresh
run started on the new recipe at that step from the same weights and optimizer state (current
scaling keeps no state across steps; on the CPU FP8 attention is the float64 definition of its FP8
operands, deterministic). A run that kept BF16 attention over the FP8 stretch loses differently,
so the comparison can tell the two apart.
"""

import copy
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "coordinator"))  # switch_harness

from dist_quant.coordinator import attach, request_switch, status  # noqa: E402
from harness import run_ranks  # noqa: E402
from switch_harness import Background, read_endpoint_when_ready, wait_for  # noqa: E402

import dist_quant as dq  # noqa: E402
from dist_quant.checkpoint import load_full_state_dict_into_shards  # noqa: E402

pytestmark = pytest.mark.distributed

SEQ, BATCH, HEADS, KV_HEADS, HEAD_DIM, FFN = 8, 2, 8, 2, 4, 64
HIDDEN = HEADS * HEAD_DIM
STEPS, FP8_AT, BF16_AT = 55, 20, 40


def layer(group) -> dq.TransformerLayer:
    kw = {"tp_group": group} if group is not None else {}
    return dq.TransformerLayer(HIDDEN, FFN, HEADS, num_gqa_groups=KV_HEADS,
                               normalization="RMSNorm", activation="swiglu", name="layer", **kw)  # fmt: skip


def build(group) -> dq.TransformerLayer:
    """The TP shards of one unsharded layer, the same on both ranks."""
    torch.manual_seed(0)
    full = layer(None).state_dict()
    model = layer(group)
    load_full_state_dict_into_shards(model, full, group)
    return model


def train_step(model, opt, step: int) -> float:
    g = torch.Generator().manual_seed(step)  # replicated over the TP group
    x = torch.randn(SEQ, BATCH, HIDDEN, generator=g)
    target = torch.randn(SEQ, BATCH, HIDDEN, generator=g)
    with dq.autocast(amax_reduction_group=dist.group.WORLD):
        loss = ((model(x) - target) ** 2).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
    return loss.item()


def fp8_attention(model) -> bool:
    return model.self_attention.core_attention.quant_binding.runtime.recipe.fp8_dpa


def replay(snapshot, fp8_dpa: bool, stop: int) -> list[float]:
    start, params, opt_state = snapshot
    model = build(dist.group.WORLD)
    with torch.no_grad():
        for p, saved in zip(model.parameters(), params, strict=True):
            p.copy_(saved)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    opt.load_state_dict(opt_state)
    dq.apply_recipe(model, dq.Float8CurrentScaling(fp8_dpa=fp8_dpa))
    return [train_step(model, opt, s) for s in range(start, stop)]


def worker(rank: int, world: int, cfg: dict) -> dict:
    model = build(dist.group.WORLD)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    dq.apply_recipe(model, dq.Float8CurrentScaling())
    participant = attach(model, tp_group=dist.group.WORLD, run_dir=cfg["run_dir"])
    losses, flags, snapshots = [], [], {}
    for step in range(STEPS):
        participant.step_boundary(step)
        flag = fp8_attention(model)
        if flags and flag != flags[-1]:  # the first step on the new attention path
            params = [p.detach().clone() for p in model.parameters()]
            snapshots[flag] = (step, params, copy.deepcopy(opt.state_dict()))
        flags.append(flag)
        losses.append(train_step(model, opt, step))
        time.sleep(cfg["step_s"])
    participant.close()
    if set(snapshots) != {True, False}:
        raise AssertionError(f"rank {rank} attention path per step: {flags}")
    on, off = snapshots[True], snapshots[False]
    return {
        "flags": flags,
        "losses": losses,
        "fp8": replay(on, True, off[0]),
        "kept_bf16": replay(on, False, off[0]),
        "bf16_again": replay(off, False, STEPS),
    }


def test_fp8_attention_switched_on_then_off_mid_run_matches_fresh_runs_from_each_step(tmp_path):
    cfg = {"run_dir": str(tmp_path / "run"), "step_s": 0.05}
    job = Background(run_ranks, worker, 2, cfg, timeout_s=200)
    read_endpoint_when_ready(Path(cfg["run_dir"]), timeout=120)
    for recipe, at in ((dq.Float8CurrentScaling(fp8_dpa=True), FP8_AT),
                       (dq.Float8CurrentScaling(), BF16_AT)):  # fmt: skip
        result = request_switch(recipe, at_step=at, run_dir=cfg["run_dir"], timeout_s=30)
        assert result.committed and result.step == at, result
        wait_for(lambda: status(run_dir=cfg["run_dir"])["phase"] == "published", 60, "acks")
    ranks = job.result(timeout=220)
    expected = [False] * FP8_AT + [True] * (BF16_AT - FP8_AT) + [False] * (STEPS - BF16_AT)
    for r, out in enumerate(ranks):
        assert out["flags"] == expected, r
        assert out["losses"][FP8_AT:BF16_AT] == out["fp8"], r
        assert out["losses"][BF16_AT:] == out["bf16_again"], r
        assert out["kept_bf16"] != out["fp8"], r  # FP8 attention changed the losses
    assert ranks[0]["losses"] == ranks[1]["losses"]  # one TP group: one loss
