"""`dist-quant switch` and `dist-quant status`: the command-line client of a job's coordinator.

Exit codes follow `cli.py`: 0 committed, 1 aborted or refused (the job answered no, and goes on
unchanged), 2 the job could not be reached or asked.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from dist_quant.launch.stats import describe_guard, last_guard_decision


def switch(
    payload: str | dict[str, Any],
    *,
    at_step: int | None,
    timeout_s: float,
    run_dir: str | os.PathLike[str] | None,
    address: str | None,
    token: str | None,
) -> int:
    """Request the switch and print its outcome; exit code 0 (commit) or 1 (abort/refused)."""
    from dist_quant.coordinator import SwitchBusyError, SwitchRequestError, request_switch
    from dist_quant.launch.cli import CliError

    try:
        result = request_switch(
            payload,
            at_step=at_step,
            timeout_s=timeout_s,
            run_dir=run_dir,
            address=address,
            token=token,
        )
    except SwitchBusyError as e:
        raise CliError(f"switch refused: {e}", 1) from e
    except SwitchRequestError as e:
        raise CliError(str(e), 2) from e
    decided = result.timings.get("total_s")
    took = "" if decided is None else f" (decided in {decided:.3f} s)"
    if result.committed:
        print(
            f"switch {result.switch_id} committed: every rank runs the new recipe from step "
            f"{result.step}{took}"
        )
        return 0
    print(f"switch {result.switch_id} aborted{took}; every rank keeps its current recipe:")
    for rank, reason in sorted(result.reasons.items()):
        print(f"  rank {rank}: {reason}")
    if not result.reasons and result.summary:
        print(f"  {result.summary}")
    return 1


def status(
    *,
    run_dir: str | os.PathLike[str] | None,
    address: str | None,
    token: str | None,
    as_json: bool,
) -> int:
    """Print the coordinator's view of the job; exit code 0, or CliError(2) if unreachable."""
    from dist_quant.coordinator import SwitchRequestError
    from dist_quant.coordinator import status as query
    from dist_quant.launch.cli import CliError

    try:
        info = query(run_dir=run_dir, address=address, token=token)
    except SwitchRequestError as e:
        raise CliError(str(e), 2) from e
    # the guard's decisions live in the decision log beside the coordinator's
    guard = last_guard_decision(Path(info["log"]).parent) if info.get("log") else None
    if as_json:
        print(json.dumps({**info, "last_guard_decision": guard}, indent=1, sort_keys=True))
        return 0
    for line in format_status(info):
        print(line)
    print(f"last guard decision: {describe_guard(guard)}" if guard else "last guard decision: none")
    return 0


def format_status(info: dict[str, Any]) -> list[str]:
    """Human-readable lines for a status reply (see `Coordinator._status` for its fields)."""
    open_id = info.get("open_switch")
    lines = [
        f"phase: {info.get('phase', '?')}"
        + (f" (switch {open_id} is open)" if open_id is not None else ", no switch open"),
        f"ranks: {info.get('world_size', '?')}, TP groups: {info.get('tp_groups', '?')}",
        "recipe key per rank:",
    ]
    keys = info.get("recipe_keys") or {}
    lines += [f"  rank {r}: {k}" for r, k in sorted(keys.items(), key=lambda kv: int(kv[0]))]
    if not keys:
        lines.append("  (no rank has reported yet)")
    decisions = info.get("decisions") or []
    lines.append("last decisions:" if decisions else "last decisions: none yet")
    for d in decisions[-5:]:
        if d.get("commit"):
            done = "published on every rank" if d.get("published") else "publishing"
            lines.append(f"  switch {d.get('switch_id')}: COMMIT at step {d.get('step')} ({done})")
        else:
            lines.append(f"  switch {d.get('switch_id')}: ABORT: {d.get('summary', '')}")
    if info.get("log"):
        lines.append(f"decision log: {info['log']}")
    return lines
