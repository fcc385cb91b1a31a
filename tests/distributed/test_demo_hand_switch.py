"""The demo in a terminal, switched by hand from a second process in the middle of its default
schedule: the hand switch commits at once (`--no-wait`: a refusal would exit 1), the scheduled
switches still all commit, and the summary shows the hand phase with its recipe key.

The demo runs on a pseudo-terminal (rich draws its live progress bar there, as for a user); the
second process is the installed command line, `python -m dist_quant.launch.cli switch`.
"""

from __future__ import annotations

import json
import os
import pty
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.distributed

STEPS = 80  # default schedule: delayed at 20, current at 44, bf16 tail at 68


def _drain(fd: int, sink: list[bytes]) -> None:
    """Read the terminal until it closes (an unread pty blocks the demo once its buffer fills)."""
    while True:
        try:
            data = os.read(fd, 4096)
        except OSError:  # EIO: the demo closed its side
            return
        if not data:
            return
        sink.append(data)


def _rank0_steps(out: Path, since: float) -> list[dict]:
    try:
        lines = (out / "ranks" / "rank0.jsonl").read_text().splitlines()
    except FileNotFoundError:
        return []
    recs = []
    for line in lines:
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            continue
        if rec["t"] >= since:
            recs.append(rec)
    return recs


def test_hand_switch_in_the_middle_of_the_default_schedule_commits_at_once(tmp_path) -> None:
    out = tmp_path / "run"
    (out / "ranks").mkdir(parents=True)
    (out / "ranks" / "rank5.jsonl").write_text('{"step": 0, "loss": 1, "recipe": "old", "t": 0}\n')
    master, slave = pty.openpty()
    env = dict(os.environ, COLUMNS="120", LINES="40", TERM="xterm")
    started = time.time()
    demo = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "dist_quant.launch.cli",
            "demo",
            "--nproc",
            "2",
            "--out",
            str(out),
            "--steps",
            str(STEPS),
            "--step-delay",
            "0.25",
        ],
        stdin=slave,
        stdout=slave,
        stderr=slave,
        env=env,
        start_new_session=True,
    )
    os.close(slave)
    screen: list[bytes] = []
    reader = threading.Thread(target=_drain, args=(master, screen), daemon=True)
    reader.start()
    try:
        deadline = time.monotonic() + 240
        while not any(r["step"] >= 22 for r in _rank0_steps(out, started)):  # in "fp8 delayed"
            assert demo.poll() is None, b"".join(screen).decode(errors="replace")[-3000:]
            assert time.monotonic() < deadline, "the demo did not reach step 22"
            time.sleep(0.1)
        hand = subprocess.run(
            [
                sys.executable,
                "-m",
                "dist_quant.launch.cli",
                "switch",
                "bf16",
                "--no-wait",
                "--run-dir",
                str(out),
            ],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert hand.returncode == 0, hand.stdout + hand.stderr
        step = int(hand.stdout.split("from step ")[1].split()[0])
        assert 22 < step < 44
        assert demo.wait(timeout=300) == 0, b"".join(screen).decode(errors="replace")[-3000:]
    finally:
        if demo.poll() is None:
            demo.kill()
            demo.wait(30)
        reader.join(10)
        os.close(master)
    text = re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", b"".join(screen).decode(errors="replace"))
    assert "every rank ran the same recipe at every step" in text
    summary = json.loads((out / "summary.json").read_text())
    labels = [(p["label"], p["start"]) for p in summary["phases"]]
    bf16 = summary["phases"][0]["recipe"]
    assert labels == [
        ("bf16 warm-up", 0),
        ("fp8 delayed", 20),
        (f"by hand: {bf16}", step),
        ("fp8 current", 44),
        ("bf16 tail", 68),
    ]
    assert "by hand:" in text  # the phase table on the terminal
    assert [s["committed"] for s in summary["switches"]] == [True, True, True]
    assert not (out / "ranks" / "rank5.jsonl").exists()  # a previous run's rank, once this one ran
    assert not (out / "coordinator.json").exists()  # removed by rank 0 at a clean end
