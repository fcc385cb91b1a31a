"""The participant's pure step functions as tables: (state, ledger, event) -> (state, ledger, what
it sends, what the boundary does), like `decide()`'s tests, plus the transition table itself.

What these catch: a rank that publishes without a COMMIT or twice, one that keeps training on its
old recipe after the others switched without breaking loudly, a late or repeated message that
changes a decided switch, a boundary that waits forever or not at all, and any step that changes
the state along a path the table does not allow (every step function, every state, every event).
"""

import itertools

import pytest
from dist_quant.coordinator.participant_state import (
    TRANSITIONS,
    AckDue,
    Boundary,
    Broken,
    CancelVoted,
    Committing,
    GaveUp,
    Idle,
    Ledger,
    Preparing,
    RankPhase,
    Voted,
    check_transition,
    on_boundary,
    on_cancel_decision,
    on_cancel_prepare,
    on_decision,
    on_planned,
    on_prepare,
    on_published,
    reapplying,
)
from dist_quant.coordinator.protocol import (
    CancelDecision,
    CancelPrepare,
    CancelVote,
    Decision,
    Prepare,
    Vote,
)

RANK = 1
PLAN, NEXT_PLAN = "plan of switch 3", "plan of the re-applied switch 5"
GRACE = 1.0


def ledger(newest=3, decided=None, given_up=(), cancel_given_up=()):
    return Ledger(
        RANK, newest, dict(decided or {}), frozenset(given_up), frozenset(cancel_given_up)
    )


VOTED = Voted(3, PLAN, 5, 6, 10.0)  # voted YES at step 5; gives up at t=10
HOLDING = Voted(3, PLAN, 5, 9, 10.0)  # the same, its commit booked ahead: holds step 9
COMMITTING = Committing(3, PLAN, 8)  # publishes at step 8
CANCEL_VOTED = CancelVoted(3, PLAN, 8, 10.0)
BROKEN = Broken("an earlier reason")

# One sample of every state (with the ledger it has in a real run), for the exhaustive checks.
SAMPLES = [
    (Idle(), ledger()),
    (Idle(), ledger(decided={3: (True, 8)})),
    (Preparing(3, 10.0), ledger()),
    (VOTED, ledger()),
    (COMMITTING, ledger(decided={3: (True, 8)})),
    (CANCEL_VOTED, ledger(decided={3: (True, 8)})),
    (GaveUp(3), ledger(given_up={3})),
    (Idle(), ledger(newest=4, given_up={3}, cancel_given_up={2})),
    (BROKEN, ledger()),
]


# ---- on_decision -------------------------------------------------------------------------------
def commit(switch_id=3, step=8):
    return Decision(switch_id, True, step, {}, "")


def abort(switch_id=3):
    return Decision(switch_id, False, None, {0: "no"}, "")


