"""The participant's state machine: states with their payload, the transition table, pure steps.

Free of threads, clocks and I/O like `decide.decide()`: every function takes the current state,
the rank's `Ledger` and the event (with the time `now` and the last step the training thread
passed, where they matter) and returns a `Step`: the next state and ledger, the message to send,
what the training thread must do at a boundary, and the log lines. `participant.py` holds the
lock, calls these, and does what the `Step` says; `Participant._set_state` checks every change
against `TRANSITIONS`.

    IDLE --Prepare--> PREPARING --yes--> VOTED --COMMIT--> COMMITTING --boundary S--> IDLE
                                 \\--no, or ABORT--> IDLE   \\--ABORT--> IDLE
                                                  \\--no decision by its hold step and in time-->
                                                    GAVE_UP
    GAVE_UP --ABORT--> IDLE ;  GAVE_UP --next Prepare--> PREPARING
    COMMITTING --CancelPrepare, before S--> CANCEL_VOTED --cancelled--> IDLE (candidate dropped)
                                   \\--not cancelled, or no outcome by S + grace--> COMMITTING
    IDLE --a re-applied switch (resume)--> COMMITTING ;  COMMITTING --published, next re-applied
    switch--> COMMITTING
    any --inconsistent with the other ranks--> BROKEN (step_boundary raises; BROKEN is final)
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from enum import Enum
from typing import Any, ClassVar

from dist_quant.coordinator.protocol import (
    CancelDecision,
    CancelPrepare,
    CancelVote,
    Decision,
    Message,
    Prepare,
    Vote,
)
from dist_quant.coordinator.timing import hold_step


class RankPhase(Enum):
    """The participant's phases; `Participant.state` is the value."""

    IDLE = "idle"
    PREPARING = "preparing"  # the listener plans; the training thread does not wait
    VOTED = "voted"  # voted YES; holds the candidate; waits at its hold step if still undecided
    COMMITTING = "committing"  # COMMIT known; publishes at boundary S
    CANCEL_VOTED = "cancel_voted"  # voted YES to cancel before S; holds its publish at S
    GAVE_UP = "gave_up"  # no decision in time; candidate dropped; a late COMMIT breaks the rank
    BROKEN = "broken"  # cannot stay consistent with the other ranks; step_boundary raises

    @property
    def pending(self) -> bool:
        """A boundary may have to act (wait, publish, raise); otherwise it is the fast path."""
        return self not in (RankPhase.IDLE, RankPhase.PREPARING, RankPhase.GAVE_UP)

    @property
    def accepts_prepare(self) -> bool:
        return self in (RankPhase.IDLE, RankPhase.GAVE_UP)


# Allowed changes of phase. A step that keeps the state returns the same object and needs no
# entry; COMMITTING -> COMMITTING is the next re-applied switch, held right after a publish.
TRANSITIONS: dict[RankPhase, frozenset[RankPhase]] = {
    RankPhase.IDLE: frozenset({RankPhase.PREPARING, RankPhase.COMMITTING, RankPhase.BROKEN}),
    RankPhase.PREPARING: frozenset({RankPhase.VOTED, RankPhase.IDLE, RankPhase.BROKEN}),
    RankPhase.VOTED: frozenset(
        {RankPhase.COMMITTING, RankPhase.IDLE, RankPhase.GAVE_UP, RankPhase.BROKEN}
    ),
    RankPhase.COMMITTING: frozenset(
        {RankPhase.COMMITTING, RankPhase.IDLE, RankPhase.CANCEL_VOTED, RankPhase.BROKEN}
    ),
    RankPhase.CANCEL_VOTED: frozenset({RankPhase.IDLE, RankPhase.COMMITTING, RankPhase.BROKEN}),
    RankPhase.GAVE_UP: frozenset({RankPhase.PREPARING, RankPhase.IDLE, RankPhase.BROKEN}),
    RankPhase.BROKEN: frozenset(),
}


# ---- states with their payload --------------------------------------------------------------
@dataclass(frozen=True)
class Idle:
    phase: ClassVar[RankPhase] = RankPhase.IDLE


@dataclass(frozen=True)
class Preparing:
    phase: ClassVar[RankPhase] = RankPhase.PREPARING
    switch_id: int
    give_up_at: float  # monotonic time: Prepare received + its timeout + the decision grace


@dataclass(frozen=True)
class Voted:
    phase: ClassVar[RankPhase] = RankPhase.VOTED
    switch_id: int
    candidate: Any  # the ModelPlan voted for
    vote_step: int  # the last step passed when voting
    hold_step: int  # boundaries before it pass undecided; from it on the rank waits (hold_step)
    give_up_at: float


