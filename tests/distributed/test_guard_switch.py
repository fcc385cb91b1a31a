"""The precision guard on real ranks (2 processes, gloo): telemetry -> guard -> cluster switch.

What it catches: a guard that switches the wrong layers, or whose switch lands on different steps
on different ranks (each rank records, per step, what each layer runs: the lists must be equal
across ranks, not merely similar); a guard that fires on a healthy run; an undo that comes early
or never; a guard that stops training when it cannot reach the coordinator.

The outlier: at step OUTLIER_STEP a forward pre-hook multiplies fc2's input by 1e4 (the gradient
passes unscaled). The loss is linear in the output, so no gradient grows with it and only fc2's
input slot saturates (under delayed scaling its scale comes from the previous step's amax).
"""

import json
import math
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from dist_quant.coordinator import attach, fail_at, switch_requests
from dist_quant.coordinator.guard import PrecisionGuard
from harness import run_ranks
from torch import nn

import dist_quant as dq

pytestmark = pytest.mark.distributed

WIDTH = 32
OUTLIER_STEP = 4


def _kind(recipe, layer: str) -> str:
    """What `layer`'s input slot runs under `recipe`, derived through public API only."""
    if isinstance(recipe, dq.CustomRecipe):
        answer = recipe.qfactory(dq.QuantizerRole("linear", "input", layer))
        return "delayed" if isinstance(answer, dq.DelayedScalingRequest) else type(answer).__name__
    return "delayed" if isinstance(recipe, dq.DelayedScaling) else type(recipe).__name__


def _outlier(h: torch.Tensor) -> tuple[torch.Tensor]:
    """`h * 1e4` forward, identity backward: only the activation is an outlier, not its gradient."""
    return (h + h.detach() * (1e4 - 1),)


def guard_worker(rank: int, world: int, cfg: dict) -> dict:
    if cfg.get("patient_s"):  # how long a client waits for a coordinator that never answers
        switch_requests.ACCEPT_TIMEOUT_S = switch_requests.RESULT_SLACK_S = cfg["patient_s"]
    torch.manual_seed(7)  # one model on every rank
    model = nn.Sequential(
        dq.Linear(WIDTH, WIDTH, name="fc1"), nn.GELU(), dq.Linear(WIDTH, WIDTH, name="fc2")
    )
    if cfg["outlier"]:
        model[2].register_forward_pre_hook(
            lambda m, args: _outlier(args[0]) if cfg["step"] == OUTLIER_STEP else None
        )
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    dq.apply_recipe(model, dq.DelayedScaling(amax_history_len=1))
    participant = attach(
        model,
        run_dir=cfg["run_dir"],
        stats_interval=1,
        guard=PrecisionGuard(
            saturation_intervals=1,
            undo_after_steps=cfg.get("undo"),
            switch_timeout_s=cfg.get("patient_s", 30.0),
        ),
        faults=cfg.get("faults", ()),
    )
    kinds, losses = [], []
    for step in range(cfg["steps"]):
        cfg["step"] = step
        participant.step_boundary(step)
        kinds.append(
            {n: _kind(dq.current_recipe(model[i]), n) for i, n in ((0, "fc1"), (2, "fc2"))}
        )
        g = torch.Generator().manual_seed(1000 * step + rank)
        x = torch.randn(16, WIDTH, generator=g)
        with dq.autocast():
            y = model(x)
        loss = (y * torch.randn(16, WIDTH, generator=g)).mean()
        opt.zero_grad()
        loss.backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1e9)
        for p in model.parameters():
            dist.all_reduce(p.grad)
        opt.step()
        participant.observe(step, loss=loss, grad_norm=grad_norm)
        losses.append(loss.item())
        time.sleep(cfg["step_s"])
    participant.close()
    return {"kinds": kinds, "losses": losses}


