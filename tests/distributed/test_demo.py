"""The demo job end to end on CPU: real processes, real coordinator, real switches.

What these catch: a scheduled switch that does not commit, ranks that switch at different steps
(one step with two recipes in a TP group), a launcher that hides a failure, a job that stops
learning across switches, and `dist-quant switch` from another process not reaching the job or
disturbing it with a malformed recipe. The loss bound is loose on purpose (the last steps' mean
below 60% of the first steps'): an untrained model sits at ln(64) = 4.16 nats and a working one
reaches ~1.4 within 30 steps, so only a job that does not learn fails it.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
from dist_quant.launch.cli import main

pytestmark = pytest.mark.distributed

NPROC = 2


def _demo_cmd(out: Path, *args: str) -> list[str]:
    return [
        sys.executable,
        "-m",
        "dist_quant.launch.cli",
        "demo",
        "--nproc",
        str(NPROC),
        "--out",
        str(out),
        *args,
    ]


def _rank_logs(out: Path) -> list[list[dict]]:
    return [
        [json.loads(line) for line in (out / "ranks" / f"rank{r}.jsonl").read_text().splitlines()]
        for r in range(NPROC)
    ]


def _changes(log: list[dict]) -> list[tuple[int, str]]:
    """(first step, recipe key) of every run of equal keys."""
    runs = []
    for rec in log:
        if not runs or runs[-1][1] != rec["recipe"]:
            runs.append((rec["step"], rec["recipe"]))
    return runs


def _check_scheduled_demo(out: Path, proc: subprocess.CompletedProcess, steps: int) -> None:
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "(TP=2 x DP=1, cpu," in proc.stdout  # the default: one tensor-parallel pair
    assert "dist-quant demo: phases" in proc.stdout
    assert "every rank ran the same recipe at every step" in proc.stdout
    assert (out / "loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "bf16 tail" in (out / "summary.txt").read_text()

    logs = _rank_logs(out)
    assert [len(log) for log in logs] == [steps] * NPROC
    runs = _changes(logs[0])
    for log in logs[1:]:
        assert _changes(log) == runs  # every rank switched at the same steps, to the same keys
    kinds = [key.split(":")[0] for _, key in runs]
    assert kinds == ["bf16", "DelayedScaling", "Float8CurrentScaling", "bf16"]
    assert runs[0][1] == runs[3][1]  # warm-up and tail: the same bf16 recipe

    switches = json.loads((out / "summary.json").read_text())["switches"]
    assert [s["committed"] for s in switches] == [True, True, True]
    # The coordinator's commit step is where every rank's log changes recipe.
    assert [s["step"] for s in switches] == [start for start, _ in runs[1:]]
    # Default schedule: fractions 0.25 / 0.55 / 0.85 of the run.
    asked = [round(f * steps) for f in (0.25, 0.55, 0.85)]
    assert [s["requested_step"] for s in switches] == asked
    assert all(s["step"] >= a for s, a in zip(switches, asked, strict=True))

    losses = [rec["loss"] for rec in logs[0]]
    first, last = sum(losses[:4]) / 4, sum(losses[-4:]) / 4
    assert last < 0.6 * first, (first, last)


def test_demo_under_torchrun_commits_every_scheduled_switch_on_every_rank(tmp_path) -> None:
    out = tmp_path / "run"
    steps = 30
    proc = subprocess.run(
        _demo_cmd(out, "--steps", str(steps), "--step-delay", "0.02"),
        capture_output=True,
        text=True,
        timeout=400,
    )
    _check_scheduled_demo(out, proc, steps)


@pytest.mark.ray
def test_demo_under_ray_commits_every_scheduled_switch_on_every_rank(tmp_path) -> None:
    out = tmp_path / "run"
    steps = 30
    proc = subprocess.run(
        _demo_cmd(out, "--steps", str(steps), "--step-delay", "0.02", "--launcher", "ray"),
        capture_output=True,
        text=True,
        timeout=400,
    )
    _check_scheduled_demo(out, proc, steps)


@pytest.mark.ray
@pytest.mark.slow  # Ray Train's controller and workers: ~1.5 min on 2 busy cores
def test_demo_under_ray_train_commits_every_scheduled_switch_on_every_rank(tmp_path) -> None:
    pytest.importorskip("ray.train.torch", exc_type=ImportError)
    out = tmp_path / "run"
    steps = 30
    proc = subprocess.run(
        _demo_cmd(out, "--steps", str(steps), "--step-delay", "0.02", "--launcher", "ray-train"),
        capture_output=True,
        text=True,
        timeout=400,
    )
    _check_scheduled_demo(out, proc, steps)


def _wait_for(cond, what: str, proc: subprocess.Popen, timeout: float = 180.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if proc.poll() is not None:
            raise AssertionError(f"the demo exited ({proc.returncode}) while waiting for {what}")
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.1)


def test_switch_from_another_process_commits_and_a_malformed_one_leaves_the_job_running(
    tmp_path, capsys
) -> None:
    out = tmp_path / "run"
    steps = 80
    schedule = tmp_path / "schedule.json"
    schedule.write_text(json.dumps([{"step": 0, "recipe": "bf16"}]))
    log0 = out / "ranks" / "rank0.jsonl"
    with open(tmp_path / "demo.log", "w") as demo_log:
        demo = subprocess.Popen(
            _demo_cmd(
                out,
                "--steps",
                str(steps),
                "--step-delay",
                "0.05",
                "--recipe-schedule",
                str(schedule),
            ),
            stdout=demo_log,
            stderr=subprocess.STDOUT,
        )
        try:
            _wait_for(
                lambda: (
                    (out / "coordinator.json").exists()
                    and log0.exists()
                    and len(log0.read_text().splitlines()) >= 2
                ),
                "the first steps",
                demo,
            )
            run_dir = ["--run-dir", str(out)]

            # A recipe that parses but does not exist: every rank votes no, the job goes on.
            assert main(["switch", '{"type": "Bogus"}', *run_dir]) == 1
            aborted = capsys.readouterr().out
            assert "aborted" in aborted
            # every rank gave the same reason: one line naming them all
            assert f"  ranks 0-{NPROC - 1}: ValueError: unknown recipe type 'Bogus'" in aborted
            assert aborted.count("unknown recipe type 'Bogus'") == 1
            steps_after_abort = len(log0.read_text().splitlines())

            # Unparseable input never reaches the job.
            assert main(["switch", '{"type": ', *run_dir]) == 2
            assert "not valid JSON" in capsys.readouterr().err

            assert main(["status", *run_dir]) == 0
            status = capsys.readouterr().out
            assert "ABORT" in status and all(f"rank {r}:" in status for r in range(NPROC))

            assert main(["switch", "current", *run_dir]) == 0
            committed = capsys.readouterr().out
            assert "committed" in committed
            step = int(committed.split("from step ")[1].split()[0])
            assert demo.wait(timeout=400) == 0, (tmp_path / "demo.log").read_text()[-3000:]
        finally:
            if demo.poll() is None:
                demo.terminate()
                demo.wait(timeout=60)

    logs = _rank_logs(out)
    assert [len(log) for log in logs] == [steps] * NPROC  # trained to the end after the abort
    assert steps_after_abort < steps
    for log in logs:
        runs = _changes(log)
        assert [start for start, _ in runs] == [0, step]
        assert runs[0][1] == "bf16"  # until the committed step
        assert runs[1][1].startswith("Float8CurrentScaling:")
    assert _changes(logs[0]) == _changes(logs[1])
    phases = json.loads((out / "summary.json").read_text())["phases"]
    assert [p["label"] for p in phases] == ["bf16", f"by hand: {runs[1][1]}"]


def _previous_run(out: Path) -> dict[Path, bytes]:
    """Files a previous demo left in `out`, with their contents."""
    files = {
        out / "loss.png": b"old png",
        out / "summary.json": b'{"old": true}',
        out / "summary.txt": b"old table",
        out / "demo_config.json": b'{"old": "config"}',
        out / "torchrun.log": b"old log",
        out / "ranks" / "rank0.jsonl": b'{"step": 0, "loss": 9.0, "recipe": "old", "t": 0}\n',
        out / "ranks" / "rank3.jsonl": b'{"step": 0, "loss": 9.0, "recipe": "old", "t": 0}\n',
    }
    for path, data in files.items():
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
    return files


def test_a_failing_rank_fails_the_demo_with_one_line_naming_it(tmp_path) -> None:
    """A first recipe that parses but cannot be built (its factory returns a str) fails on the
    ranks, not in the launcher: the demo must exit 1 and say which rank failed and why. The run
    never came up, so the previous run's results are all still there, untouched."""
    schedule = tmp_path / "schedule.yaml"
    schedule.write_text('- {step: 0, recipe: {type: CustomRecipe, qfactory: "builtins:repr"}}\n')
    out = tmp_path / "run"
    previous = _previous_run(out)
    proc = subprocess.run(
        _demo_cmd(out, "--steps", "5", "--recipe-schedule", str(schedule)),
        capture_output=True,
        text=True,
        timeout=400,
    )
    assert proc.returncode == 1
    err = proc.stderr.strip().splitlines()
    assert len(err) == 1 and "Traceback" not in proc.stderr
    assert err[0].startswith("dist-quant: demo job failed (torchrun exit code 1): rank ")
    assert "layers.0.self_attention.qkv" in err[0] and "returned a str" in err[0]
    assert f"full log: {out / 'torchrun-failed.log'}" in err[0]
    assert {path: path.read_bytes() for path in previous} == previous
    assert not list(out.glob(".demo_config.*")) and not (out / "coordinator.json").exists()


