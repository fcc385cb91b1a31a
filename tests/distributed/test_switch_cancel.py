"""Cancelling a booked switch with real rank processes over the TCPStore transport, through the
command line as a user types it: the booked switch never runs on any rank, the lock-out ends at
once, and the decision log records the cancel."""

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "coordinator"))  # switch_harness

from dist_quant.coordinator import status  # noqa: E402
from dist_quant.launch.cli import main  # noqa: E402
from harness import run_ranks  # noqa: E402
from switch_harness import Background, read_endpoint_when_ready, train_worker, wait_for  # noqa: E402

pytestmark = pytest.mark.distributed


def test_a_booked_switch_cancelled_from_the_cli_never_runs_and_frees_the_job(tmp_path, capsys):
    run_dir = tmp_path / "run"
    cfg = {
        "run_dir": str(run_dir),
        "stop_file": str(tmp_path / "stop"),
        "tp_size": 2,
        "step_s": 0.01,
        "max_steps": 100_000,
        "collectives": True,
        "decision_grace_s": 0.5,
    }
    target = ["--run-dir", str(run_dir)]
    job = Background(run_ranks, train_worker, 2, cfg, timeout_s=120)
    try:
        read_endpoint_when_ready(run_dir)
        assert main(["switch", '{"name": "B"}', "--at-step", "100000", *target]) == 0
        booked = capsys.readouterr().out
        assert "from step 100000" in booked
        assert main(["switch", '{"name": "X"}', "--no-wait", *target]) == 1  # locked out ...
        assert "dist-quant cancel 1" in capsys.readouterr().err
        assert main(["cancel", *target]) == 0  # ... until cancelled
        assert "switch 1 cancelled: no rank switches at step 100000" in capsys.readouterr().out
        assert main(["status", *target]) == 0
        shown = capsys.readouterr().out
        assert "state: switch 1: cancelled before step 100000" in shown
        assert "switch 1: COMMIT at step 100000, then cancelled" in shown

        assert main(["switch", '{"name": "C"}', "--no-wait", *target]) == 0
        c_step = int(capsys.readouterr().out.split("from step ")[1].split()[0])
        wait_for(lambda: status(run_dir=run_dir)["phase"] == "published", 20, "C published")
        assert main(["cancel", *target]) == 1  # nothing booked any more
        assert "nothing to cancel" in capsys.readouterr().err
    finally:
        Path(cfg["stop_file"]).touch()
        results = job.result(timeout=120)
    for r in results:
        recipes = r["recipes"]
        assert set(recipes[:c_step]) == {"A"} and set(recipes[c_step:]) == {"C"}  # never B
    lines = (run_dir / "decisions.jsonl").read_text().splitlines()
    records = [r for r in map(json.loads, lines) if "switch_id" in r]  # switch records only
    assert [(r["event"], r["switch_id"]) for r in records] == [
        ("open", 1),
        ("decision", 1),
        ("cancel", 1),
        ("open", 2),
        ("decision", 2),
        ("published", 2),
    ]
    assert records[2]["cancelled"] is True and records[2]["step"] == 100000
