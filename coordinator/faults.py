"""Fault injection for tests: `fail_at(rank=1, phase="prepare")`.

The coordinator and participants call `inject(faults, phase, ...)` at fixed points; with no faults
configured that is one empty-tuple check. Faults are frozen dataclasses so they pass through
`torch.multiprocessing.spawn` and Ray.

Phases (where the hook sits):
- participant: "prepare" (listener, before planning), "vote" (listener, before sending its vote),
  "commit" (training thread, at step S before publishing), "relay" (a node leader's relay, before
  it hands a Decision on to its node's ranks);
- coordinator (rank=None): "open" (before logging a new switch), "decide" (outcome known, before it
  is logged), "publish" (decision logged, before anyone can read it).
Actions (each phase accepts those that mean something there, see the tables below): "raise" (an
`InjectedFault`: a NO vote in "prepare", a failed publish in "commit"), "delay" (sleep `seconds`),
"drop" (the vote is not sent), "stop" (the coordinator thread ends silently, as if killed), "exit"
(the process dies at once with exit code 17).
"""

from __future__ import annotations

import os
import time
from collections.abc import Sequence
from dataclasses import dataclass

# phase -> the actions that mean something there
PARTICIPANT_PHASES = {
    "prepare": ("raise", "delay", "exit"),
    "vote": ("delay", "drop", "exit"),
    "commit": ("raise", "delay", "exit"),
    "relay": ("delay", "exit"),
}
COORDINATOR_PHASES = {
    "open": ("delay", "stop", "exit"),
    "decide": ("delay", "stop", "exit"),
    "publish": ("delay", "stop", "exit"),
}
EXIT_CODE = 17


class InjectedFault(RuntimeError):
    """Raised by a fault with action "raise"."""


class CoordinatorKilled(BaseException):
    """Ends the coordinator thread without any cleanup, as a kill would (action "stop")."""


@dataclass(frozen=True)
class Fault:
    phase: str
    rank: int | None = None  # None: the coordinator
    action: str = "raise"
    seconds: float = 0.0
    switch_id: int | None = None  # None: every switch

    def __post_init__(self) -> None:
        phases = COORDINATOR_PHASES if self.rank is None else PARTICIPANT_PHASES
        who = "the coordinator (rank=None)" if self.rank is None else f"rank {self.rank}"
        if self.phase not in phases:
            raise ValueError(f"fault phase {self.phase!r} is not one of {sorted(phases)} for {who}")
        if self.action not in phases[self.phase]:
            raise ValueError(
                f"fault action {self.action!r} at phase {self.phase!r} for {who} is not one of "
                f"{phases[self.phase]}"
            )


def fail_at(
    *,
    phase: str,
    rank: int | None = None,
    action: str = "raise",
    seconds: float = 0.0,
    switch_id: int | None = None,
) -> Fault:
    """A fault for `rank` (None: the coordinator) at `phase`; see the module docstring."""
    return Fault(phase, rank, action, seconds, switch_id)


def inject(faults: Sequence[Fault], phase: str, *, rank: int | None, switch_id: int) -> bool:
    """Run the faults that match; returns True if one says to drop what the phase sends."""
    drop = False
    for f in faults:
        if f.phase != phase or f.rank != rank or f.switch_id not in (None, switch_id):
            continue
        if f.action == "delay":
            time.sleep(f.seconds)
        elif f.action == "drop":
            drop = True
        elif f.action == "exit":
            os._exit(EXIT_CODE)
        elif f.action == "stop":
            raise CoordinatorKilled(f"coordinator killed at {phase} of switch {switch_id}")
        else:
            who = "coordinator" if rank is None else f"rank {rank}"
            raise InjectedFault(f"injected fault: {who} at {phase} of switch {switch_id}")
    return drop
