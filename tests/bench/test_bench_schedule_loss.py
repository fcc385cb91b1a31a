"""bench/bench_schedule_loss.py at a few steps on the CPU, so that the script cannot rot: both
schedule files of the FP8-attention comparison load, each seed trains both runs, and the printed
difference is that of the two printed means (the runs see the same batches)."""

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_fp8_attention_against_bf16_attention_runs_each_seed_twice():
    out = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "bench_schedule_loss.py"),
         "--schedule", "examples/schedules/fp8_attention.yaml",
         "--baseline", "examples/schedules/fp8_linears.yaml",
         "--model", "gpt:layers=2", "--steps", "6", "--tail", "3", "--seeds", "0,1"],
        cwd=ROOT, capture_output=True, text=True, timeout=300, check=True,
    ).stdout  # fmt: skip
    means = re.findall(r"seed (\d) +(baseline|schedule): last-3 mean loss (\d+\.\d+)", out)
    assert [(s, n) for s, n, _ in means] == [
        ("0", "baseline"), ("0", "schedule"), ("1", "baseline"), ("1", "schedule"),
    ]  # fmt: skip
    assert "fp8 delayed, fp8 attention@0" in out and "fp8 delayed, bf16 attention@0" in out
    diffs = [float(d) for d in re.findall(r"schedule - baseline: ([+-]\d+\.\d+)", out)]
    for seed, diff in enumerate(diffs):
        base, sched = (float(m) for _, _, m in means[2 * seed : 2 * seed + 2])
        assert abs(diff - (sched - base)) <= 1.1e-4  # both printed to 4 decimals
    assert "over 2 seeds" in out
