"""A stop signal to `dist-quant run` stops every rank and leaves a job that resumes.

Real process trees: the launcher, torchrun and two ranks that attach to a coordinator, switch
recipes and checkpoint every step. Survivors are looked for by PID in /proc (a zombie counts as
dead), and whatever survives a failing test is killed before it reports.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from dist_quant.launch.stop_signals import StopRequested, deferred, stop_on_signals

pytestmark = pytest.mark.distributed

# Attempt "train": checkpoint (model + job state) before every step, switch to current scaling
# (asked at step 1, committed for the step after both ranks voted), then step forever. Attempt "resume": load the checkpoint, restore the job state, attach
# and check the switch is in force, then exit 0.
TRAIN = """
import json, os, sys, time
from pathlib import Path
import torch, torch.distributed as dist
import dist_quant as dq
from dist_quant import checkpoint as ckpt
from dist_quant.coordinator import attach, job_state, request_switch, restore_job_state
from dist_quant.runtime import recipe_key_of

out, mode = Path(sys.argv[1]), sys.argv[2]
run_dir = Path(os.environ["DIST_QUANT_RUN_DIR"])
dist.init_process_group("gloo")
rank = dist.get_rank()
torch.manual_seed(0)
model = torch.nn.Sequential(dq.Linear(16, 16), torch.nn.Tanh(), dq.Linear(16, 16))
opt = torch.optim.SGD(model.parameters(), lr=1e-2)
start = 0
if mode == "train":
    dq.apply_recipe(model, dq.recipe_from_dict("bf16"))
else:
    got = ckpt.load(out / "ckpt.pt", model, opt)
    start = got["extra"]["step"]
    restore_job_state(got["job"], run_dir=run_dir, model=model)
participant = attach(model)
(out / f"pids.{mode}.{rank}").write_text(f"{os.getpid()} {os.getppid()}")
step = start
while mode == "train" or step < start + 2:
    if rank == 0 and mode == "train":
        job = job_state(participant, step=step, run_dir=run_dir)
        ckpt.save(out / "ckpt.pt", model, opt, job=job, extra={"step": step})
        if step == 1:
            request_switch("current", run_dir=run_dir, timeout_s=60)
    participant.step_boundary(step)
    with dq.autocast():
        loss = model(torch.ones(4, 16)).square().mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
    (out / f"step.{mode}.{rank}").write_text(f"{step} {recipe_key_of(model)[0]}")
    step += 1
    time.sleep(0.02)
participant.close()
dist.destroy_process_group()
"""


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def _cli(*args: str, **kw) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "dist_quant.launch.cli", *args], **kw)


def _wait(cond, what: str, proc: subprocess.Popen, timeout: float = 240) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if proc.poll() is not None:
            raise AssertionError(f"the launcher exited ({proc.returncode}) before {what}")
        if time.monotonic() > deadline:
            raise AssertionError(f"no {what} within {timeout} s")
        time.sleep(0.1)


def _switched(path: Path) -> bool:
    try:
        return path.read_text().endswith(" Float8CurrentScaling")
    except OSError:
        return False


def _stop_and_check_the_tree(out: Path, run_dir: Path, proc: subprocess.Popen, sig: int) -> str:
    """Wait until both ranks run the switched recipe, send `sig` to the launcher, check its exit
    code and that the launcher, torchrun and both ranks are gone; returns the launcher's stderr."""
    _wait(lambda: all(_switched(out / f"step.train.{r}") for r in range(2)), "the switch", proc)
    pids = [proc.pid]
    for r in range(2):
        pids += map(int, (out / f"pids.train.{r}").read_text().split())  # rank, torchrun
    pids = sorted(set(pids))
    assert len(pids) == 4 and all(_alive(p) for p in pids)
    try:
        proc.send_signal(sig)
        _, err = proc.communicate(timeout=120)
        assert proc.returncode == 128 + sig, err
        deadline = time.monotonic() + 10
        while any(_alive(p) for p in pids) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert [p for p in pids if _alive(p)] == []
    finally:
        for p in pids:
            if p != proc.pid and _alive(p):
                os.kill(p, signal.SIGKILL)
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert not (run_dir / "coordinator.json").exists()
    return err


