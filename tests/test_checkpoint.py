"""Checkpoint and resume of recipe and scaling state (single rank).

What these catch: a resumed job that runs another recipe than the one it stopped on (a fresh model
would otherwise take the default recipe), delayed-scaling history or scale that restarts instead of
continuing, a checkpoint taken under one recipe silently loaded into a model running another, and
a bad entry that leaves a model half loaded. Resumption is compared bit for bit with an
uninterrupted run of the same job; the resumed half runs in a fresh process.
"""

from __future__ import annotations

import copy
import hashlib
import io
import json
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from dist_quant.coordinator import job_state, restore_job_state
from torch import nn

import dist_quant as dq
from dist_quant import checkpoint as ckpt

sys.path.insert(0, str(Path(__file__).resolve().parent / "distributed"))  # the rank harness
from harness import run_ranks  # noqa: E402
from model_state import assert_same_run  # noqa: E402

WIDTH, HIST = 32, 4
SWITCH_AT, CHECKPOINT_AT, STEPS = 5, 8, 15
# Not the CPU default recipe (plain Float8CurrentScaling), so a resumed model that lost its
# recipe and fell back to the default would produce different losses.
CURRENT = dq.Float8CurrentScaling(use_power_2_scales=True)
DELAYED = dq.DelayedScaling(amax_history_len=HIST)


def mlp(seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(
        dq.Linear(WIDTH, WIDTH), nn.Tanh(), dq.Linear(WIDTH, WIDTH), nn.Tanh(), dq.Linear(WIDTH, 8)
    )


def batch(step: int) -> torch.Tensor:
    return torch.randn(16, WIDTH, generator=torch.Generator().manual_seed(1000 + step))


def train_step(model: nn.Module, opt: torch.optim.Optimizer, step: int) -> torch.Tensor:
    opt.zero_grad(set_to_none=True)
    with dq.autocast():
        loss = model(batch(step)).square().mean()
    loss.backward()
    opt.step()
    return loss.detach()


def dq_linears(model: nn.Module) -> list[dq.Linear]:
    return [m for m in model.modules() if isinstance(m, dq.Linear)]


def scaling_buffers(model: nn.Module) -> dict[str, torch.Tensor]:
    out = {}
    for m in dq_linears(model):
        rt = m.quant_binding.runtime
        for d, st in (("fwd", rt.fwd_state), ("bwd", rt.bwd_state)):
            out.update(
                {f"{m.role_name}.{d}.{k}": v.clone() for k, v in st.persistent_buffers().items()}
            )
    return out


# ---- the job ------------------------------------------------------------------------------------
def run_job(cfg: dict) -> dict:
    """Train steps [start, stop): from scratch under DELAYED (switching to CURRENT at SWITCH_AT via
    the coordinator when cfg["switch"]), or resumed from cfg["load"]; save at cfg["save_at"]."""
    from dist_quant.coordinator import attach, request_switch

    model = mlp()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    start, out = 0, {"losses": {}}
    if cfg.get("load"):
        got = ckpt.load(cfg["load"], model, opt)
        start = got["extra"]["step"]
        out["recipe_after_load"] = repr(dq.current_recipe(model).key())
        out["buffers_after_load"] = scaling_buffers(model)
        if cfg["switch"]:
            run_dir = cfg["run_dir"]
            out["last_commit"] = restore_job_state(got["job"], run_dir=run_dir, model=model)
    else:
        dq.apply_recipe(model, DELAYED)
    participant = (
        attach(model, run_dir=cfg["run_dir"], transport="store") if cfg["switch"] else None
    )
    try:
        for step in range(start, cfg["stop"]):
            if step == cfg.get("save_at"):
                job = None
                if participant is not None:
                    job = job_state(participant, step=step, run_dir=cfg["run_dir"])
                ckpt.save(cfg["save_to"], model, opt, job=job, extra={"step": step})
                out["buffers_at_save"] = scaling_buffers(model)
                break
            if participant is not None:
                if step == SWITCH_AT and not cfg.get("load"):
                    result = request_switch(CURRENT, at_step=SWITCH_AT, run_dir=cfg["run_dir"])
                    out["switch"] = (result.committed, result.step)
                participant.step_boundary(step)
            out["losses"][step] = train_step(model, opt, step)
            if step == CHECKPOINT_AT - 1:
                out["buffers_before_checkpoint_step"] = scaling_buffers(model)
    finally:
        if participant is not None:
            participant.close()
    out["params"] = {k: v.detach().clone() for k, v in model.named_parameters()}
    out["opt"] = copy.deepcopy(opt.state_dict()["state"])
    out["buffers"] = scaling_buffers(model) if dq.current_recipe(model) == DELAYED else {}
    return out


def resume_in_fresh_process(rank: int, world: int, cfg: dict) -> dict:
    return run_job(cfg)


@pytest.fixture
def single_rank_group(tmp_path):
    """A one-rank gloo group in this process, for the coordinator's `attach`."""
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'pg'}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def uninterrupted_and_resumed(tmp_path: Path, switch: bool) -> tuple[dict, dict, dict]:
    """The uninterrupted run and the first half run here; the second half in a fresh process."""
    path = str(tmp_path / "ckpt.pt")
    full_cfg = {"switch": switch, "run_dir": str(tmp_path / "run_full"), "stop": STEPS}
    full = run_job(full_cfg)
    run_a = str(tmp_path / "run_a")
    first = run_job({**full_cfg, "run_dir": run_a, "save_at": CHECKPOINT_AT, "save_to": path})
    resume_cfg = {**full_cfg, "run_dir": str(tmp_path / "run_b"), "load": path}
    (resumed,) = run_ranks(resume_in_fresh_process, 1, resume_cfg)
    return full, first, resumed


