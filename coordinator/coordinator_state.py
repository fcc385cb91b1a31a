"""The coordinator's state machine: states with their payload, the transition table, pure steps.

Free of threads, clocks and I/O like `participant_state.py`: every step function takes the state,
the event and the time `now` and returns a `Step`: the next state, the reply for the client, the
message for every rank, and log lines. `coordinator.py` reads the inbox, calls these, and does
what the `Step` says (logging durably first where a step says so); `Coordinator._set_state` is the
only place the state changes and checks every change against `phases.TRANSITIONS`.

    IDLE --request--> PREPARING --all voted, or deadline--> DECIDING --logged--> COMMITTED | ABORTED
    COMMITTED --every rank acked--> PUBLISHED ;  COMMITTED --cancel request--> CANCELLING
    CANCELLING --logged--> CANCELLED | COMMITTED ;  PUBLISHED | ABORTED | CANCELLED --request-->
    PREPARING

Votes and acks go into a `Tally` of the state that collects them. Taking a message in (the `take_*`
of `coordinator_intake.py`) adds to that tally and never changes the phase; the step functions only
read tallies. A tally counts as it goes, so asking whether a round is complete is O(1); a node
relay's summary of its ranks' votes (acks) goes in as one range, so a switch costs O(nodes) where
nodes summarize, and O(ranks) at most.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any, ClassVar

from dist_quant.coordinator.decide import decide
from dist_quant.coordinator.decide_cancel import decide_cancel
from dist_quant.coordinator.phases import TRANSITIONS, Phase
from dist_quant.coordinator.protocol import (
    Ack,
    CancelDecision,
    CancelPrepare,
    CancelRequest,
    CancelVote,
    Decision,
    Message,
    Prepare,
    Reply,
    SwitchRequest,
    Vote,
)
from dist_quant.coordinator.results import SwitchResult
from dist_quant.coordinator.tally import Tally
from dist_quant.coordinator.timing import silent_ranks


# ---- states with their payload --------------------------------------------------------------
@dataclass(frozen=True)
class Opened:
    """What a switch was opened with."""

    prepare: Prepare
    request_id: str
    opened_at: float  # monotonic
    deadline: float  # votes are due by then


@dataclass(frozen=True)
class Settled:
    """A switch whose outcome is logged (and sent): what `status` and the result report."""

    opened: Opened
    votes: Tally[Vote]
    decision: Decision
    decided_at: float
    log_s: float

    @property
    def switch_id(self) -> int:
        return self.opened.prepare.switch_id


@dataclass(frozen=True)
class Idle:
    phase: ClassVar[Phase] = Phase.IDLE


class Lease:
    """When each rank that owes a vote was last heard from (`Alive`), counted from `since`, when
    the Prepare went out. Mutable like a `Tally`, written by `take_alive` and the driver alone."""

    def __init__(self, since: float) -> None:
        self.since = since
        self.heard: dict[int, float] = {}


@dataclass(frozen=True)
class Preparing:
    phase: ClassVar[Phase] = Phase.PREPARING
    opened: Opened
    votes: Tally[Vote]
    lease: Lease


@dataclass(frozen=True)
class Deciding:
    """The outcome is known and is being logged; nobody has seen it yet."""

    phase: ClassVar[Phase] = Phase.DECIDING
    opened: Opened
    votes: Tally[Vote]
    decision: Decision
    decided_at: float


@dataclass(frozen=True)
class Committed:
    phase: ClassVar[Phase] = Phase.COMMITTED
    settled: Settled
    acks: Tally[Ack]


@dataclass(frozen=True)
class Cancelling:
    phase: ClassVar[Phase] = Phase.CANCELLING
    committed: Committed
    prepare: CancelPrepare
    request_id: str
    deadline: float
    votes: Tally[CancelVote]


@dataclass(frozen=True)
class Published:
    phase: ClassVar[Phase] = Phase.PUBLISHED
    settled: Settled


@dataclass(frozen=True)
class Aborted:
    phase: ClassVar[Phase] = Phase.ABORTED
    settled: Settled


@dataclass(frozen=True)
class Cancelled:
    phase: ClassVar[Phase] = Phase.CANCELLED
    settled: Settled


State = Idle | Preparing | Deciding | Committed | Cancelling | Published | Aborted | Cancelled


def switch_id_of(state: State) -> int | None:
    """The id of the switch the state is about (open or last), None before the first."""
    if isinstance(state, (Preparing, Deciding)):
        return state.opened.prepare.switch_id
    if isinstance(state, Committed):
        return state.settled.switch_id
    if isinstance(state, Cancelling):
        return state.committed.settled.switch_id
    if isinstance(state, (Published, Aborted, Cancelled)):
        return state.settled.switch_id
    return None


def step_of(state: State) -> int | None:
    """The commit step of the state's switch, once decided."""
    if isinstance(state, Deciding):
        return state.decision.step
    if isinstance(state, Committed):
        return state.settled.decision.step
    if isinstance(state, Cancelling):
        return state.prepare.step
    if isinstance(state, (Published, Aborted, Cancelled)):
        return state.settled.decision.step
    return None