# (name, state, ledger, decision, expected state, expected ledger, expected send): a state given as
# a string is a Broken state whose reason contains it.
DECISION_CASES = [
    (
        "ABORT while the rank still plans frees it for the next switch",
        Preparing(3, 10.0),
        ledger(),
        abort(),
        Idle(),
        ledger(decided={3: (False, None)}),
        None,
    ),
    (
        "COMMIT after a YES -> committing for its step",
        VOTED,
        ledger(),
        commit(),
        COMMITTING,
        ledger(decided={3: (True, 8)}),
        None,
    ),
    (
        "ABORT after a YES drops the candidate",
        VOTED,
        ledger(),
        abort(),
        Idle(),
        ledger(decided={3: (False, None)}),
        None,
    ),
    (
        "COMMIT of the voted switch after a newer busy Prepare still commits",
        VOTED,
        ledger(newest=4),
        commit(),
        COMMITTING,
        ledger(newest=4, decided={3: (True, 8)}),
        None,
    ),
    (
        "an identical replay changes nothing",
        COMMITTING,
        ledger(decided={3: (True, 8)}),
        commit(),
        COMMITTING,
        ledger(decided={3: (True, 8)}),
        None,
    ),
    (
        "a replay that differs breaks the rank",
        COMMITTING,
        ledger(decided={3: (True, 8)}),
        commit(step=9),
        "two different decisions for switch 3",
        ledger(decided={3: (True, 8)}),
        None,
    ),
    (
        "a broken rank keeps its first reason",
        BROKEN,
        ledger(decided={3: (True, 8)}),
        abort(),
        "an earlier reason",
        ledger(decided={3: (True, 8)}),
        None,
    ),
    (
        "COMMIT after giving up breaks the rank and acks the failure",
        GaveUp(3),
        ledger(given_up={3}),
        commit(),
        "gave up waiting for switch 3",
        ledger(),
        "ack failed",
    ),
    (
        "ABORT after giving up -> idle",
        GaveUp(3),
        ledger(given_up={3}),
        abort(),
        Idle(),
        ledger(),
        None,
    ),
    (
        "a late ABORT of an older given-up switch leaves the newer one given up",
        GaveUp(3),
        ledger(given_up={2, 3}),
        abort(2),
        GaveUp(3),
        ledger(given_up={3}),
        None,
    ),
    (
        "a late ABORT of a given-up switch while preparing the next leaves it preparing",
        Preparing(4, 20.0),
        ledger(newest=4, given_up={3}),
        abort(),
        Preparing(4, 20.0),
        ledger(newest=4),
        None,
    ),
    (
        "a late COMMIT of a given-up switch breaks a rank voting on the next",
        Voted(4, PLAN, 6, 7, 20.0),
        ledger(newest=4, given_up={3}),
        commit(),
        "gave up waiting for switch 3",
        ledger(newest=4),
        "ack failed",
    ),
    (
        "a decision of an older switch is ignored",
        Idle(),
        ledger(newest=4),
        commit(),
        Idle(),
        ledger(newest=4),
        None,
    ),
    (
        "COMMIT without a YES vote breaks the rank",
        Idle(),
        ledger(),
        commit(),
        "COMMIT for switch 3 without a YES vote",
        ledger(),
        None,
    ),
    ("ABORT after a NO vote changes nothing", Idle(), ledger(), abort(), Idle(), ledger(), None),
]


def check_state(got, expected):
    if isinstance(expected, str):
        assert isinstance(got, Broken) and expected in got.reason, got
    else:
        assert got == expected


@pytest.mark.parametrize(
    "state, book, decision, want, want_ledger, want_send",
    [c[1:] for c in DECISION_CASES],
    ids=[c[0] for c in DECISION_CASES],
)
def test_on_decision(state, book, decision, want, want_ledger, want_send):
    step = on_decision(state, book, decision)
    check_state(step.state, want)
    assert step.ledger == want_ledger
    if want_send is None:
        assert step.send is None
    else:  # the coordinator hears this rank failed to publish the switch (step -1: never)
        assert step.send == AckDue(3, -1, False, step.send.error)
        assert "gave up waiting for switch 3" in step.send.error


