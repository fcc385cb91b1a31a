"""`dist-quant switch`, `cancel` and `status`: the command-line client of a job's coordinator.

Exit codes follow `cli.py`: 0 committed (cancelled), 1 aborted or refused (the job answered no,
and goes on unchanged), 2 the job could not be reached or asked. Nothing here imports torch
before it must: a store client needs `torch.distributed`, the rest is plain Python.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import sys
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from dist_quant.coordinator.errors import CancelRefusedError, SwitchBusyError, SwitchRequestError
from dist_quant.coordinator.switch_requests import cancel_switch, request_switch
from dist_quant.coordinator.switch_requests import status as query
from dist_quant.launch.errors import CliError
from dist_quant.launch.stats import describe_guard, last_guard_decision

_BUSY_RETRY_S = 0.2  # how often a waiting `switch` asks again while another switch is open


def switch(
    payload: str | dict[str, Any],
    *,
    at_step: int | None,
    timeout_s: float,
    run_dir: str | os.PathLike[str] | None,
    address: str | None,
    token: str | None,
    wait: bool = True,
) -> int:
    """Request the switch and print its outcome; exit code 0 (commit) or 1 (abort/refused).

    With `wait`, a request refused because another switch is open is asked again until that
    switch closes or `timeout_s` passes (a switch booked for a far step: `dist-quant cancel`)."""
    give_up_at = time.monotonic() + timeout_s
    told = False
    while True:
        try:
            result = request_switch(
                payload,
                at_step=at_step,
                timeout_s=timeout_s,
                run_dir=run_dir,
                address=address,
                token=token,
            )
            break
        except SwitchBusyError as e:
            if not wait or time.monotonic() + _BUSY_RETRY_S > give_up_at:
                raise CliError(f"switch refused: {e}", 1) from e
            if not told:
                print(f"dist-quant: {_waiting_message(e, timeout_s)}", file=sys.stderr)
                told = True
            time.sleep(_BUSY_RETRY_S)
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
    _print_reasons(result.reasons, result.summary)
    return 1


def _print_reasons(reasons: Mapping[int, str], summary: str) -> None:
    """A line per reason with the ranks that gave it, as runs (an abort that names thousands of
    ranks for one cause is one line), or the outcome's summary where no rank has one."""
    by_reason: dict[str, list[int]] = {}
    for rank, reason in reasons.items():
        by_reason.setdefault(reason, []).append(rank)
    for reason, ranks in sorted(by_reason.items(), key=lambda kv: min(kv[1])):
        print(f"  {'rank' if len(ranks) == 1 else 'ranks'} {rank_ranges(ranks)}: {reason}")
    if not reasons and summary:
        print(f"  {summary}")


def _waiting_message(busy: SwitchBusyError, timeout_s: float) -> str:
    """The coordinator's refusal says "retry after it ends" (right for `--no-wait`); a waiting
    `switch` says it waits instead, keeping what is open and how to cancel it."""
    what, _, hint = str(busy).partition("; retry after it ends")
    return f"{what}; waiting for it to end (up to {timeout_s:g} s, Ctrl-C to stop){hint}"


def cancel(
    switch_id: int | None,
    *,
    timeout_s: float,
    run_dir: str | os.PathLike[str] | None,
    address: str | None,
    token: str | None,
) -> int:
    """Cancel a committed switch before its step; exit code 0 (cancelled on every rank) or 1."""
    try:
        result = cancel_switch(
            switch_id, timeout_s=timeout_s, run_dir=run_dir, address=address, token=token
        )
    except CancelRefusedError as e:
        raise CliError(f"cancel refused: {e}", 1) from e
    except SwitchRequestError as e:
        raise CliError(str(e), 2) from e
    if result.cancelled:
        print(
            f"switch {result.switch_id} cancelled: no rank switches at step {result.step}; "
            "every rank keeps its current recipe"
        )
        return 0
    print(f"switch {result.switch_id} not cancelled; every rank switches at step {result.step}:")
    _print_reasons(result.reasons, result.summary)
    return 1


def status(
    *,
    run_dir: str | os.PathLike[str] | None,
    address: str | None,
    token: str | None,
    as_json: bool,
) -> int:
    """Print the coordinator's view of the job; exit code 0, or CliError(2) if unreachable."""
    try:
        info = query(run_dir=run_dir, address=address, token=token)
    except SwitchRequestError as e:
        raise CliError(str(e), 2) from e
    # the guard's decisions live in the decision log beside the coordinator's
    guard = last_guard_decision(Path(info["log"]).parent) if info.get("log") else None
    if as_json:
        raw = info.get("recipe_keys") or {}
        shown = {
            **info,
            # the form the text prints; the exact key (a Python repr) stays beside it
            "recipe_keys": {r: short_recipe_key(k) for r, k in raw.items()},
            "recipe_key_reprs": raw,
            "last_guard_decision": guard,
        }
        print(json.dumps(shown, indent=1, sort_keys=True))
        return 0
    for line in format_status(info):
        print(line)
    print(f"last guard decision: {describe_guard(guard)}" if guard else "last guard decision: none")
    return 0