@dataclass(frozen=True)
class Step:
    """A step's result: the next state; `record` to append to the decision log (durably) before
    anything is sent; the message for every rank; then the reply to the client."""

    state: State
    reply: Reply | None = None
    record: dict[str, Any] | None = None
    broadcast: Message | None = None
    notes: tuple[str, ...] = ()


def check_transition(old: State, new: State) -> None:
    """Raise on a change the table does not allow (a bug in this file or its caller)."""
    if new is not old and new.phase not in TRANSITIONS[old.phase]:
        raise RuntimeError(
            f"coordinator bug: illegal transition {old.phase.value} -> {new.phase.value}"
        )


# ---- requests ---------------------------------------------------------------------------------
def on_request(
    state: State,
    req: SwitchRequest,
    *,
    switch_id: int,
    world_size: int,
    now: float,
    lead_s: float = 0.0,
) -> Step:
    """A new switch request: PREPARING (log "open", then send the Prepare, which asks the ranks
    to hold the commit step `lead_s` ahead of their votes), or a refusal."""
    open_id = switch_id_of(state)
    if state.phase.open:
        hint = (
            f"; `dist-quant cancel {open_id}` cancels it" if state.phase is Phase.COMMITTED else ""
        )
        error = (
            f"switch {open_id} is still open ({state.phase.describe(open_id, step_of(state))}); "
            f"retry after it ends{hint}"
        )
        return Step(state, reply=Reply(req.request_id, "refused", open_id, error, {}))
    problem = _request_problem(req)
    if problem:
        return Step(state, reply=Reply(req.request_id, "refused", None, problem, {}))
    prepare = Prepare(switch_id, req.recipe, req.at_step, req.timeout_s, lead_s)
    opened = Opened(prepare, req.request_id, now, now + req.timeout_s)
    return Step(
        Preparing(opened, Tally(world_size), Lease(now)),
        reply=Reply(req.request_id, "accepted", switch_id, "", {}),
        record={"event": "open", "request_id": req.request_id, **prepare.to_dict()},
        broadcast=prepare,
    )


def on_open_failed(state: Preparing, error: str, *, now: float) -> Step:
    """The "open" record could not be logged: the switch is decided ABORT before any rank
    heard of it."""
    decision = Decision(state.opened.prepare.switch_id, False, None, {}, error)
    return Step(Deciding(state.opened, state.votes, decision, now), notes=(error,))