# ---- on_boundary -------------------------------------------------------------------------------
# (name, state, ledger, step, now, expected state, expected ledger, boundary, wait_until)
BOUNDARY_CASES = [
    ("idle: train on", Idle(), ledger(), 7, 0.0, Idle(), ledger(), Boundary.PASS, 0.0),
    ("gave up: train on", GaveUp(3), ledger(), 7, 0.0, GaveUp(3), ledger(), Boundary.PASS, 0.0),
    (
        "preparing: the listener plans, train on",
        Preparing(3, 10.0),
        ledger(),
        7,
        0.0,
        Preparing(3, 10.0),
        ledger(),
        Boundary.PASS,
        0.0,
    ),
    ("broken: raise", BROKEN, ledger(), 7, 0.0, BROKEN, ledger(), Boundary.RAISE, 0.0),
    (
        "voted at step 5, boundary 5 again: no wait",
        VOTED,
        ledger(),
        5,
        0.0,
        VOTED,
        ledger(),
        Boundary.PASS,
        0.0,
    ),
    (
        "voted, boundary v+1 before the give-up time: wait for the decision",
        VOTED,
        ledger(),
        6,
        9.0,
        VOTED,
        ledger(),
        Boundary.WAIT,
        10.0,
    ),
    (
        "voted, boundary v+1 at the give-up time: drop the candidate",
        VOTED,
        ledger(),
        6,
        10.0,
        GaveUp(3),
        ledger(given_up={3}),
        Boundary.PASS,
        0.0,
    ),
    (
        "voted, holding step 9: boundary 8 trains on undecided",
        HOLDING,
        ledger(),
        8,
        9.0,
        HOLDING,
        ledger(),
        Boundary.PASS,
        0.0,
    ),
    (
        "voted, holding step 9: boundary 9 waits for the decision",
        HOLDING,
        ledger(),
        9,
        9.0,
        HOLDING,
        ledger(),
        Boundary.WAIT,
        10.0,
    ),
    (
        "voted, holding step 9: boundary 9 past the give-up time drops the candidate",
        HOLDING,
        ledger(),
        9,
        10.0,
        GaveUp(3),
        ledger(given_up={3}),
        Boundary.PASS,
        0.0,
    ),
    (
        "committing, before S",
        COMMITTING,
        ledger(),
        7,
        0.0,
        COMMITTING,
        ledger(),
        Boundary.PASS,
        0.0,
    ),
    (
        "committing, at S: publish",
        COMMITTING,
        ledger(),
        8,
        0.0,
        COMMITTING,
        ledger(),
        Boundary.PUBLISH,
        0.0,
    ),
    (
        "committing, past S (a skipped boundary): break and raise",
        COMMITTING,
        ledger(),
        9,
        0.0,
        "reached step 9 without a step_boundary at the commit step 8",
        ledger(),
        Boundary.RAISE,
        0.0,
    ),
    (
        "cancel voted, before S: train on",
        CANCEL_VOTED,
        ledger(),
        7,
        99.0,
        CANCEL_VOTED,
        ledger(),
        Boundary.PASS,
        0.0,
    ),
    (
        "cancel voted, at S before the give-up time: hold the publish",
        CANCEL_VOTED,
        ledger(),
        8,
        9.0,
        CANCEL_VOTED,
        ledger(),
        Boundary.WAIT,
        10.0,
    ),
    (
        "cancel voted, at S at the give-up time: publish as committed",
        CANCEL_VOTED,
        ledger(),
        8,
        10.0,
        COMMITTING,
        ledger(cancel_given_up={3}),
        Boundary.PUBLISH,
        0.0,
    ),
    (
        "cancel voted, past S at the give-up time: break and raise",
        CANCEL_VOTED,
        ledger(),
        9,
        10.0,
        "reached step 9 without a step_boundary",
        ledger(cancel_given_up={3}),
        Boundary.RAISE,
        0.0,
    ),
]


@pytest.mark.parametrize(
    "state, book, at, now, want, want_ledger, boundary, wait_until",
    [c[1:] for c in BOUNDARY_CASES],
    ids=[c[0] for c in BOUNDARY_CASES],
)
def test_on_boundary(state, book, at, now, want, want_ledger, boundary, wait_until):
    step = on_boundary(state, book, step=at, now=now)
    check_state(step.state, want)
    assert step.ledger == want_ledger
    assert step.boundary is boundary
    assert step.wait_until == wait_until
    assert step.send is None  # the training thread sends only the ack of a publish


# ---- prepare and planning ----------------------------------------------------------------------
PREPARE = Prepare(4, "current", None, 5.0)