@dataclass(frozen=True)
class Committing:
    phase: ClassVar[RankPhase] = RankPhase.COMMITTING
    switch_id: int
    candidate: Any
    step: int  # publish at this step's boundary


@dataclass(frozen=True)
class CancelVoted:
    phase: ClassVar[RankPhase] = RankPhase.CANCEL_VOTED
    switch_id: int
    candidate: Any
    step: int  # the commit step, where the publish is held until the cancel is decided
    give_up_at: float


@dataclass(frozen=True)
class GaveUp:
    phase: ClassVar[RankPhase] = RankPhase.GAVE_UP
    switch_id: int


@dataclass(frozen=True)
class Broken:
    phase: ClassVar[RankPhase] = RankPhase.BROKEN
    reason: str


State = Idle | Preparing | Voted | Committing | CancelVoted | GaveUp | Broken


@dataclass(frozen=True)
class Ledger:
    """What a rank remembers across switches (step functions return a new one, never mutate)."""

    rank: int
    newest: int = 0  # the newest switch this rank saw a Prepare for (or re-applies)
    decided: Mapping[int, tuple[bool, int | None]] = field(default_factory=dict)  # acted on
    given_up: frozenset[int] = frozenset()  # switches whose decision it stopped waiting for
    cancel_given_up: frozenset[int] = frozenset()  # cancels it stopped waiting for at S

    def deciding(self, switch_id: int, commit: bool, step: int | None) -> Ledger:
        return replace(self, decided={**self.decided, switch_id: (commit, step)})


# ---- what a step asks of the participant ------------------------------------------------------
class Boundary(Enum):
    """What the training thread does at a step boundary."""

    PASS = "pass"  # train on
    WAIT = "wait"  # wait (lock released) until the state changes or `Step.wait_until`, then again
    PUBLISH = "publish"  # publish the COMMITTING state's candidate, then `on_published`
    RAISE = "raise"  # raise SwitchError with the BROKEN state's reason


@dataclass(frozen=True)
class AckDue:
    """An Ack to send; the participant adds its recipe key (read from the model)."""

    switch_id: int
    step: int
    ok: bool
    error: str


@dataclass(frozen=True)
class Note:
    """A log line; `switch_id` None: the newest switch the rank knows."""

    level: str  # "info", "warning" or "error"
    text: str
    switch_id: int | None = None


@dataclass(frozen=True)
class Step:
    state: State
    ledger: Ledger
    send: Message | AckDue | None = None
    boundary: Boundary = Boundary.PASS
    wait_until: float = 0.0  # with WAIT: monotonic time
    notes: tuple[Note, ...] = ()


def check_transition(old: State, new: State) -> None:
    """Raise on a change the table does not allow (a bug in this file or its caller). Only a
    state object the step returned unchanged keeps its phase without a table entry."""
    if new is not old and new.phase not in TRANSITIONS[old.phase]:
        raise RuntimeError(
            f"participant bug: illegal transition {old.phase.value} -> {new.phase.value}"
        )


def _broken(state: State, ledger: Ledger, reason: str) -> Step:
    """Break the rank; a rank already broken keeps its first reason (and logs the new one)."""
    note = Note("error", reason)
    return Step(state if isinstance(state, Broken) else Broken(reason), ledger, notes=(note,))


# ---- the listener's events -------------------------------------------------------------------
def on_prepare(
    state: State, ledger: Ledger, p: Prepare, *, last_step: int | None, now: float, grace_s: float
) -> Step:
    """A Prepare arrives: PREPARING (the listener then plans), or a NO vote when busy."""
    if p.switch_id <= ledger.newest:
        return Step(
            state, ledger, notes=(Note("info", "ignored stale or replayed prepare", p.switch_id),)
        )
    seen = replace(ledger, newest=p.switch_id)
    if not state.phase.accepts_prepare:
        why = f"still {state.phase.value} for switch {ledger.newest}"
        return Step(
            state, seen, send=Vote(p.switch_id, ledger.rank, False, "", last_step, why, 0.0)
        )
    return Step(Preparing(p.switch_id, now + p.timeout_s + grace_s), seen)