def on_cancel_request(state: State, req: CancelRequest, *, now: float) -> Step:
    """Cancel the committed switch: CANCELLING (send the CancelPrepare), or a refusal."""
    open_id = switch_id_of(state) if state.phase.open else None
    wanted = req.switch_id if req.switch_id is not None else open_id
    problem = ""
    if not (0 < req.timeout_s < float("inf")):
        problem = f"timeout_s must be a positive number of seconds, got {req.timeout_s}"
    elif open_id is None:
        problem = "no switch is open: nothing to cancel"
    elif wanted != open_id:
        problem = f"switch {wanted} is not the open switch ({open_id}); nothing to cancel"
    elif not isinstance(state, Committed):
        problem = (
            f"switch {open_id} cannot be cancelled now "
            f"({state.phase.describe(open_id, None)}); only a committed switch can be"
        )
    if problem:
        return Step(state, reply=Reply(req.request_id, "refused", wanted, problem, {}))
    prepare = CancelPrepare(open_id, state.settled.decision.step, req.timeout_s)
    world = state.acks.world_size
    cancelling = Cancelling(state, prepare, req.request_id, now + req.timeout_s, Tally(world))
    return Step(
        cancelling, reply=Reply(req.request_id, "accepted", open_id, "", {}), broadcast=prepare
    )


# ---- the phase moves on ---------------------------------------------------------------------
def on_tally(state: State, *, now: float, drained_to: float, tp_groups: Any) -> Step:
    """What the tallies allow now: PREPARING -> DECIDING once every rank voted or the deadline
    passed; COMMITTED -> PUBLISHED once every rank acked. Otherwise the state as it is. The
    deadline counts as passed once the inbox is read up to it (`drained_to`: every message pushed
    before then is in the tallies), so a vote waiting in the queue is not a missing vote."""
    if isinstance(state, Preparing):
        passed = drained_to >= state.opened.deadline
        if not (passed or state.votes.complete):
            return Step(state)
        decision = decide(state.opened.prepare, state.votes, tp_groups, passed)
        return Step(Deciding(state.opened, state.votes, decision, now))
    if isinstance(state, Committed) and state.acks.complete:
        return Step(Published(state.settled))
    return Step(state)


def on_drained(
    state: State,
    *,
    now: float,
    drained_to: float,
    lease_s: float,
    nodes: Sequence[Sequence[int]] = (),
) -> Step:
    """The inbox was read up to `drained_to`: PREPARING -> DECIDING (ABORT) if a rank that owes
    its vote was silent for `lease_s` (no vote, no `Alive`): dead, stopped or cut off. The
    driver calls this once per drain, so the O(ranks) look is paid every `BEAT_S` at most.
    `nodes`: the relayed nodes' ranks; a node silent as a whole (its leader lost) is named once."""
    if not isinstance(state, Preparing):
        return Step(state)
    lease = state.lease
    silent = silent_ranks(
        state.votes.missing(), lease.heard,
        since=lease.since, drained_to=drained_to, lease_s=lease_s,
    )  # fmt: skip
    if not silent:
        return Step(state)
    why = f"no vote and no sign of life for {lease_s:g} s: dead, stopped or cut off"
    reasons = {r: why for r in silent}
    summary = f"{describe_ranks(silent, nodes)}: {why}"
    decision = Decision(state.opened.prepare.switch_id, False, None, reasons, summary)
    return Step(Deciding(state.opened, state.votes, decision, now))


_SHOWN = 16  # ranks or nodes named in a one-line summary


def describe_ranks(ranks: Sequence[int], nodes: Sequence[Sequence[int]] = ()) -> str:
    """'rank 3', 'ranks 2, 5', 'node 8-15, ranks 2, 5 and 4 more': every node of `nodes` whose
    ranks are all in `ranks` is named once (a lost node leader silences its whole node), by its
    rank range, or by its lowest rank where its ranks are not consecutive; at most `_SHOWN` names."""
    listed = set(ranks)
    whole = [sorted(n) for n in nodes if n and listed.issuperset(n)]
    in_whole = {r for n in whole for r in n}
    names = [
        f"node {n[0]}-{n[-1]}" if n[-1] - n[0] + 1 == len(n) else f"the node of rank {n[0]}"
        for n in whole
    ]
    loose = [r for r in ranks if r not in in_whole]
    if loose:
        names += [f"rank{'s' if len(loose) > 1 else ''} {loose[0]}", *map(str, loose[1:])]
    more = f" and {len(names) - _SHOWN} more" if len(names) > _SHOWN else ""
    return ", ".join(names[:_SHOWN]) + more