@pytest.mark.parametrize(
    "state, want, want_vote_reason",
    [
        (Idle(), Preparing(4, 100.0 + 5.0 + GRACE), None),
        (GaveUp(3), Preparing(4, 100.0 + 5.0 + GRACE), None),
        (VOTED, VOTED, "still voted for switch 3"),
        (COMMITTING, COMMITTING, "still committing for switch 3"),
        (BROKEN, BROKEN, "still broken for switch 3"),
    ],
    ids=["idle", "gave up", "busy voting", "busy committing", "broken"],
)
def test_on_prepare_opens_a_switch_or_votes_no_while_busy(state, want, want_vote_reason):
    step = on_prepare(state, ledger(), PREPARE, last_step=6, now=100.0, grace_s=GRACE)
    assert step.state == want
    assert step.ledger == ledger(newest=4)  # a busy rank still knows switch 4 was opened
    if want_vote_reason is None:
        assert step.send is None
    else:
        assert step.send == Vote(4, RANK, False, "", 6, want_vote_reason, 0.0)


@pytest.mark.parametrize("switch_id", [2, 3], ids=["stale", "replayed"])
def test_on_prepare_ignores_a_stale_or_replayed_prepare(switch_id):
    step = on_prepare(
        Idle(), ledger(), Prepare(switch_id, "current", None, 5.0), last_step=6, now=0, grace_s=1
    )
    assert (step.state, step.ledger, step.send) == (Idle(), ledger(), None)


def test_on_planned_votes_yes_with_the_digest_and_the_step_it_votes_at():
    step = on_planned(
        Preparing(4, 106.0),
        ledger(newest=4),
        PREPARE,
        plan=PLAN,
        digest="abc",
        error="",
        last_step=7,
        prepare_s=0.25,
    )
    assert step.state == Voted(4, PLAN, 7, 8, 106.0)
    assert step.send == Vote(4, RANK, True, "abc", 7, "", 0.25, 8)


@pytest.mark.parametrize(
    "at_step, lead_s, step_s, hold",
    [
        (None, 0.0, 0.1, 8),  # no lead: hold the next boundary
        (None, 0.5, 0.1, 13),  # 7 + 1 + 0.5 s / 0.1 s
        (None, 0.5, 0.0, 8),  # pace not measured yet: the next boundary
        (30, 0.5, 0.1, 30),  # a requested step: trains on undecided up to it
    ],
)
def test_on_planned_holds_the_step_the_lead_reaches_at_the_rank_pace_and_votes_it(
    at_step, lead_s, step_s, hold
):
    prepare = Prepare(4, "current", at_step, 5.0, lead_s)
    step = on_planned(
        Preparing(4, 106.0),
        ledger(newest=4),
        prepare,
        plan=PLAN,
        digest="abc",
        error="",
        last_step=7,
        prepare_s=0.25,
        step_s=step_s,
    )
    assert step.state == Voted(4, PLAN, 7, hold, 106.0)
    assert step.send == Vote(4, RANK, True, "abc", 7, "", 0.25, hold)


@pytest.mark.parametrize(
    "state", [Idle(), Preparing(5, 106.0)], ids=["aborted meanwhile", "next switch preparing"]
)
def test_on_planned_after_the_switch_was_decided_drops_the_plan_without_a_vote(state):
    book = ledger(newest=5, decided={4: (False, None)})
    step = on_planned(
        state, book, PREPARE, plan=PLAN, digest="abc", error="", last_step=7, prepare_s=9.0
    )
    assert (step.state, step.ledger, step.send) == (state, book, None)


def test_on_planned_failure_votes_no_with_the_error_and_goes_idle():
    step = on_planned(
        Preparing(4, 106.0),
        ledger(newest=4),
        PREPARE,
        plan=None,
        digest="",
        error="ValueError: bad",
        last_step=7,
        prepare_s=0.25,
    )
    assert step.state == Idle()
    assert step.send == Vote(4, RANK, False, "", 7, "ValueError: bad", 0.25)


# ---- cancel ------------------------------------------------------------------------------------
CANCEL = CancelPrepare(3, 8, 2.0)