def test_ray_launcher_without_ray_exits_2_with_the_install_hint_and_deletes_nothing(
    tmp_path, monkeypatch, capsys
) -> None:
    monkeypatch.setitem(sys.modules, "ray", None)  # import ray fails, find_spec finds nothing
    out = tmp_path / "run"
    previous = _previous_run(out)
    assert main(["demo", "--launcher", "ray", "--out", str(out)]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""  # refused before the header
    assert captured.err.count("\n") == 1
    assert 'needs Ray, which is not installed: pip install -e ".[ray]"' in captured.err
    assert {path: path.read_bytes() for path in previous} == previous


@pytest.mark.parametrize("sig", ["SIGINT", "SIGTERM"])
def test_ctrl_c_stops_the_demo_and_leaves_no_endpoint_behind(tmp_path, sig) -> None:
    """After Ctrl-C (or SIGTERM) the next `dist-quant status` says at once, in one line, that no
    job runs. The demo starts as `cmd &` in a script starts it, SIGINT ignored: Python keeps an
    inherited SIG_IGN, and the demo once ran to its end through the SIGINT of a loaded full run."""
    import signal

    out = tmp_path / "run"
    log0 = out / "ranks" / "rank0.jsonl"
    with open(tmp_path / "demo.log", "w") as demo_log:
        demo = subprocess.Popen(
            _demo_cmd(out, "--steps", "400", "--step-delay", "0.05"),
            stdout=demo_log,
            stderr=subprocess.STDOUT,
            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN),
        )
        try:
            _wait_for(
                lambda: log0.exists() and len(log0.read_text().splitlines()) >= 3,
                "the first steps",
                demo,
            )
            assert (out / "coordinator.json").exists()
            demo.send_signal(signal.Signals[sig])
            assert demo.wait(timeout=120) == 128 + signal.Signals[sig]
        finally:
            if demo.poll() is None:  # a failed wait: SIGTERM stops the ranks too, SIGKILL not
                demo.terminate()
                try:
                    demo.wait(60)
                except subprocess.TimeoutExpired:
                    demo.kill()
                    demo.wait(60)
    assert not (out / "coordinator.json").exists()
    status = subprocess.run(
        [sys.executable, "-m", "dist_quant.launch.cli", "status", "--run-dir", str(out)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert status.returncode == 2
    assert status.stderr.count("\n") == 1 and "coordinator.json does not exist" in status.stderr
