"""Reading the JSON-lines files a job appends to (`fp8_stats.jsonl`, `decisions.jsonl`), no torch."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    """Complete JSON-object lines of `path` (a torn last line of a running job is skipped)."""
    out = []
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            rec = json.loads(line)
        except ValueError:
            continue
        if isinstance(rec, dict):
            out.append(rec)
    return out