@pytest.mark.parametrize(
    "state, book, last, want, yes, reason",
    [
        (COMMITTING, ledger(), 7, CancelVoted(3, PLAN, 8, 100.0 + 2.0 + GRACE), True, ""),
        (COMMITTING, ledger(), None, CancelVoted(3, PLAN, 8, 103.0), True, ""),
        (COMMITTING, ledger(), 8, COMMITTING, False, "reached step 8"),
        (Idle(), ledger(decided={3: (True, 8)}), 9, Idle(), False, "already published switch 3"),
        (VOTED, ledger(), 5, VOTED, False, "not holding switch 3 (voted)"),
        (Committing(3, PLAN, 9), ledger(), 5, Committing(3, PLAN, 9), False, "not holding"),
    ],
    ids=[
        "before S",
        "before the first boundary",
        "at S",
        "published",
        "not committed",
        "another step",
    ],
)
def test_on_cancel_prepare(state, book, last, want, yes, reason):
    step = on_cancel_prepare(state, book, CANCEL, last_step=last, now=100.0, grace_s=GRACE)
    assert step.state == want and step.ledger == book
    assert isinstance(step.send, CancelVote) and (step.send.yes, step.send.last_step) == (yes, last)
    assert reason in step.send.reason


def cancel_outcome(cancelled):
    return CancelDecision(3, cancelled, 8, {}, "")


@pytest.mark.parametrize(
    "state, book, cancelled, want, want_ledger",
    [
        (CANCEL_VOTED, ledger(), True, Idle(), ledger()),
        (CANCEL_VOTED, ledger(), False, COMMITTING, ledger()),
        (COMMITTING, ledger(cancel_given_up={3}), False, COMMITTING, ledger()),
        (Idle(), ledger(cancel_given_up={3}), True, "stopped waiting for the cancel", ledger()),
        (COMMITTING, ledger(), True, "a cancel of switch 3 it did not vote for", ledger()),
        (COMMITTING, ledger(), False, COMMITTING, ledger()),
        (Idle(), ledger(newest=4), True, Idle(), ledger(newest=4)),
    ],
    ids=[
        "cancelled: drop the candidate",
        "not cancelled: publish at S",
        "not cancelled after this rank stopped waiting: as published",
        "cancelled after this rank published: broken",
        "cancelled without this rank's YES: broken",
        "a refusal it did not vote on changes nothing",
        "an older switch's cancel is ignored",
    ],
)
def test_on_cancel_decision(state, book, cancelled, want, want_ledger):
    step = on_cancel_decision(state, book, cancel_outcome(cancelled))
    check_state(step.state, want)
    assert step.ledger == want_ledger and step.send is None


# ---- publish and re-applied switches -----------------------------------------------------------
REAPPLY = {"switch_id": 5, "step": 12, "recipe": "mxfp8"}


@pytest.mark.parametrize(
    "state, error, then, want, want_ledger",
    [
        (COMMITTING, "", None, Idle(), ledger()),
        (
            COMMITTING,
            "RuntimeError: oom",
            None,
            "failed to publish switch 3: RuntimeError",
            ledger(),
        ),
        (BROKEN, "", None, BROKEN, ledger()),
        (
            COMMITTING,
            "",
            (REAPPLY, NEXT_PLAN),
            Committing(5, NEXT_PLAN, 12),
            ledger(newest=5, decided={5: (True, 12)}),
        ),
    ],
    ids=["ok", "failed", "broken meanwhile", "next re-applied switch"],
)
def test_on_published_acks_and_moves_on(state, error, then, want, want_ledger):
    step = on_published(state, ledger(), switch_id=3, step=8, error=error, then=then)
    check_state(step.state, want)
    assert step.ledger == want_ledger
    assert step.send == AckDue(3, 8, not error, error)


def test_a_reapplied_switch_is_held_as_committed_for_its_step():
    step = reapplying(Idle(), ledger(newest=0), REAPPLY, NEXT_PLAN)
    assert step.state == Committing(5, NEXT_PLAN, 12)
    assert step.ledger == ledger(newest=5, decided={5: (True, 12)})
    # its COMMIT, replayed by nobody but a confused peer, is a repeat, not a second decision
    assert on_decision(step.state, step.ledger, commit(5, 12)).state == step.state