def on_planned(
    state: State,
    ledger: Ledger,
    p: Prepare,
    *,
    plan: Any,
    digest: str,
    error: str,
    last_step: int | None,
    prepare_s: float,
    step_s: float = 0.0,
    part_digests: dict[str, str] | None = None,
) -> Step:
    """Planning for `p` ended (`plan` None: it failed with `error`): VOTED, or IDLE; the vote.
    VOTED holds at `hold_step`, from the rank's seconds per step `step_s` (0: unknown); the vote
    carries it, and the coordinator commits at the largest. A plan that ends after its switch was
    decided (aborted while this rank was still planning) is dropped, with no vote."""
    if not isinstance(state, Preparing) or state.switch_id != p.switch_id:
        note = Note(
            "info", "planning ended after the switch was decided: plan dropped", p.switch_id
        )
        return Step(state, ledger, notes=(note,))
    parts = dict(part_digests or {})
    if plan is None or last_step is None:  # a plan needs a first boundary (it waited for one)
        vote = Vote(
            p.switch_id, ledger.rank, False, digest, last_step, error, prepare_s, None, parts
        )
        return Step(Idle(), ledger, send=vote)
    hold = hold_step(last_step, step_s, p.lead_s, p.at_step)
    vote = Vote(p.switch_id, ledger.rank, True, digest, last_step, error, prepare_s, hold, parts)
    voted = Voted(p.switch_id, plan, last_step, hold, state.give_up_at)
    return Step(voted, ledger, send=vote)


def on_decision(state: State, ledger: Ledger, d: Decision) -> Step:
    """The coordinator's COMMIT or ABORT of a switch."""
    rank, sid = ledger.rank, d.switch_id
    seen = ledger.decided.get(sid)
    if seen is not None:
        # a decision is acted on once: an identical replay (a retry, or a message read twice from
        # the store) changes nothing; a different one cannot come from a correct coordinator
        if seen != (d.commit, d.step) and not isinstance(state, Broken):
            return _broken(
                state, ledger, f"rank {rank} got two different decisions for switch {sid}"
            )
        return Step(state, ledger, notes=(Note("info", "ignored a repeated decision", sid),))
    if sid in ledger.given_up:
        ledger = replace(ledger, given_up=ledger.given_up - {sid})
        if d.commit:
            reason = (
                f"rank {rank} gave up waiting for switch {sid} and kept its old recipe, but the "
                f"coordinator recorded COMMIT at step {d.step}; other ranks may have switched. "
                "Stop the job and restart from a checkpoint."
            )
            return replace(_broken(state, ledger, reason), send=AckDue(sid, -1, False, reason))
        if isinstance(state, GaveUp) and state.switch_id == sid:
            return Step(Idle(), ledger)
        return Step(state, ledger)
    if isinstance(state, Voted) and state.switch_id == sid:
        ledger = ledger.deciding(sid, d.commit, d.step)
        if d.commit:
            return Step(Committing(sid, state.candidate, d.step), ledger)
        return Step(Idle(), ledger)
    if sid != ledger.newest:
        return Step(state, ledger, notes=(Note("info", "ignored decision of another switch", sid),))
    if isinstance(state, Preparing) and state.switch_id == sid and not d.commit:
        # aborted (this rank was late, or held up the switch) while it still plans: free for the
        # next switch now; the plan is dropped when it ends
        note = Note("warning", "aborted before this rank voted: stopped waiting for its plan", sid)
        return Step(Idle(), ledger.deciding(sid, False, None), notes=(note,))
    if d.commit:
        # COMMIT for a switch this rank did not vote YES on: never sent by a correct coordinator;
        # continuing could run two recipes.
        return _broken(state, ledger, f"rank {rank} got COMMIT for switch {sid} without a YES vote")
    return Step(state, ledger)


def on_cancel_prepare(
    state: State,
    ledger: Ledger,
    p: CancelPrepare,
    *,
    last_step: int | None,
    now: float,
    grace_s: float,
) -> Step:
    """May the committed switch still be cancelled? YES holds the publish at S (CANCEL_VOTED)."""
    rank, sid = ledger.rank, p.switch_id
    holding = isinstance(state, Committing) and state.switch_id == sid and state.step == p.step
    if holding and (last_step is None or last_step < p.step):
        held = CancelVoted(sid, state.candidate, state.step, now + p.timeout_s + grace_s)
        return Step(held, ledger, send=CancelVote(sid, rank, True, last_step, ""))
    if holding:
        why = f"reached step {last_step}"
    elif sid in ledger.decided and isinstance(state, Idle):
        why = f"already published switch {sid} at step {p.step}"
    else:
        why = f"not holding switch {sid} ({state.phase.value})"
    return Step(state, ledger, send=CancelVote(sid, rank, False, last_step, why))