def test_resume_after_coordinator_switch_is_bit_identical_to_uninterrupted_run(
    tmp_path, single_rank_group
):
    full, first, resumed = uninterrupted_and_resumed(tmp_path, switch=True)
    assert full["switch"] == (True, SWITCH_AT) and first["switch"] == (True, SWITCH_AT)
    for step in range(CHECKPOINT_AT):
        assert torch.equal(full["losses"][step], first["losses"][step]), step
    assert resumed["recipe_after_load"] == repr(CURRENT.key())
    assert_same_run(full, resumed, range(CHECKPOINT_AT, STEPS))
    # the resumed job's coordinator log starts with the first job's history
    assert resumed["last_commit"]["step"] == SWITCH_AT
    assert resumed["last_commit"]["switch_id"] == 1
    log = (tmp_path / "run_b" / "decisions.jsonl").read_text().splitlines()
    first_log = (tmp_path / "run_a" / "decisions.jsonl").read_text().splitlines()
    # ... then says it was restored at the checkpoint's step, and the resumed attempt continues it
    restored, marker, attempt = log[:-2], json.loads(log[-2]), json.loads(log[-1])
    events = [json.loads(r)["event"] for r in restored]
    assert events[:3] == ["attempt", "open", "decision"]
    assert first_log[: len(restored)] == restored
    assert marker["event"] == "restored" and marker["step"] == CHECKPOINT_AT
    assert marker["reapply"] == [] and marker["superseded"] == []
    assert (attempt["event"], attempt["attempt"], attempt["resumed"]) == ("attempt", 2, True)
    assert attempt["job_id"] == json.loads(first_log[0])["job_id"]


def test_delayed_scaling_resume_continues_amax_history_and_scale_bit_identically(tmp_path):
    full, first, resumed = uninterrupted_and_resumed(tmp_path, switch=False)
    saved = first["buffers_at_save"]
    assert any(t.count_nonzero() for t in saved.values())  # real history, not the initial state
    for name, t in saved.items():
        assert torch.equal(resumed["buffers_after_load"][name], t), name
        assert torch.equal(full["buffers_before_checkpoint_step"][name], t), name
    assert_same_run(full, resumed, range(CHECKPOINT_AT, STEPS))
    assert full["buffers"].keys() == resumed["buffers"].keys() and full["buffers"]
    for name, t in full["buffers"].items():
        assert torch.equal(resumed["buffers"][name], t), name


