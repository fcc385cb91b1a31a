"""The durable decision log: JSON lines, each flushed and fsynced before the caller goes on.

The coordinator appends a record when it opens a switch and when it decides one, and only after
`append` returned does anyone learn the decision. So after a crash the log never holds less than
what ranks saw: a switch with an "open" record and no "decision" record was never committed
anywhere, and `recover_open_switch` closes it as aborted. A log that cannot be written (disk full,
read-only) makes `append` raise `DecisionLogError`; the coordinator then aborts the switch.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

GUARD_RECORD = "guard"
"""`event` of a precision-guard record (coordinator/guard_runner.py): one when the guard decides
(`outcome` "requested" or "refused"), one when its switch request ends ("committed", "aborted",
"unreachable"), each with the trigger, the action, the statistic that fired it and the step."""


class DecisionLogError(OSError):
    """The decision log could not be written durably."""


class DecisionLog:
    """Append-only JSON-lines file; `append` returns only once the record is on disk."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)

    def append(self, record: dict[str, Any]) -> None:
        line = json.dumps({**record, "time": time.time()}, sort_keys=True) + "\n"
        try:
            created = not self.path.exists()
            # Opened per record: the log is written a few times per switch, and a fresh open keeps a
            # deleted or replaced file from swallowing records.
            with open(self.path, "a", encoding="utf-8") as f:
                f.write(line)
                f.flush()
                os.fsync(f.fileno())
            if created:
                _fsync_dir(self.path.parent)
        except OSError as e:
            raise DecisionLogError(
                e.errno, f"decision log {self.path} is not writable: {e.strerror or e}"
            ) from e

    def records(self) -> list[dict[str, Any]]:
        """All complete records; a torn last line (crash mid-write) is skipped."""
        if not self.path.is_file():  # missing, or a device such as /dev/full in tests
            return []
        out = []
        for line in self.path.read_text(encoding="utf-8").splitlines():
            try:
                rec = json.loads(line)
            except ValueError:
                continue
            if isinstance(rec, dict):
                out.append(rec)
        return out

    def last_switch_id(self) -> int:
        """The largest switch id recorded, or 0: new switch ids continue after it."""
        ids = [r["switch_id"] for r in self.records() if isinstance(r.get("switch_id"), int)]
        return max(ids, default=0)

    def recover_open_switch(self) -> int | None:
        """Close a switch left open by a crash with an ABORT record; returns its id, if any."""
        decided: set[int] = set()
        opened: list[int] = []
        for rec in self.records():
            if rec.get("event") == "open":
                opened.append(rec["switch_id"])
            elif rec.get("event") == "decision":
                decided.add(rec["switch_id"])
        dangling = [s for s in opened if s not in decided]
        for switch_id in dangling:
            self.append(
                {
                    "event": "decision",
                    "switch_id": switch_id,
                    "commit": False,
                    "step": None,
                    "reasons": {},
                    "summary": "coordinator restarted before deciding",
                }
            )
        return dangling[-1] if dangling else None


def _fsync_dir(directory: Path) -> None:
    """Make a newly created file's directory entry durable too."""
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