def waiting_for(state: State) -> list[int]:
    """The ranks the open round still waits for (votes, acks or cancel votes): what holds the
    switch up, for `dist-quant status`."""
    if isinstance(state, Preparing):
        tally: Tally[Any] = state.votes
    elif isinstance(state, Committed):
        tally = state.acks
    elif isinstance(state, Cancelling):
        tally = state.votes
    else:
        return []
    return tally.missing()


def cancel_outcome(state: Cancelling, *, drained_to: float) -> CancelDecision | None:
    """The cancel's outcome once every rank voted or its deadline passed (then logged); the
    deadline counts once the inbox is read up to it, as for a switch's votes."""
    passed = drained_to >= state.deadline
    if not (passed or state.votes.complete):
        return None
    ranks = range(state.votes.world_size)
    return decide_cancel(state.prepare, state.votes.by_rank, ranks, passed)


def on_logged(state: Deciding, decision: Decision, *, log_s: float) -> Step:
    """The decision, as settled by its logging (`decide.settle_decision`), is durable: send it
    to every rank and the result to the client."""
    settled = Settled(state.opened, state.votes, decision, state.decided_at, log_s)
    nxt = Committed(settled, Tally(state.votes.world_size)) if decision.commit else Aborted(settled)
    reply = Reply(
        state.opened.request_id, "result", decision.switch_id, "", result_of(settled).to_dict()
    )
    return Step(nxt, reply=reply, broadcast=for_ranks(decision))


def on_cancel_logged(state: Cancelling, outcome: CancelDecision) -> Step:
    """The cancel's outcome, as settled by its logging, is durable: CANCELLED or back to
    COMMITTED (its acks so far kept); tell every rank and the client."""
    nxt = Cancelled(state.committed.settled) if outcome.cancelled else state.committed
    reply = Reply(state.request_id, "result", outcome.switch_id, "", outcome.to_dict())
    return Step(nxt, reply=reply, broadcast=for_ranks(outcome))


def for_ranks(outcome: Decision | CancelDecision) -> Decision | CancelDecision:
    """What every rank is sent of a logged outcome: all of it but the per-rank reasons, which
    the client's result and the decision log keep. A rank acts on the switch, the verdict and the
    step alone, and an abort at scale names thousands of ranks (a lost rack, a job too busy to
    answer): sent to every rank, those reasons made the decision's bytes grow with N^2 (4,096
    ranks, ~4,000 named: 30 s before the last rank had read and decoded its copy)."""
    return replace(outcome, reasons={}) if outcome.reasons else outcome


def result_of(settled: Settled) -> SwitchResult:
    d = settled.decision
    votes_s = settled.decided_at - settled.opened.opened_at
    ranges = sorted(settled.votes.ranges, key=lambda entry: entry[0])
    return SwitchResult(
        switch_id=d.switch_id,
        committed=d.commit,
        step=d.step,
        reasons=dict(d.reasons),
        timings={"votes_s": votes_s, "log_s": settled.log_s, "total_s": votes_s + settled.log_s},
        prepare_s={r: v.prepare_s for r, v in sorted(settled.votes.by_rank.items())},
        summary=d.summary,
        prepare_s_ranges={f"{first}-{last}": s.prepare_s for first, last, s in ranges},
    )


def _request_problem(req: SwitchRequest) -> str:
    if not (0 < req.timeout_s < float("inf")):
        return f"timeout_s must be a positive number of seconds, got {req.timeout_s}"
    if req.at_step is not None and req.at_step < 0:
        return f"at_step must be >= 0, got {req.at_step}"
    return ""
