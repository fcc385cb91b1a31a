"""Checkpoint and resume of a tensor-parallel job (TP=2, gloo on CPU) through
torch.distributed.checkpoint.

What these catch: DCP keeps one copy of every key, so a plain state dict of a TP model would keep
one rank's weight shard and one rank's scaling state and hand both to every rank on resume; a
resumed job that lost its recipe or the coordinator's history. Each job saves a DCP checkpoint at
step 8 while it trains on to step 15; fresh rank processes then resume from the checkpoint and must
reproduce steps 8..14 bit for bit (losses, weights, optimizer state, scaling buffers): the ranks run
the same deterministic arithmetic (gloo sums of two operands are order-independent), so there is
no tolerance. Weights are initialised per rank and delayed-scaling amaxes are not reduced across
ranks, so every rank's shards and scaling history differ and a collision cannot go unnoticed.
Optimizer state is saved per rank with torch.save, as docs/checkpoint.md describes.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from dist_quant.coordinator import job_state, restore_job_state
from harness import run_ranks
from model_state import assert_same_run
from torch import nn
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter

import dist_quant as dq
from dist_quant import checkpoint as ckpt

pytestmark = pytest.mark.distributed

WIDTH, HIDDEN, HIST = 16, 32, 4
REQUEST_AT, SWITCH_AT, CHECKPOINT_AT, STEPS = 3, 5, 8, 15
CURRENT = dq.Float8CurrentScaling(use_power_2_scales=True)  # not the CPU default
DELAYED = dq.DelayedScaling(amax_history_len=HIST)


def tp_mlp(rank: int, group) -> nn.Sequential:
    torch.manual_seed(rank)  # shards differ between ranks
    model = nn.Sequential(
        dq.Linear(WIDTH, HIDDEN, parallel_mode="column", tp_group=group),
        nn.Tanh(),
        dq.Linear(HIDDEN, WIDTH, parallel_mode="row", tp_group=group),
        # fc1 holds gate and up: a fused split (parts=2), each part sharded on its own
        dq.LayerNormMLP(WIDTH, HIDDEN, activation="swiglu", tp_group=group),
    )
    for p in model.parameters():
        if getattr(p, "tp_split", None) is None:  # replicated: one value on every rank
            dist.broadcast(p.data, src=0, group=group)
    return model


def batch(step: int) -> torch.Tensor:
    return torch.randn(8, WIDTH, generator=torch.Generator().manual_seed(1000 + step))


def scaling_buffers(model: nn.Module) -> dict[str, torch.Tensor]:
    out = {}
    for m in model.modules():
        if isinstance(m, (dq.Linear, dq.LayerNormMLP)) and m.quant_binding.runtime is not None:
            for d, st in (
                ("fwd", m.quant_binding.runtime.fwd_state),
                ("bwd", m.quant_binding.runtime.bwd_state),
            ):
                out.update(
                    {
                        f"{m.role_name}.{d}.{k}": v.clone()
                        for k, v in st.persistent_buffers().items()
                    }
                )
    return out


def tp_job(rank: int, world: int, cfg: dict) -> dict:
    """Train to STEPS under DELAYED (switching to CURRENT at SWITCH_AT through the coordinator when
    cfg["switch"]), saving at CHECKPOINT_AT; or resume from cfg["load"]."""
    from dist_quant.coordinator import attach, request_switch

    group = dist.group.WORLD
    model = tp_mlp(rank, group)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    out: dict = {"losses": {}}
    start = 0
    if cfg.get("load"):
        extra = {"step": -1}
        reader = FileSystemReader(cfg["load"])
        job = ckpt.dcp_load(model, storage_reader=reader, tp_group=group, extra=extra)
        opt.load_state_dict(torch.load(f"{cfg['load']}/optim.rank{rank}.pt", weights_only=True))
        start = extra["step"]
        out["recipe_after_load"] = repr(dq.current_recipe(model).key())
        out["buffers_after_load"] = scaling_buffers(model)
        if cfg["switch"]:
            out["last_commit"] = restore_job_state(job, run_dir=cfg["run_dir"], model=model)
    else:
        dq.apply_recipe(model, DELAYED)
    participant = None
    if cfg["switch"]:
        participant = attach(model, tp_group=group, run_dir=cfg["run_dir"], transport="store")
    try:
        for step in range(start, STEPS):
            if step == CHECKPOINT_AT and not cfg.get("load"):
                job = None
                if participant is not None:
                    job = job_state(participant, step=step, run_dir=cfg["run_dir"])
                writer = FileSystemWriter(cfg["save_to"])
                ckpt.dcp_save(
                    model, storage_writer=writer, tp_group=group, job=job, extra={"step": step}
                )
                torch.save(opt.state_dict(), f"{cfg['save_to']}/optim.rank{rank}.pt")
                out["buffers_at_save"] = scaling_buffers(model)
                out["params_at_save"] = {k: v.detach().clone() for k, v in model.named_parameters()}
            if participant is not None:
                # rank 0 asks while every rank is before step REQUEST_AT, for a step none has passed
                if rank == 0 and step == REQUEST_AT and not cfg.get("load"):
                    result = request_switch(CURRENT, at_step=SWITCH_AT, run_dir=cfg["run_dir"])
                    out["switch"] = (result.committed, result.step)
                participant.step_boundary(step)
            opt.zero_grad(set_to_none=True)
            with dq.autocast():  # no amax_reduction_group: each rank keeps its own history
                loss = model(batch(step)).square().mean()
            loss.backward()
            opt.step()
            out["losses"][step] = loss.detach()
    finally:
        if participant is not None:
            participant.close()
    out["params"] = {k: v.detach().clone() for k, v in model.named_parameters()}
    out["opt"] = copy.deepcopy(opt.state_dict()["state"])
    out["buffers"] = scaling_buffers(model)
    return out


def run_and_resume(tmp_path: Path, switch: bool) -> tuple[list, list]:
    cfg = {"switch": switch, "run_dir": str(tmp_path / "run_a"), "save_to": str(tmp_path / "dcp")}
    full = run_ranks(tp_job, 2, cfg, timeout_s=120)
    resume_cfg = {"switch": switch, "run_dir": str(tmp_path / "run_b"), "load": cfg["save_to"]}
    resumed = run_ranks(tp_job, 2, resume_cfg, timeout_s=120)
    return full, resumed


def assert_same_run_and_buffers(full: dict, resumed: dict) -> None:
    assert_same_run(full, resumed, range(CHECKPOINT_AT, STEPS))
    assert full["buffers"].keys() == resumed["buffers"].keys()
    for name, t in full["buffers"].items():
        assert torch.equal(resumed["buffers"][name], t), name


def assert_whole_tensors_in_unsharded_layout(checkpoint: Path, full: list) -> None:
    """A single process reads the TP checkpoint's weights whole: column shards concatenated, and a
    fused gate/up weight as [gate; up], each part gathered from both ranks (so it can reshard)."""
    shards = [r["params_at_save"] for r in full]
    want_column = torch.cat([shards[0]["0.weight"], shards[1]["0.weight"]])
    parts = [[s["3.fc1_weight"].chunk(2)[p] for s in shards] for p in range(2)]
    want_fused = torch.cat([torch.cat(ranks) for ranks in parts]).reshape(2, HIDDEN, WIDTH)
    got = {"0.weight": torch.empty(HIDDEN, WIDTH), "3.fc1_weight": torch.empty(2, HIDDEN, WIDTH)}
    with pytest.warns(UserWarning, match="single process"):
        dcp.load({"model": got}, checkpoint_id=checkpoint)
    assert torch.equal(got["0.weight"], want_column)
    assert torch.equal(got["3.fc1_weight"], want_fused)


def test_tp2_delayed_scaling_resumes_each_ranks_shards_and_history_bit_identically(tmp_path):
    full, resumed = run_and_resume(tmp_path, switch=False)
    saved = [r["buffers_at_save"] for r in full]
    # the ranks' histories differ, so one rank's copy loaded on both would fail below
    assert any(not torch.equal(saved[0][k], saved[1][k]) for k in saved[0])
    for rank in range(2):
        assert resumed[rank]["buffers_after_load"].keys() == saved[rank].keys()
        for name, t in saved[rank].items():
            assert torch.equal(resumed[rank]["buffers_after_load"][name], t), (rank, name)
        assert_same_run_and_buffers(full[rank], resumed[rank])
    assert_whole_tensors_in_unsharded_layout(tmp_path / "dcp", full)


def test_tp2_resume_after_coordinator_switch_is_bit_identical(tmp_path):
    full, resumed = run_and_resume(tmp_path, switch=True)
    assert full[0]["switch"] == (True, SWITCH_AT)
    for rank in range(2):
        assert resumed[rank]["recipe_after_load"] == repr(CURRENT.key())
        assert resumed[rank]["last_commit"]["step"] == SWITCH_AT
        assert_same_run_and_buffers(full[rank], resumed[rank])
    lines = (tmp_path / "run_b" / "decisions.jsonl").read_text().splitlines()
    assert [json.loads(x)["event"] for x in lines][:3] == ["attempt", "open", "decision"]
    # the checkpoint's records, the restored marker, then the resumed coordinator's attempt
    assert json.loads(lines[-2]) | {"time": 0} == {
        "event": "restored",
        "step": CHECKPOINT_AT,
        "last_commit": 1,
        "records": len(lines) - 2,
        "reapply": [],
        "superseded": [],
        "time": 0,
    }
    assert json.loads(lines[-1])["resumed"] is True