# ---- format, validation, atomicity (in process) --------------------------------------------------
def trained(
    recipe=DELAYED, steps: int = 3, seed: int = 0
) -> tuple[nn.Module, torch.optim.Optimizer]:
    model = mlp(seed)
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    dq.apply_recipe(model, recipe)
    for step in range(steps):
        train_step(model, opt, step)
    return model, opt


def snapshot(model: nn.Module) -> list:
    """Identity and bytes of everything a refused load must leave alone."""
    out = [(name, p, p.detach().clone()) for name, p in model.named_parameters()]
    for m in dq_linears(model):
        rt = m.quant_binding.runtime
        bufs = []
        if rt is not None:
            for st in (rt.fwd_state, rt.bwd_state):
                bufs += [(t, t.clone()) for _, t in sorted(st.persistent_buffers().items())]
            out.append((rt, list(rt.fwd_quantizers), list(rt.bwd_quantizers)))
        out.append(
            (
                m,
                rt,
                m.quant_binding.pinned_recipe,
                m.quant_binding.path_name,
                m.quant_binding.role_revision,
                bufs,
            )
        )
    return out


def assert_unchanged(model: nn.Module, snap: list, params: bool = True) -> None:
    now = snapshot(model)
    assert len(now) == len(snap)
    for before, after in zip(snap, now):
        if isinstance(before[1], torch.nn.Parameter):
            assert after[1] is before[1], before[0]
            assert torch.equal(after[1], before[2]) or not params, before[0]
        elif isinstance(before[0], dq.Linear):
            m, rt, pin, path, rev, bufs = before
            assert (after[1], after[2]) == (rt, pin) and after[1] is rt and after[2] is pin
            assert (after[3], after[4]) == (path, rev), m
            for (t, saved), (t2, _) in zip(bufs, after[5]):
                assert t2 is t and torch.equal(t, saved)
        else:
            rt, fq, bq = before
            assert after[0] is rt
            assert all(a is b for a, b in zip(after[1] + after[2], fq + bq))


def test_extra_state_records_recipe_key_roles_and_copies_of_the_buffers():
    model, _ = trained()
    sd = model.state_dict()
    state, lin = sd["2._extra_state"], model[2]
    assert state["recipe"] == DELAYED.to_dict() and state["pinned"] is True
    assert state["recipe_key"] == hashlib.sha256(repr(DELAYED.key()).encode()).hexdigest()
    assert state["roles"] == {
        "forward": [["linear", "input", "2"], ["linear", "weight", "2"], None],
        "backward": [["linear", "grad_output", "2"], None],
    }
    live = {"forward.scale": lin.quant_binding.runtime.fwd_state.scale}
    live["forward.amax_history"] = lin.quant_binding.runtime.fwd_state.amax_history
    live["backward.scale"] = lin.quant_binding.runtime.bwd_state.scale
    live["backward.amax_history"] = lin.quant_binding.runtime.bwd_state.amax_history
    assert state["buffers"].keys() == live.keys()
    for name, t in live.items():
        assert torch.equal(state["buffers"][name], t)
        assert state["buffers"][name].data_ptr() != t.data_ptr()  # a copy, not the live buffer
    buf = io.BytesIO()
    torch.save(sd, buf)
    buf.seek(0)
    again = torch.load(buf, weights_only=True)  # plain data and tensors only
    assert again["2._extra_state"]["recipe"] == state["recipe"]


def test_fresh_model_takes_the_checkpoint_recipe_names_pin_and_buffers():
    model, _ = trained()
    sd = model.state_dict()
    fresh = mlp(seed=1)
    ckpt.load_state_dict(fresh, sd)
    for old, new in zip(dq_linears(model), dq_linears(fresh)):
        assert new.role_name == old.role_name
        assert new.quant_binding.runtime.key == old.quant_binding.runtime.key
        assert new.quant_binding.pinned_recipe == DELAYED
        fq = new.quant_binding.runtime.fwd_quantizers[0]
        assert (
            fq.scale.data_ptr() == new.quant_binding.runtime.fwd_state.scale.data_ptr()
        )  # views kept
    assert scaling_buffers(fresh).keys() == scaling_buffers(model).keys()
    for name, t in scaling_buffers(model).items():
        assert torch.equal(scaling_buffers(fresh)[name], t), name
    for p, q in zip(model.parameters(), fresh.parameters()):
        assert torch.equal(p, q)


