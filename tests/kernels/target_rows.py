"""Runs a script that compiles kernels for NVIDIA targets without a GPU (``compile_targets.py``,
``compile_attention_targets.py``) and returns the JSON rows it prints, one per compiled kernel.
The script runs in a process without ``TRITON_INTERPRET`` (the interpreter never compiles) and
skips the calling test where this Triton cannot assemble for NVIDIA targets."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest


def compiled_rows(script: Path, timeout_s: int) -> list[dict]:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(script.parent), env.get("PYTHONPATH")]))
    done = subprocess.run(
        [sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=timeout_s
    )
    if done.returncode != 0 and "ptxas" in done.stderr:
        pytest.skip(f"this Triton cannot assemble for NVIDIA targets here: {done.stderr[-300:]}")
    assert done.returncode == 0, done.stderr[-2000:]
    return [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
