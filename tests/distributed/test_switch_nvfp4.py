"""An NVFP4 model switched cluster-wide by the coordinator: 2 tensor-parallel ranks, MXFP8 ->
NVFP4 at a requested step, then NVFP4 -> NVFP4 with a high-precision forward (Transformer Engine
#2569's last stretch) at a second one, through `attach` / `request_switch`.

What it catches: a rank publishing one step early or late (its quantizer kinds per step would
differ from its peer's, and the TP group would run a step with two recipes), and a switch that
leaves the old recipe behind. Exact: from the first switch on, every rank's losses equal, bit for
bit, a run started on NVFP4 at that step from the same weights and optimizer state (the NVFP4
state starts fresh at a switch, stochastic rounding offsets included, as in the fresh run).
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
from dist_quant.coordinator.errors import SwitchBusyError  # noqa: E402
from harness import run_ranks  # noqa: E402
from switch_harness import Background, read_endpoint_when_ready  # noqa: E402
from switch_replay import replay, train_through_switch  # noqa: E402

import dist_quant as dq  # noqa: E402
from dist_quant.checkpoint import load_full_state_dict_into_shards  # noqa: E402

pytestmark = pytest.mark.distributed

WIDTH, HIDDEN, TOKENS = 32, 64, 16
STEPS, FIRST, SECOND = 20, 8, 14
NVFP4 = dq.NVFP4BlockScaling(seed=1)
TAIL = dq.NVFP4BlockScaling(seed=1, forward_override="high_precision")


def build(tp_pg) -> nn.Module:
    def mlp(pg=None):
        return nn.Sequential(
            dq.Linear(WIDTH, HIDDEN, tp_group=pg, parallel_mode="column" if pg else None),
            nn.GELU(),
            dq.Linear(HIDDEN, WIDTH, tp_group=pg, parallel_mode="row" if pg else None),
        )

    torch.manual_seed(100)
    full = mlp().state_dict()
    model = mlp(tp_pg)
    load_full_state_dict_into_shards(model, full, tp_pg)
    return model


def train_step(model, opt, step) -> tuple[float, str]:
    g = torch.Generator().manual_seed(10_000 + step)
    x = torch.randn(TOKENS, WIDTH, generator=g)  # replicated over the TP group
    target = torch.randn(TOKENS, WIDTH, generator=g)
    with dq.autocast():
        y = model(x)
    loss = ((y - target) ** 2).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
    recipe = dq.current_recipe(model)
    return loss.item(), f"{type(recipe).__name__}/{recipe.forward_override}"


def worker(rank: int, world: int, cfg: dict) -> dict:
    tp_pg = dist.new_group([0, 1])
    model = build(tp_pg)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    dq.apply_recipe(model, dq.MXFP8BlockScaling())
    participant = attach(model, tp_group=tp_pg, run_dir=cfg["run_dir"])
    losses, kinds, snapshot = train_through_switch(
        model, opt, participant, train_step, steps=STEPS, step_s=cfg["step_s"],
        switched=lambda m: dq.current_recipe(m) == NVFP4,
    )  # fmt: skip
    if snapshot is None:
        raise AssertionError(f"rank {rank} never switched to NVFP4")
    ref = build(tp_pg)
    ref_opt = torch.optim.Adam(ref.parameters(), lr=1e-3)
    ref_losses = replay(snapshot, ref, ref_opt, NVFP4, train_step, SECOND)
    return {"start": snapshot[0], "losses": losses, "kinds": kinds, "ref_losses": ref_losses}


def test_tp2_switches_mxfp8_to_nvfp4_then_to_a_high_precision_forward_at_the_requested_steps(
    tmp_path,
):
    cfg = {"run_dir": str(tmp_path / "run"), "step_s": 0.05}
    job = Background(run_ranks, worker, 2, cfg, timeout_s=150)
    read_endpoint_when_ready(Path(cfg["run_dir"]), timeout=120)
    first = request_switch(NVFP4, at_step=FIRST, run_dir=cfg["run_dir"], timeout_s=30)
    assert first.committed and first.step == FIRST, first
    deadline = time.monotonic() + 60
    while True:  # one open switch at a time: the first closes once every rank published it
        try:
            second = request_switch(
                TAIL.to_dict(), at_step=SECOND, run_dir=cfg["run_dir"], timeout_s=30
            )
            break
        except SwitchBusyError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)
    assert second.committed and second.step == SECOND, second
    ranks = job.result(timeout=160)
    expected = (
        ["MXFP8BlockScaling/None"] * FIRST
        + ["NVFP4BlockScaling/None"] * (SECOND - FIRST)
        + ["NVFP4BlockScaling/high_precision"] * (STEPS - SECOND)
    )
    for r, out in enumerate(ranks):
        assert out["start"] == FIRST, r
        assert out["kinds"] == expected, (r, out["kinds"])
        assert out["losses"][FIRST:SECOND] == out["ref_losses"], r
    assert ranks[0]["losses"] == ranks[1]["losses"]  # one TP group computes one loss
