"""The durable decision log: JSON lines, each flushed and fsynced before the caller goes on.

The coordinator appends a record when it opens a switch and when it decides one, and only after
`append` returned does anyone learn the decision. So after a crash the log never holds less than
what ranks saw: a switch with an "open" record and no "decision" record was never committed
anywhere, and `recover_open_switch` closes it as aborted. A log that cannot be written (disk full,
read-only) makes `append` raise `DecisionLogError`; the coordinator then aborts the switch.

Jobs and attempts. Every coordinator start appends `{"event": "attempt", "job_id", "attempt",
"resumed"}`. An attempt is *resumed* when the record before it is the `restored` marker that
`restore_job_state` writes; it then continues that job (same `job_id`, next `attempt` number). Any
other start is *clean*: the job trains from its initial state, so no earlier switch applies to it;
COMMITs of earlier attempts that never got their `published` marker are recorded as `abandoned`.
The job id is `$DIST_QUANT_JOB_ID`, else torchrun's `$TORCHELASTIC_RUN_ID` (unless "none"), else
random; a clean restart under the same id counts up `attempt`.

The switch timeline (`timeline`) of the current lineage, the records from the last clean attempt
on, is what checkpoints and resumes agree on: each COMMIT adds (switch_id, step, recipe); a later
ABORT record of the same switch (a COMMIT logged too late) or an `abandoned` record removes it; a
`restored` record at step S keeps the entries before S and replaces the rest by its `reapply`
list (the switches the resumed job publishes again at their steps; see docs/checkpoint.md).
"""

from __future__ import annotations

import json
import os
import secrets
import time
from pathlib import Path
from typing import Any

from dist_quant.jsonl import read_jsonl

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
        return read_jsonl(self.path)

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


def lineage(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The records from the last clean attempt on (all of them if no attempt is recorded)."""
    start = 0
    for i, rec in enumerate(records):
        if rec.get("event") == "attempt" and not rec.get("resumed"):
            start = i
    return records[start:]


def timeline(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The committed switches in force for the current lineage, in step order:
    `[{"switch_id", "step", "recipe"}]` (see the module docstring for the rules)."""
    recipes: dict[Any, Any] = {}
    entries: list[dict[str, Any]] = []
    for rec in lineage(records):
        event, sid = rec.get("event"), rec.get("switch_id")
        if event == "open":
            recipes[sid] = rec.get("recipe")
        elif event == "decision":
            entries = [e for e in entries if e["switch_id"] != sid]
            if rec.get("commit") is True and isinstance(rec.get("step"), int):
                entries.append({"switch_id": sid, "step": rec["step"], "recipe": recipes.get(sid)})
        elif event == "abandoned":
            entries = [e for e in entries if e["switch_id"] != sid]
        elif event == "restored" and isinstance(rec.get("step"), int):
            kept = [e for e in entries if e["step"] < rec["step"]]
            entries = kept + [dict(e) for e in rec.get("reapply") or []]
    return sorted(entries, key=lambda e: e["step"])


def unpublished_commits(records: list[dict[str, Any]]) -> list[int]:
    """Switch ids of the lineage whose outcome is COMMIT but that never got a `published` marker."""
    published = {r.get("switch_id") for r in records if r.get("event") == "published"}
    return [e["switch_id"] for e in timeline(records) if e["switch_id"] not in published]


def resume_schedule(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The switches a job about to attach must publish again, from the `restored` record that
    precedes it (none when the last record is anything else: a clean start)."""
    if records and records[-1].get("event") == "restored":
        return [dict(e) for e in records[-1].get("reapply") or []]
    return []


def begin_attempt(log: DecisionLog) -> dict[str, Any]:
    """Append this coordinator start's `attempt` record (after `abandoned` records on a clean
    start) and return it."""
    records = log.records()
    resumed = bool(records) and records[-1].get("event") == "restored"
    attempts = [r for r in records if r.get("event") == "attempt"]
    if resumed and attempts:
        job_id = attempts[-1]["job_id"]
    else:
        run_id = os.environ.get("TORCHELASTIC_RUN_ID", "")
        job_id = os.environ.get("DIST_QUANT_JOB_ID") or (
            run_id if run_id not in ("", "none") else secrets.token_hex(6)
        )
    if not resumed:
        for switch_id in unpublished_commits(records):
            log.append(
                {
                    "event": "abandoned",
                    "switch_id": switch_id,
                    "summary": "committed by an earlier attempt that never published it; this "
                    "attempt starts clean",
                }
            )
    number = 1 + sum(1 for r in attempts if r.get("job_id") == job_id)
    record = {"event": "attempt", "job_id": job_id, "attempt": number, "resumed": resumed}
    log.append(record)
    return record


def _fsync_dir(directory: Path) -> None:
    """Make a newly created file's directory entry durable too."""
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