def _guard_records(run_dir: Path) -> list[dict]:
    lines = (run_dir / "decisions.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if r.get("event") == "guard"]


def _cfg(tmp_path, **kw):
    return {"run_dir": str(tmp_path / "run"), "steps": 16, "step_s": 0.05, "outlier": True, **kw}


def _first(kinds, layer, kind, after=0):
    return next(s for s, k in enumerate(kinds) if s >= after and k[layer] == kind)


def test_outlier_switches_exactly_that_layer_on_every_rank_at_one_step_then_undoes(tmp_path):
    cfg = _cfg(tmp_path, undo=3)
    ranks = run_ranks(guard_worker, 2, cfg, timeout_s=120)
    assert ranks[0]["kinds"] == ranks[1]["kinds"]  # every step, every layer, both ranks
    kinds = ranks[0]["kinds"]
    switched = _first(kinds, "fc2", "Float8CurrentScalingQuantizer")
    undone = _first(kinds, "fc2", "delayed", after=switched)
    assert OUTLIER_STEP < switched < undone < len(kinds)
    assert all(k["fc1"] == "delayed" for k in kinds)
    assert (
        all(math.isfinite(v) for r in ranks for v in r["losses"]) and len(ranks[0]["losses"]) == 16
    )

    records = _guard_records(Path(cfg["run_dir"]))
    assert [(r["trigger"], r["outcome"]) for r in records] == [
        ("saturation", "requested"),
        ("saturation", "committed"),
        ("stable", "requested"),
        ("stable", "committed"),
    ]
    fired = records[0]
    assert fired["step"] == OUTLIER_STEP and fired["layers"] == ["fc2"]
    assert set(fired["statistic"]["saturated_fraction"]) == {"fc2"}
    assert fired["statistic"]["saturated_fraction"]["fc2"] > 0.5
    assert records[1]["commit_step"] == switched and records[3]["commit_step"] == undone
    assert records[2]["step"] >= switched + 2  # three stable observed steps after the commit

    stats = [json.loads(line) for line in (Path(cfg["run_dir"]) / "fp8_stats.jsonl").open()]
    assert [s["step"] for s in stats] == list(range(16))
    at = {(s["module"], s["tensor_type"]): s for s in stats[OUTLIER_STEP]["slots"]}
    assert at[("fc2", "input")]["saturated_fraction"] == 1.0
    # delayed scaling with margin 0 clips the odd new maximum: far below the guard's threshold
    assert at[("fc1", "input")]["saturated_fraction"] < PrecisionGuard().saturation_threshold
    assert at[("fc2", "input")]["numel"] == 2 * 16 * WIDTH  # summed over both ranks


def test_stable_run_never_triggers(tmp_path):
    cfg = _cfg(tmp_path, outlier=False, steps=10, step_s=0.0)
    ranks = run_ranks(guard_worker, 2, cfg, timeout_s=120)
    assert all(k == {"fc1": "delayed", "fc2": "delayed"} for r in ranks for k in r["kinds"])
    assert not (Path(cfg["run_dir"]) / "decisions.jsonl").exists() or not _guard_records(
        Path(cfg["run_dir"])
    )


def test_guard_that_cannot_reach_the_coordinator_only_logs(tmp_path):
    # the coordinator thread dies once it accepted the guard's request: no result ever comes
    cfg = _cfg(tmp_path, steps=8, faults=(fail_at(phase="open", action="stop"),), patient_s=0.3)
    ranks = run_ranks(guard_worker, 2, cfg, timeout_s=120)
    assert all(k == {"fc1": "delayed", "fc2": "delayed"} for r in ranks for k in r["kinds"])
    assert len(ranks[0]["losses"]) == 8
    records = _guard_records(Path(cfg["run_dir"]))
    assert [(r["trigger"], r["outcome"]) for r in records] == [
        ("saturation", "requested"),
        ("saturation", "unreachable"),
    ]
    assert "SwitchRequestError" in records[1]["reason"]