def test_module_with_runtime_keeps_its_tensor_objects_and_receives_the_values():
    model, _ = trained()
    sd = model.state_dict()
    other, _ = trained(seed=1, steps=1)
    before = {
        m: (m.quant_binding.runtime, m.quant_binding.runtime.fwd_state.scale)
        for m in dq_linears(other)
    }
    other.load_state_dict(sd)  # torch's own loader, through set_extra_state
    for m, (rt, scale) in before.items():
        assert m.quant_binding.runtime is rt and m.quant_binding.runtime.fwd_state.scale is scale
    for name, t in scaling_buffers(model).items():
        assert torch.equal(scaling_buffers(other)[name], t), name


def test_checkpoint_under_another_recipe_is_refused_and_the_one_liner_fixes_it():
    model, _ = trained()
    sd = model.state_dict()
    other, _ = trained(CURRENT, seed=1)
    snap = snapshot(other)
    with pytest.raises(dq.RecipeUpdateError) as err:
        ckpt.load_state_dict(other, sd)
    assert "'0._extra_state'" in str(err.value) and "DelayedScaling" in str(err.value)
    assert ckpt.ONE_LINER in str(err.value)
    assert_unchanged(other, snap)
    with pytest.raises(dq.RecipeUpdateError, match="Float8CurrentScaling"):
        other.load_state_dict(sd)  # torch's loader: the module's own set_extra_state refuses
    # torch copies a module's parameters before calling its set_extra_state; its recipe state
    # (runtime, quantizers, buffers, pin, names) stays as it was
    assert_unchanged(other, snap, params=False)
    dq.apply_recipe(other, ckpt.recipe_of(sd))  # the documented one-liner
    ckpt.load_state_dict(other, sd)
    for name, t in scaling_buffers(model).items():
        assert torch.equal(scaling_buffers(other)[name], t), name


def corrupt(sd: dict, how: str) -> dict:
    sd = dict(sd)
    state = dict(sd["4._extra_state"])  # the last module: earlier ones load first in torch
    bufs = dict(state["buffers"])
    if how == "old format":
        state["format"] = "dist_quant.extra_state/0"
    elif how == "not a dict":
        state = b"\x00te-extra-state"
    elif how == "missing field":
        del state["roles"]
    elif how == "buffer shape":
        bufs["forward.amax_history"] = bufs["forward.amax_history"][:-1]
    elif how == "buffer dtype":
        bufs["backward.scale"] = bufs["backward.scale"].double()
    elif how == "buffer missing":
        del bufs["backward.scale"]
    elif how == "key tampered":
        state["recipe_key"] = "0" * 64
    elif how == "weight shape":
        sd["4.weight"] = sd["4.weight"][:, :-1]
    if isinstance(state, dict):
        state["buffers"] = bufs
    sd["4._extra_state"] = state
    return sd


CORRUPTIONS = [
    ("old format", ValueError, "'4._extra_state'.*format 'dist_quant.extra_state/0'"),
    ("not a dict", ValueError, "'4._extra_state'.*bytes.*old-format or foreign"),
    ("missing field", ValueError, "'4._extra_state'.*missing \\['roles'\\]"),
    (
        "buffer shape",
        ValueError,
        "'4._extra_state'.*'forward.amax_history' is torch.float32 \\(3, 3\\)",
    ),
    ("buffer dtype", ValueError, "'4._extra_state'.*'backward.scale' is torch.float64"),
    ("buffer missing", ValueError, "'4._extra_state'.*scaling buffers"),
    ("key tampered", dq.RecipeUpdateError, "'4._extra_state'.*rebuilt from the checkpoint"),
    ("weight shape", ValueError, "'4.weight' is \\(8, 31\\)"),
]


