"""The switch's timing rules: how often a planning rank says it is alive, when a silent rank
counts as gone (the lease), and how far ahead of the votes the commit step is booked.

Pure numbers and functions (no threads, clocks or I/O: the caller passes the times in), shared by
the coordinator's side (`coordinator.py`, `coordinator_state.py`, `decide.py`) and the ranks'
(`participant.py`, `participant_state.py`), so both sides compute the same hold step.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence

BEAT_S = 0.5  # a rank planning a switch says it is alive this often (`Alive`)
# ... and first this long after the Prepare reached it, unless it voted by then: a rank slow to
# plan (or to get the CPU) is heard early in the lease, at no cost to one that votes at once
FIRST_BEAT_S = 0.2
# A rank silent this long while a vote is due is dead, stopped or cut off. Short enough that a
# hung rank's switch is aborted and every rank is out of it within 2 s (the abort takes a few
# hundred ms more to reach thousands of ranks: BENCHMARKS.md, issue 32); long enough that a
# live rank, which beats FIRST_BEAT_S after the Prepare reaches it, is heard with 1.3 s to spare.
LEASE_S = 1.5


def check_lease(lease_s: float) -> None:
    """Raises ValueError unless `lease_s` spans at least two beats: a shorter lease would count a
    live planning rank, which says it is alive every BEAT_S, as silent."""
    number = isinstance(lease_s, (int, float)) and not isinstance(lease_s, bool)
    if not (number and lease_s >= 2 * BEAT_S):
        raise ValueError(
            f"lease_s={lease_s!r}: must be a number of seconds >= {2 * BEAT_S:g} (two beats of "
            f"a planning rank's {BEAT_S:g} s signs of life); the default is {LEASE_S:g}"
        )


def silent_ranks(
    owing: Sequence[int], heard: Mapping[int, float], *, since: float, drained_to: float,
    lease_s: float,
) -> list[int]:  # fmt: skip
    """The ranks of `owing` (those that owe a vote) heard from (vote, `Alive`; else since the Prepare went out
    at `since`) no later than `lease_s` before `drained_to`, the time up to which every message
    pushed to the coordinator has been read: so a message waiting in the queue never makes a live
    rank look silent."""
    cutoff = drained_to - lease_s
    if since > cutoff:
        return []
    return [r for r in owing if heard.get(r, since) <= cutoff]


MIN_LEAD_S = 0.05  # the commit step is booked at least this far ahead of the votes
LEAD_PER_RANK_S = 100e-6  # before a first measurement: the coordinator's cost per rank
MAX_LEAD_S = 10.0
MAX_LEAD_STEPS = 10_000  # however short a step: a rank is never held further ahead than this


def lead_time(world_size: int, last_latency_s: float | None) -> float:
    """How long ahead of the votes the commit step is booked (`Prepare.lead_s`): twice the
    request -> decision-sent time of the job's last committed switch, or before one, an estimate
    from the number of ranks; clamped to [MIN_LEAD_S, MAX_LEAD_S]."""
    if last_latency_s is None:
        lead = MIN_LEAD_S + world_size * LEAD_PER_RANK_S
    else:
        lead = 2.0 * last_latency_s
    return min(max(lead, MIN_LEAD_S), MAX_LEAD_S)


PACE_STEPS = 8  # a rank's pace is judged over its last this many step intervals


def pace(intervals: Iterable[float]) -> float:
    """A rank's seconds per step, as its vote reports it (0: not measured yet): the median of
    its last step intervals (`PACE_STEPS` of them). The ranks of a job keep one pace (their
    collectives hold them together), so one interval far off it is a hiccup of this rank's (a
    garbage collection, a checkpoint, a late data batch), or its catch-up after one; either, taken
    as the pace, would move this rank's hold step away from its peers'. A pace taken too long
    books fewer steps ahead than the lead, so the rank waits at a hold step before the commit step
    that the other ranks' votes set."""
    recent = sorted(list(intervals)[-PACE_STEPS:])
    if not recent:
        return 0.0
    middle = len(recent) // 2
    return recent[middle] if len(recent) % 2 else (recent[middle - 1] + recent[middle]) / 2


def hold_step(last_step: int, step_s: float, lead_s: float, at_step: int | None) -> int:
    """The first boundary a rank that voted YES after passing `last_step` may not pass without
    the decision: the requested `at_step`, else one past `last_step` plus as many whole steps (of
    `step_s` seconds, the rank's own rate) as fit in `lead_s`. The rank computes it and its vote
    carries it; the commit step is the largest over every rank, so no rank can have passed it
    undecided, and a rank waits only if it reaches its hold step before the decision arrives: a
    decision within `lead_s` of the vote keeps it waiting less than one step. Whole steps, not
    rounded up: a switch that is decided within a step still commits at the next boundary, as it
    would without a lead."""
    if at_step is not None:
        return at_step
    ahead = math.floor(lead_s / step_s) if step_s > 0 and lead_s > 0 else 0
    return last_step + 1 + min(ahead, MAX_LEAD_STEPS)
