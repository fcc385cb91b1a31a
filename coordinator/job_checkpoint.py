"""The coordinator's part of a job checkpoint: its decision log and the switches in force.

The model's checkpoint (`dist_quant.checkpoint`) knows nothing of the switch protocol: it stores
the mapping given as its `job` entry. `job_state(participant, step=S)` builds that mapping; it is
taken with the model's checkpoint, between steps (S is the step
the resumed job runs first). It never refuses because of a switch in flight: the checkpoint holds
the state *before* any switch whose step is S or later (the model as it is), and records those
switches as `pending`; an undecided switch is decided in the log later. Only a BROKEN rank (its
recipe may differ from its peers') refuses. `restore_job_state(state)` runs before `attach` in the
resumed job and reconciles the checkpoint with the run directory's decision log by rule: every
COMMIT in force for the lineage (`coordinator.decision_log.timeline`) at step S or later is re-applied at
its own step (recorded in the `restored` record's `reapply`; `attach` hands the list to every
rank, which publishes each at its step's boundary), except one overtaken by a later COMMIT for the
same step, recorded as `superseded`. So the resumed job runs the same recipes at the same steps as
the original would have, and every later checkpoint is consistent with the log. See
docs/checkpoint.md for the exact semantics.

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
from dist_quant.coordinator.decision_log import DecisionLog, timeline
from dist_quant.coordinator.endpoint import LOG_FILE, resolve_run_dir
from dist_quant.coordinator.participant_state import RankPhase
from torch import nn

from dist_quant.checkpoint import read_digest
from dist_quant.recipes import key_digest, recipe_from_dict
from dist_quant.runtime import recipe_key_of

JOB_FORMAT = "dist_quant.job_state/1"


def _log_path(run_dir: str | os.PathLike[str] | None) -> Path:
    return resolve_run_dir(run_dir) / LOG_FILE


def _records(path: Path) -> list[dict[str, Any]]:
    return DecisionLog(path).records()


def last_commit(
    records: list[dict[str, Any]], before_step: int | None = None
) -> dict[str, Any] | None:
    """`{"switch_id", "step", "recipe"}` of the last switch in force (for steps before
    `before_step`, if given) in decision-log records, or None."""
    entries = timeline(records)
    if before_step is not None:
        entries = [e for e in entries if e["step"] < before_step]
    return entries[-1] if entries else None


def pending_switches(records: list[dict[str, Any]], step: int) -> list[dict[str, Any]]:
    """The switches in force whose step is `step` or later: a checkpoint before `step` lacks them."""
    return [e for e in timeline(records) if e["step"] >= step]


def job_state(
    participant: Any, *, step: int, run_dir: str | os.PathLike[str] | None = None
) -> dict[str, Any]:
    """The coordinator's state to save with a checkpoint taken before step `step`."""
    if not isinstance(step, int) or isinstance(step, bool) or step < 0:
        raise ValueError(f"job_state: step must be an int >= 0, got {step!r}")
    if participant.state == RankPhase.BROKEN.value:  # its recipe may differ from its peers'
        raise ValueError(
            f"job_state: rank {participant.rank} is broken (it may run another recipe than its "
            "peers); restart the job from an earlier checkpoint"
        )
    records = _records(_log_path(run_dir))
    return {
        "format": JOB_FORMAT,
        "step": step,
        "decisions": records,
        "last_commit": last_commit(records, step),
        "pending": pending_switches(records, step),
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
    if state.get("last_commit") != last_commit(decisions, step):
        raise ValueError("restore_job_state: corrupted job state ('last_commit' disagrees)")
    if "pending" in state and state["pending"] != pending_switches(decisions, step):
        raise ValueError("restore_job_state: corrupted job state ('pending' disagrees)")
    return dict(state)


def _check_model(model: nn.Module, commit: dict[str, Any]) -> None:
    want = recipe_from_dict(commit["recipe"])
    have = recipe_key_of(model)
    if have is None or read_digest(key_digest(have)) != read_digest(want.digest()):
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


def _reconcile(
    entries: list[dict[str, Any]], step: int
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(reapply, superseded) of the timeline entries at `step` or later: one per step, the last
    COMMIT for a step wins."""
    by_step: dict[int, dict[str, Any]] = {}
    superseded = []
    for e in entries:
        if e["step"] < step:
            continue
        if e["step"] in by_step:
            superseded.append(by_step[e["step"]])
        by_step[e["step"]] = e
    return [by_step[s] for s in sorted(by_step)], superseded


def restore_job_state(
    state: Mapping[str, Any],
    *,
    run_dir: str | os.PathLike[str] | None = None,
    model: nn.Module | None = None,
    write: bool | None = None,
) -> dict[str, Any] | None:
    """Restore the decision log before `attach`; returns the last switch in force at the
    checkpoint's step (or None). The switches to re-apply go into the `restored` record, which
    `attach` reads.

    `write` defaults to "this process hosts the coordinator" (rank 0, or no process group);
    other ranks only validate.
    """
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
    # A restart in the same run dir also sees what this job decided after the checkpoint was
    # taken, up to a clean start (an unrelated job, or a restart without checkpoint).
    later = existing[len(records) :]
    clean = [i for i, r in enumerate(later) if r.get("event") == "attempt" and not r["resumed"]]
    live = records + later[: clean[0] if clean else len(later)]
    reapply, superseded = _reconcile(timeline(live), saved["step"])
    if not existing and records:
        _write_new_log(path, records)
    DecisionLog(path).append(
        {
            "event": "restored",
            "step": saved["step"],
            "last_commit": None if commit is None else commit["switch_id"],
            "records": len(records),
            "reapply": reapply,
            "superseded": [e["switch_id"] for e in superseded],
        }
    )
    return commit


__all__ = ["JOB_FORMAT", "job_state", "last_commit", "pending_switches", "restore_job_state"]
