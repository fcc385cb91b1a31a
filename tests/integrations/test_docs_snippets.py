"""Every Python block of docs/integrations.md runs, each in a fresh interpreter (as a reader
would paste it); a block whose framework is not installed is skipped with the reason."""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

DOC = Path(__file__).resolve().parents[2] / "docs" / "integrations.md"
BLOCKS = re.findall(r"^## (.+?)$|^```python\n(.*?)^```$", DOC.read_text(), re.M | re.S)


def snippets() -> list[tuple[str, str]]:
    out, section = [], "intro"
    for heading, code in BLOCKS:
        if heading:
            section = heading.strip()
        else:
            out.append((section, code))
    return out


NEEDS = {"torchtitan": "torchtitan", "transformers": "transformers", "ray": "ray.train"}


def _params() -> list:
    # the Ray block starts a local Ray cluster: marked like the other Ray tests
    return [
        pytest.param(s, c, id=s, marks=[pytest.mark.ray] if s == "Ray Train" else [])
        for s, c in snippets()
    ]


@pytest.mark.parametrize("section, code", _params())
def test_snippet_runs(section: str, code: str, tmp_path) -> None:
    for word, module in NEEDS.items():
        # `import transformers`, `import tempfile, torch, transformers`, `from transformers ...`
        if re.search(rf"^\s*(import\s+([\w.]+\s*,\s*)*|from\s+){word}\b", code, re.M):
            try:
                found = importlib.util.find_spec(module) is not None
            except ModuleNotFoundError:
                found = False
            if not found:
                pytest.skip(f"{section}: needs {module} (pip install 'dist-quant[frameworks]')")
    env = {**os.environ, "TRITON_INTERPRET": os.environ.get("TRITON_INTERPRET", "1")}
    proc = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=500,
        cwd=tmp_path,
        env=env,
    )
    assert proc.returncode == 0, f"{section}:\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}"