@pytest.mark.parametrize("how,exc,match", CORRUPTIONS, ids=[c[0] for c in CORRUPTIONS])
def test_corrupted_or_old_format_checkpoint_names_the_module_and_loads_nothing(how, exc, match):
    sd = corrupt(trained()[0].state_dict(), how)
    fresh, ran = mlp(seed=1), trained(seed=2, steps=1)[0]
    for target in (fresh, ran):
        snap = snapshot(target)
        if how == "key tampered" and target is ran:  # its own runtime's key is compared instead
            exc, match = dq.RecipeUpdateError, "'4._extra_state'.*taken under"
        with pytest.raises(exc, match=match):
            ckpt.load_state_dict(target, sd)
        assert_unchanged(target, snap)


def test_unserialisable_recipe_needs_the_same_recipe_object_applied_first():
    scale = 2.0
    factory = lambda role: dq.Float8CurrentScalingQuantizer(torch.float8_e4m3fn) if scale else None  # noqa: E731
    recipe = dq.CustomRecipe(factory, qfactory_key="closure.v1")
    model, _ = trained(recipe)
    sd = model.state_dict()
    state = sd["0._extra_state"]
    assert state["recipe"] is None and "cannot be serialised" in state["recipe_note"]
    fresh = mlp(seed=1)
    snap = snapshot(fresh)
    with pytest.raises(dq.RecipeUpdateError, match="not serialisable.*apply that same recipe"):
        ckpt.load_state_dict(fresh, sd)
    assert_unchanged(fresh, snap)
    with pytest.raises(dq.RecipeUpdateError, match="not serialisable"):
        ckpt.recipe_of(sd)
    dq.apply_recipe(fresh, recipe)
    ckpt.load_state_dict(fresh, sd)
    assert fresh[0].quant_binding.runtime.recipe is recipe


def test_module_without_recipe_in_the_checkpoint_drops_its_runtime():
    sd = mlp().state_dict()  # never ran: no recipe anywhere
    assert sd["0._extra_state"]["recipe"] is None
    model, _ = trained()
    ckpt.load_state_dict(model, sd)
    assert all(
        m.quant_binding.runtime is None and m.quant_binding.pinned_recipe is None
        for m in dq_linears(model)
    )
    with pytest.raises(ValueError, match="no dist-quant module in this state dict ran a recipe"):
        ckpt.recipe_of(sd)


def test_recipe_of_refuses_a_model_that_ran_two_recipes():
    model, _ = trained()
    dq.apply_recipe(model[4:], CURRENT)  # the last layer alone
    with pytest.raises(ValueError, match="2 different recipes"):
        ckpt.recipe_of(model.state_dict())


def test_strict_load_reports_missing_and_unexpected_keys_before_loading():
    model, _ = trained()
    sd = model.state_dict()
    sd["extra.weight"] = sd.pop("2.bias")
    target = mlp(seed=1)
    snap = snapshot(target)
    with pytest.raises(
        ValueError, match=r"missing keys \['2.bias'\], unexpected keys \['extra.weight'\]"
    ):
        ckpt.load_state_dict(target, sd)
    assert_unchanged(target, snap)
    result = ckpt.load_state_dict(target, sd, strict=False)
    assert result.missing_keys == ["2.bias"] and result.unexpected_keys == ["extra.weight"]


def test_save_load_round_trip_restores_optimizer_and_returns_job_and_extra(tmp_path):
    model, opt = trained()
    ckpt.save(tmp_path / "c.pt", model, opt, extra={"step": 3})
    fresh = mlp(seed=1)
    fresh_opt = torch.optim.SGD(fresh.parameters(), lr=5.0)
    got = ckpt.load(tmp_path / "c.pt", fresh, fresh_opt)
    assert got == {"job": None, "extra": {"step": 3}}
    assert fresh_opt.param_groups[0]["lr"] == 1e-2
    assert ckpt.recipe_of(torch.load(tmp_path / "c.pt", weights_only=True)) == DELAYED
    torch.save({"model": model.state_dict()}, tmp_path / "plain.pt")
    with pytest.raises(ValueError, match="not a 'dist_quant.checkpoint/1' checkpoint"):
        ckpt.load(tmp_path / "plain.pt", fresh)