def on_cancel_decision(state: State, ledger: Ledger, d: CancelDecision) -> Step:
    """The outcome of a cancel: drop the candidate, or publish at S as committed."""
    rank, sid = ledger.rank, d.switch_id
    if sid in ledger.cancel_given_up:
        ledger = replace(ledger, cancel_given_up=ledger.cancel_given_up - {sid})
        if d.cancelled:
            reason = (
                f"rank {rank} stopped waiting for the cancel of switch {sid} and published it at "
                f"step {d.step}, but the coordinator recorded the cancel; other ranks kept their "
                "recipe. Stop the job and restart from a checkpoint."
            )
            return _broken(state, ledger, reason)
        return Step(state, ledger)
    if isinstance(state, CancelVoted) and state.switch_id == sid:
        if d.cancelled:
            return Step(Idle(), ledger)
        return Step(Committing(sid, state.candidate, state.step), ledger)
    if d.cancelled and sid == ledger.newest:
        # never sent by a correct coordinator without this rank's YES
        return _broken(
            state, ledger, f"rank {rank} got a cancel of switch {sid} it did not vote for"
        )
    return Step(state, ledger)


# ---- the training thread's events ------------------------------------------------------------
def on_boundary(state: State, ledger: Ledger, *, step: int, now: float) -> Step:
    """What the boundary of `step` does, at time `now`. WAIT is asked again once the state
    changed or `wait_until` passed."""
    if isinstance(state, Broken):
        return Step(state, ledger, boundary=Boundary.RAISE)
    if isinstance(state, Voted) and step >= state.hold_step:
        if now < state.give_up_at:
            note = Note("info", "waiting for the decision")
            return Step(
                state, ledger, boundary=Boundary.WAIT, wait_until=state.give_up_at, notes=(note,)
            )
        note = Note(
            "warning", "no decision in time: dropped the candidate, training on with the old recipe"
        )
        gave_up = replace(ledger, given_up=ledger.given_up | {state.switch_id})
        return Step(GaveUp(state.switch_id), gave_up, notes=(note,))
    if isinstance(state, CancelVoted) and step >= state.step:
        if now < state.give_up_at:
            note = Note("info", "waiting for the cancel decision")
            return Step(
                state, ledger, boundary=Boundary.WAIT, wait_until=state.give_up_at, notes=(note,)
            )
        note = Note("warning", "no cancel decision in time: publishing the committed switch")
        stopped = replace(ledger, cancel_given_up=ledger.cancel_given_up | {state.switch_id})
        committing = Committing(state.switch_id, state.candidate, state.step)
        after = on_boundary(committing, stopped, step=step, now=now)
        return replace(after, notes=(note, *after.notes))
    if isinstance(state, Committing) and step > state.step:
        reason = (
            f"rank {ledger.rank} reached step {step} without a step_boundary at the commit step "
            f"{state.step} of switch {state.switch_id}; call step_boundary for every step"
        )
        return replace(_broken(state, ledger, reason), boundary=Boundary.RAISE)
    if isinstance(state, Committing) and step == state.step:
        return Step(state, ledger, boundary=Boundary.PUBLISH)
    return Step(state, ledger)


def reapplying(state: State, ledger: Ledger, entry: Mapping[str, Any], plan: Any) -> Step:
    """Hold a re-applied switch `{"switch_id", "step", "recipe"}` (planned as `plan`) as
    COMMITTING for its step, as if its COMMIT had just arrived."""
    sid, at = entry["switch_id"], entry["step"]
    ledger = replace(ledger.deciding(sid, True, at), newest=max(ledger.newest, sid))
    note = Note("info", f"re-applies switch {sid} at step {at}")
    return Step(Committing(sid, plan, at), ledger, notes=(note,))


def on_published(
    state: State,
    ledger: Ledger,
    *,
    switch_id: int,
    step: int,
    error: str,
    then: tuple[Mapping[str, Any], Any] | None = None,
) -> Step:
    """The boundary of `step` published switch `switch_id` (`error`: how it failed). IDLE, or
    COMMITTING for `then` (the next re-applied switch and its plan), or BROKEN; with the Ack."""
    ack = AckDue(switch_id, step, not error, error)
    if error:
        reason = f"rank {ledger.rank} failed to publish switch {switch_id}: {error}"
        return replace(_broken(state, ledger, reason), send=ack)
    if isinstance(state, Broken):  # broken by the listener meanwhile: stays so
        return Step(state, ledger, send=ack)
    if then is not None:
        return replace(reapplying(state, ledger, *then), send=ack)
    return Step(Idle(), ledger, send=ack)


__all__ = [
    "TRANSITIONS",
    "AckDue",
    "Boundary",
    "Broken",
    "CancelVoted",
    "Committing",
    "GaveUp",
    "Idle",
    "Ledger",
    "Note",
    "Preparing",
    "RankPhase",
    "State",
    "Step",
    "Voted",
    "check_transition",
    "on_boundary",
    "on_cancel_decision",
    "on_cancel_prepare",
    "on_decision",
    "on_planned",
    "on_prepare",
    "on_published",
    "reapplying",
]