_KEY_REPR = re.compile(r"^\('(\w+)', (\(\)\)$)?")


def short_recipe_key(text: str) -> str:
    """A rank's reported key (`repr(recipe.key())`) as `name:8 hex digits`, or the name alone
    for a recipe without fields (`bf16`): the form the demo's tables and `dist-quant roles` print
    (`demo_report.short_key` hashes the same repr, as `Recipe.digest()`)."""
    m = _KEY_REPR.match(text)
    if m is None:
        return text  # "none", or an error text
    if m.group(2):
        return m.group(1)
    return f"{m.group(1)}:{hashlib.sha256(text.encode()).hexdigest()[:8]}"


def rank_ranges(ranks: list[int]) -> str:
    """Ranks as runs, each once: [8, 0, 1, 2, 2, 5, 7] -> "0-2, 5, 7-8"."""
    runs: list[list[int]] = []
    for r in sorted(set(ranks)):
        if runs and r == runs[-1][1] + 1:
            runs[-1][1] = r
        else:
            runs.append([r, r])
    return ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)


# A job with more TP groups than this shows their shape, not each group.
_GROUPS_SHOWN = 8


def describe_tp_groups(groups: Any) -> str:
    """The job's TP groups in a line whatever its size: each group of a small job; a large one's
    count and shape (2,048 groups of 8 consecutive ranks print as that, not as 16,384 numbers)."""
    if not isinstance(groups, list):
        return "TP groups: ?"
    if all(len(g) == 1 for g in groups):
        return "no tensor parallelism"  # each rank its own group: data parallel only
    if len(groups) <= _GROUPS_SHOWN:
        return f"TP groups: {groups}"
    sizes = sorted({len(g) for g in groups})
    consecutive = all(list(g) == list(range(g[0], g[0] + len(g))) for g in groups if g)
    shape = f"of {sizes[0]}" if len(sizes) == 1 else f"of {sizes[0]}-{sizes[-1]}"
    return f"{len(groups)} TP groups {shape}{' consecutive' if consecutive else ''} ranks"


def recipe_key_lines(keys: dict[str, str], world_size: Any) -> list[str]:
    """One line per recipe key with the ranks that reported it, as runs, then the ranks not
    heard from: a job of any size in as many lines as it has keys (during a switch, two)."""
    by_key: dict[str, list[int]] = {}
    for r, k in keys.items():
        by_key.setdefault(short_recipe_key(k), []).append(int(r))
    lines = [
        f"  {'rank' if len(ranks) == 1 else 'ranks'} {rank_ranges(ranks)}: {key}"
        for key, ranks in sorted(by_key.items(), key=lambda kv: min(kv[1]))
    ]
    if isinstance(world_size, int):
        silent = sorted(set(range(world_size)) - {int(r) for r in keys})
        if silent and keys:
            lines.append(f"  not reported yet: {len(silent)} rank(s): {rank_ranges(silent)}")
    return lines or ["  (no rank has reported yet)"]


def format_status(info: dict[str, Any]) -> list[str]:
    """Human-readable lines for a status reply (see `Coordinator._status` for its fields)."""
    lines = [f"state: {info.get('phase_text') or info.get('phase', '?')}"]
    waiting = info.get("waiting_for") or []
    if waiting:  # what holds the open switch up (votes, acks or cancel votes still due)
        lines.append(f"waiting for {len(set(waiting))} rank(s): {rank_ranges(waiting)}")
    lines += [
        f"ranks: {info.get('world_size', '?')}, {describe_tp_groups(info.get('tp_groups'))}",
        "recipe key per rank:",
    ]
    lines += recipe_key_lines(info.get("recipe_keys") or {}, info.get("world_size"))
    decisions = info.get("decisions") or []
    lines.append("last decisions:" if decisions else "last decisions: none yet")
    for d in decisions[-5:]:
        if d.get("cancelled"):
            lines.append(
                f"  switch {d.get('switch_id')}: COMMIT at step {d.get('step')}, then cancelled"
            )
        elif d.get("commit"):
            done = "published on every rank" if d.get("published") else "publishing"
            lines.append(f"  switch {d.get('switch_id')}: COMMIT at step {d.get('step')} ({done})")
        else:
            lines.append(f"  switch {d.get('switch_id')}: ABORT: {d.get('summary', '')}")
    if info.get("log"):
        lines.append(f"decision log: {info['log']}")
    return lines