def test_dcp_load_into_a_model_on_another_recipe_is_refused_before_any_weight_changes(tmp_path):
    model, _ = trained()
    with pytest.warns(UserWarning, match="single process"):  # DCP without a process group
        ckpt.dcp_save(model, tmp_path / "dcp", extra={"step": 3})
    other, _ = trained(CURRENT, seed=1)
    snap = snapshot(other)
    extra = {"step": -1}
    with pytest.warns(UserWarning), pytest.raises(dq.RecipeUpdateError, match="'0._extra_state'"):
        ckpt.dcp_load(other, tmp_path / "dcp", extra=extra)
    assert_unchanged(other, snap)  # DCP loaded into copies; the refusal came before any copy
    fresh = mlp(seed=2)
    with pytest.warns(UserWarning):
        assert ckpt.dcp_load(fresh, tmp_path / "dcp", extra=extra) is None
    assert extra == {"step": 3}
    for name, t in scaling_buffers(model).items():
        assert torch.equal(scaling_buffers(fresh)[name], t), name
    for p, q in zip(model.parameters(), fresh.parameters()):
        assert torch.equal(p, q)


# ---- the coordinator's part of the checkpoint ----------------------------------------------------
class FakeParticipant:
    """What job_state reads of a participant: its rank and its public state."""

    def __init__(self, state: str = "idle") -> None:
        self.rank, self.state = 0, state


def write_log(run_dir: Path, records: list[dict]) -> None:
    run_dir.mkdir(parents=True, exist_ok=True)
    lines = [json.dumps(r, sort_keys=True) + "\n" for r in records]
    (run_dir / "decisions.jsonl").write_text("".join(lines))


SWITCH_1 = [
    {"event": "open", "switch_id": 1, "recipe": "current", "time": 1.0},
    {"event": "decision", "switch_id": 1, "commit": True, "step": 5, "time": 2.0},
    {"event": "open", "switch_id": 2, "recipe": "mxfp8", "time": 3.0},
    {"event": "decision", "switch_id": 2, "commit": False, "step": None, "time": 4.0},
]


def test_job_state_records_the_log_and_last_commit_and_restores_it_into_a_new_run_dir(tmp_path):
    write_log(tmp_path / "a", SWITCH_1)
    state = job_state(FakeParticipant(), step=8, run_dir=tmp_path / "a")
    assert state["decisions"] == SWITCH_1
    assert state["last_commit"] == {"switch_id": 1, "step": 5, "recipe": "current"}
    model = mlp()
    dq.apply_recipe(model, dq.Float8CurrentScaling())
    commit = restore_job_state(state, run_dir=tmp_path / "b", model=model)
    assert commit == state["last_commit"]
    lines = (tmp_path / "b" / "decisions.jsonl").read_text().splitlines()
    assert [json.loads(x) for x in lines[:-1]] == SWITCH_1
    marker = json.loads(lines[-1])
    assert (marker["event"], marker["step"], marker["last_commit"]) == ("restored", 8, 1)
    # the same job's run directory (a restart): the log already begins with the records
    restore_job_state(state, run_dir=tmp_path / "a")
    assert len((tmp_path / "a" / "decisions.jsonl").read_text().splitlines()) == 5


@pytest.mark.parametrize("phase", ["voted", "committing"])
def test_job_state_during_a_switch_holds_the_state_before_it_and_names_the_pending_commit(
    tmp_path, phase
):
    write_log(tmp_path, SWITCH_1)  # switch 1 commits at step 5
    state = job_state(FakeParticipant(phase), step=5, run_dir=tmp_path)
    assert state["last_commit"] is None  # steps before 5 ran the initial recipe
    assert state["pending"] == [{"switch_id": 1, "step": 5, "recipe": "current"}]


def test_job_state_refuses_only_a_broken_rank(tmp_path):
    with pytest.raises(ValueError, match="rank 0 is broken"):
        job_state(FakeParticipant("broken"), step=8, run_dir=tmp_path)


def restored_record(run_dir: Path) -> dict:
    records = [json.loads(x) for x in (run_dir / "decisions.jsonl").read_text().splitlines()]
    return [r for r in records if r["event"] == "restored"][-1]


