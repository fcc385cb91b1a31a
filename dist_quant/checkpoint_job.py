"""The coordinator's part of a job checkpoint: its decision log and the last committed switch.

`job_state(participant, step=S)` is taken with the model's checkpoint, between steps (S is the step
the resumed job runs first). It refuses while this rank has voted on, or holds a committed but not
yet published, switch, and when the log records a COMMIT at step S or later: that switch would be
lost on resume. `restore_job_state(state)` runs before `attach` in the resumed job, on the rank
that hosts the coordinator: it writes the saved records into the run directory's decision log
when that has none (the new coordinator continues the switch ids after them), or checks that the
existing log begins with them (a restart in the same run directory), then appends a
`{"event": "restored", ...}` record saying from which step the job went on. With `model=` it also
checks that the model resumes on the recipe of the last committed switch.

The decision log lives in `<run_dir>/decisions.jsonl` on the coordinator's host (rank 0): take the
job state there (the participant does not expose its run directory; pass the `run_dir` given to
`attach`).
"""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch.distributed as dist
from torch import nn

JOB_FORMAT = "dist_quant.job_state/1"
# Participant states in which a checkpoint loses no decision: nothing voted, nothing to publish.
_QUIET_STATES = ("idle", "preparing")


def _log_path(run_dir: str | os.PathLike[str] | None) -> Path:
    from dist_quant.coordinator.endpoint import LOG_FILE, resolve_run_dir

    return resolve_run_dir(run_dir) / LOG_FILE


def _records(path: Path) -> list[dict[str, Any]]:
    from dist_quant.coordinator.log import DecisionLog

    return DecisionLog(path).records()


def last_commit(records: list[dict[str, Any]]) -> dict[str, Any] | None:
    """`{"switch_id", "step", "recipe"}` of the last COMMIT in decision-log records, or None."""
    recipes = {r.get("switch_id"): r.get("recipe") for r in records if r.get("event") == "open"}
    last = None
    for r in records:
        if r.get("event") == "decision" and r.get("commit") is True:
            sid = r.get("switch_id")
            last = {"switch_id": sid, "step": r.get("step"), "recipe": recipes.get(sid)}
    return last


def job_state(
    participant: Any, *, step: int, run_dir: str | os.PathLike[str] | None = None
) -> dict[str, Any]:
    """The coordinator's state to save with a checkpoint taken before step `step`."""
    if not isinstance(step, int) or isinstance(step, bool) or step < 0:
        raise ValueError(f"job_state: step must be an int >= 0, got {step!r}")
    state = participant.state
    if state not in _QUIET_STATES:
        raise ValueError(
            f"job_state: rank {participant.rank} is {state!r} in a recipe switch, so a checkpoint "
            "now would lose its outcome; checkpoint once the switch is published or aborted"
        )
    records = _records(_log_path(run_dir))
    pending = [
        r["switch_id"]
        for r in records
        if r.get("event") == "decision"
        and r.get("commit") is True
        and isinstance(r.get("step"), int)
        and r["step"] >= step
    ]
    if pending:
        raise ValueError(
            f"job_state: switch {pending[-1]} is committed for step >= {step} but not yet "
            "published; checkpoint after that step"
        )
    return {
        "format": JOB_FORMAT,
        "step": step,
        "decisions": records,
        "last_commit": last_commit(records),
    }


def _parse(state: object) -> dict[str, Any]:
    if not isinstance(state, Mapping) or state.get("format") != JOB_FORMAT:
        got = state.get("format") if isinstance(state, Mapping) else type(state).__name__
        raise ValueError(f"restore_job_state: not a {JOB_FORMAT!r} job state (got {got!r})")
    step, decisions = state.get("step"), state.get("decisions")
    if not isinstance(step, int) or not isinstance(decisions, list):
        raise ValueError("restore_job_state: corrupted job state ('step' or 'decisions')")
    if not all(isinstance(r, dict) for r in decisions):
        raise ValueError("restore_job_state: corrupted job state (a decision record is no dict)")
    if state.get("last_commit") != last_commit(decisions):
        raise ValueError("restore_job_state: corrupted job state ('last_commit' disagrees)")
    return dict(state)


def _check_model(model: nn.Module, commit: dict[str, Any]) -> None:
    from dist_quant.checkpoint import recipe_digest
    from dist_quant.recipes import recipe_from_dict
    from dist_quant.runtime import recipe_key_of

    want = recipe_from_dict(commit["recipe"])
    have = recipe_key_of(model)
    if have is None or recipe_digest(have) != recipe_digest(want.key()):
        raise ValueError(
            f"restore_job_state: the last committed switch ({commit['switch_id']}, step "
            f"{commit['step']}) set recipe {want.key()!r}, but the model resumes on {have!r}"
        )


def _write_new_log(path: Path, records: list[dict[str, Any]]) -> None:
    """Write the saved records as the log's lines (the coordinator's JSON-lines format), durably."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.writelines(json.dumps(r, sort_keys=True) + "\n" for r in records)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)  # nobody ever sees a half-restored log
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    dir_fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


def restore_job_state(
    state: Mapping[str, Any],
    *,
    run_dir: str | os.PathLike[str] | None = None,
    model: nn.Module | None = None,
    write: bool | None = None,
) -> dict[str, Any] | None:
    """Restore the decision log before `attach`; returns the last committed switch (or None).

    `write` defaults to "this process hosts the coordinator" (rank 0, or no process group);
    other ranks only validate.
    """
    from dist_quant.coordinator.log import DecisionLog

    saved = _parse(state)
    commit = saved["last_commit"]
    if model is not None and commit is not None:
        _check_model(model, commit)
    if write is None:
        write = not (dist.is_available() and dist.is_initialized()) or dist.get_rank() == 0
    if not write:
        return commit
    path = _log_path(run_dir)
    existing, records = _records(path), saved["decisions"]
    if existing and existing[: len(records)] != records:
        raise ValueError(
            f"restore_job_state: the decision log {path} does not begin with this checkpoint's "
            f"{len(records)} records: it belongs to another job; resume in this job's run "
            "directory or in an empty one"
        )
    if not existing and records:
        _write_new_log(path, records)
    DecisionLog(path).append(
        {
            "event": "restored",
            "step": saved["step"],
            "last_commit": None if commit is None else commit["switch_id"],
            "records": len(records),
        }
    )
    return commit


__all__ = ["JOB_FORMAT", "job_state", "last_commit", "restore_job_state"]