# ---- the table ---------------------------------------------------------------------------------
def every_step(state, book):
    """Every step function applied to `state`, with events of switches 2..5."""
    for sid, at in itertools.product((2, 3, 4, 5), (7, 8, 9)):
        yield on_decision(state, book, Decision(sid, True, at, {}, ""))
        yield on_decision(state, book, Decision(sid, False, None, {}, ""))
        yield on_cancel_decision(state, book, CancelDecision(sid, True, at, {}, ""))
        yield on_cancel_decision(state, book, CancelDecision(sid, False, at, {}, ""))
        yield on_cancel_prepare(
            state, book, CancelPrepare(sid, at, 1.0), last_step=at - 1, now=0, grace_s=1
        )
        yield on_prepare(state, book, Prepare(sid, "x", None, 1.0), last_step=at, now=0, grace_s=1)
        for now in (0.0, 10.0):
            yield on_boundary(state, book, step=at, now=now)
    if isinstance(state, Preparing):
        for plan in (PLAN, None):
            p = Prepare(state.switch_id, "x", None, 1.0)
            yield on_planned(
                state, book, p, plan=plan, digest="", error="", last_step=6, prepare_s=0
            )
    if isinstance(state, (Committing, Broken)):
        for error, then in itertools.product(("", "boom"), (None, (REAPPLY, NEXT_PLAN))):
            yield on_published(state, book, switch_id=3, step=8, error=error, then=then)
    if isinstance(state, Idle):
        yield reapplying(state, book, REAPPLY, NEXT_PLAN)


@pytest.mark.parametrize(
    "state, book", SAMPLES, ids=[f"{s.phase.value}-{i}" for i, (s, _) in enumerate(SAMPLES)]
)
def test_every_step_from_every_state_follows_the_transition_table(state, book):
    for step in every_step(state, book):
        check_transition(state, step.state)  # raises on a change the table does not allow
        if isinstance(state, Broken):
            assert step.state is state  # broken is final, with its first reason
        assert step.ledger.rank == RANK and step.ledger.newest >= book.newest


def test_the_table_refuses_every_change_it_does_not_list():
    examples = {
        RankPhase.IDLE: Idle(),
        RankPhase.PREPARING: Preparing(3, 1.0),
        RankPhase.VOTED: VOTED,
        RankPhase.COMMITTING: COMMITTING,
        RankPhase.CANCEL_VOTED: CANCEL_VOTED,
        RankPhase.GAVE_UP: GaveUp(3),
        RankPhase.BROKEN: BROKEN,
    }
    for old, new in itertools.product(RankPhase, RankPhase):
        fresh = Committing(4, NEXT_PLAN, 9) if new is RankPhase.COMMITTING else examples[new]
        if fresh is examples[old]:
            continue
        if new in TRANSITIONS[old]:
            check_transition(examples[old], fresh)
        else:
            with pytest.raises(RuntimeError, match="illegal transition"):
                check_transition(examples[old], fresh)
    assert TRANSITIONS[RankPhase.BROKEN] == frozenset()
    # skipping the vote, or publishing without a decision, is never a transition
    assert RankPhase.VOTED not in TRANSITIONS[RankPhase.IDLE]
    assert RankPhase.COMMITTING not in TRANSITIONS[RankPhase.PREPARING]


def test_only_states_with_a_boundary_action_leave_the_fast_path():
    assert {p for p in RankPhase if not p.pending} == {
        RankPhase.IDLE,
        RankPhase.PREPARING,
        RankPhase.GAVE_UP,
    }
    for state, book in SAMPLES:  # a fast-path state's boundary never acts
        if not state.phase.pending:
            for at, now in itertools.product((5, 8, 9), (0.0, 99.0)):
                step = on_boundary(state, book, step=at, now=now)
                assert (step.state, step.boundary) == (state, Boundary.PASS)