def test_sigterm_to_run_stops_every_rank_and_the_job_resumes_from_its_checkpoint(
    tmp_path,
) -> None:
    script, run_dir = tmp_path / "train.py", tmp_path / "job"
    script.write_text(TRAIN)
    argv = ["run", "--nproc", "2", "--run-dir", str(run_dir), str(script), str(tmp_path)]
    proc = _cli(*argv, "train", stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    err = _stop_and_check_the_tree(tmp_path, run_dir, proc, signal.SIGTERM)
    assert "dist-quant: stopped by SIGTERM; every rank has stopped" in err
    assert f"coordinator is up; run dir {run_dir}" in err  # the banner came first
    assert "Traceback" not in err

    # No job for a client any more: one line, exit 2, at once.
    switch = subprocess.run(
        [sys.executable, "-m", "dist_quant.launch.cli", "switch", "bf16", "--run-dir", run_dir],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert switch.returncode == 2 and "coordinator.json does not exist" in switch.stderr

    # The decision log is whole and holds the switch; the checkpoint loads and the job resumes.
    records = [json.loads(line) for line in (run_dir / "decisions.jsonl").read_text().splitlines()]
    commits = [r for r in records if r.get("event") == "decision" and r.get("commit") is True]
    assert len(commits) == 1 and commits[0]["step"] >= 2, records
    resume = _cli(*argv, "resume", stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    _, err = resume.communicate(timeout=300)
    assert resume.returncode == 0, err
    for r in range(2):
        last, recipe = (tmp_path / f"step.resume.{r}").read_text().split()
        assert int(last) > commits[0]["step"] and recipe == "Float8CurrentScaling"


def test_ctrl_c_of_run_stops_every_rank_without_a_traceback_even_with_sigint_ignored(
    tmp_path,
) -> None:
    """Started the way `cmd &` in a script starts it (SIGINT ignored, inherited): a SIGINT still
    stops the job, exit 130, one line on stderr after the banner."""
    script, run_dir = tmp_path / "train.py", tmp_path / "job"
    script.write_text(TRAIN)
    argv = ["run", "--nproc", "2", "--run-dir", str(run_dir), str(script), str(tmp_path)]
    proc = _cli(
        *argv,
        "train",
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN),
    )
    err = _stop_and_check_the_tree(tmp_path, run_dir, proc, signal.SIGINT)
    assert "Traceback" not in err and "SignalException" not in err
    assert err.strip().splitlines()[-1] == "dist-quant: stopped by SIGINT; every rank has stopped"


def test_a_stop_signal_inside_deferred_is_raised_when_the_block_ends() -> None:
    done = []
    before = signal.getsignal(signal.SIGTERM)  # not always SIG_DFL: ray.init installs its own
    with stop_on_signals():
        with pytest.raises(StopRequested) as stop:
            with deferred():
                os.kill(os.getpid(), signal.SIGTERM)
                time.sleep(0.01)  # the handler has run by now, and raised nothing
                done.append("spawned and stored")
        assert done == ["spawned and stored"] and stop.value.exit_code == 143
        os.kill(os.getpid(), signal.SIGINT)  # only the first stop raises: cleanup goes on
        time.sleep(0.01)
    assert signal.getsignal(signal.SIGTERM) is before  # the handler in place before is back


def test_a_stop_signal_during_the_spawn_still_stops_torchrun(tmp_path, monkeypatch) -> None:
    """The signal lands right after torchrun is forked, before the launcher has its handle."""
    from dist_quant.launch import torchrun

    real_popen = subprocess.Popen
    spawned = []

    def popen_then_signal(*args, **kw):
        child = real_popen(*args, **kw)
        spawned.append(child.pid)
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(0.01)
        return child

    monkeypatch.setattr(torchrun.subprocess, "Popen", popen_then_signal)
    script = tmp_path / "hang.py"
    script.write_text("import time\ntime.sleep(600)\n")
    try:
        with stop_on_signals(), pytest.raises(StopRequested):
            torchrun.run_script(1, str(script), [], run_dir=tmp_path / "job")
        assert len(spawned) == 1
        assert not _alive(spawned[0])
    finally:
        for pid in spawned:  # its own session: the group holds torchrun and its worker
            try:
                os.killpg(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