def test_a_commit_the_checkpoint_had_not_reached_is_reapplied_at_its_step_on_resume(tmp_path):
    write_log(tmp_path / "a", SWITCH_1)
    state = job_state(FakeParticipant("committing"), step=3, run_dir=tmp_path / "a")
    assert restore_job_state(state, run_dir=tmp_path / "b", model=mlp()) is None
    marker = restored_record(tmp_path / "b")
    assert marker["reapply"] == [{"switch_id": 1, "step": 5, "recipe": "current"}]
    assert marker["superseded"] == []


def test_a_commit_decided_after_the_checkpoint_is_reapplied_when_resuming_in_the_run_dir(tmp_path):
    write_log(tmp_path, SWITCH_1[:1])  # switch 1 open (ranks voting) when the checkpoint is taken
    state = job_state(FakeParticipant("voted"), step=3, run_dir=tmp_path)
    assert state["pending"] == []
    write_log(tmp_path, SWITCH_1)  # ... then it committed for step 5, and the job crashed
    restore_job_state(state, run_dir=tmp_path)
    assert restored_record(tmp_path)["reapply"] == [
        {"switch_id": 1, "step": 5, "recipe": "current"}
    ]
    # a checkpoint of the resumed job before step 5 still names it; one after it has it in force
    again = job_state(FakeParticipant("committing"), step=4, run_dir=tmp_path)
    assert [e["switch_id"] for e in again["pending"]] == [1]
    later = job_state(FakeParticipant(), step=9, run_dir=tmp_path)
    assert later["last_commit"]["switch_id"] == 1 and later["pending"] == []


def test_two_commits_for_one_step_reapply_the_later_and_record_the_earlier_as_superseded(tmp_path):
    records = [
        {"event": "open", "switch_id": 1, "recipe": "current"},
        {"event": "decision", "switch_id": 1, "commit": True, "step": 7},
        {
            "event": "restored",
            "step": 2,
            "reapply": [{"switch_id": 1, "step": 7, "recipe": "current"}],
            "superseded": [],
        },
        {"event": "open", "switch_id": 2, "recipe": "mxfp8"},
        {"event": "decision", "switch_id": 2, "commit": True, "step": 7},
    ]
    write_log(tmp_path, records[:2])
    state = job_state(FakeParticipant(), step=2, run_dir=tmp_path)
    write_log(tmp_path, records)
    restore_job_state(state, run_dir=tmp_path)
    marker = restored_record(tmp_path)
    assert [e["switch_id"] for e in marker["reapply"]] == [2]
    assert marker["superseded"] == [1]


def test_a_clean_start_abandons_a_dead_attempts_unpublished_commit_and_inherits_nothing(
    tmp_path,
):
    from dist_quant.coordinator.decision_log import DecisionLog, begin_attempt

    write_log(tmp_path, SWITCH_1)  # switch 1: COMMIT at step 5, never published
    attempt = begin_attempt(DecisionLog(tmp_path / "decisions.jsonl"))
    assert attempt["resumed"] is False
    records = [json.loads(x) for x in (tmp_path / "decisions.jsonl").read_text().splitlines()]
    assert [(r["event"], r.get("switch_id")) for r in records[-2:]] == [
        ("abandoned", 1),
        ("attempt", None),
    ]
    state = job_state(FakeParticipant(), step=3, run_dir=tmp_path)
    assert state["last_commit"] is None and state["pending"] == []


def test_restore_job_state_refuses_another_jobs_log_and_a_model_on_another_recipe(tmp_path):
    write_log(tmp_path / "a", SWITCH_1)
    state = job_state(FakeParticipant(), step=8, run_dir=tmp_path / "a")
    write_log(tmp_path / "other", SWITCH_1[2:])
    with pytest.raises(ValueError, match="does not begin with this checkpoint's 4 records"):
        restore_job_state(state, run_dir=tmp_path / "other")
    model, _ = trained()  # on DELAYED, but switch 1 set "current"
    with pytest.raises(ValueError, match="last committed switch \\(1, step 5\\)"):
        restore_job_state(state, run_dir=tmp_path / "c", model=model)
    assert not (tmp_path / "c").exists()
    with pytest.raises(ValueError, match="corrupted job state"):
        restore_job_state({**state, "last_commit": None}, run_dir=tmp_path / "c")
