"""The coordinator's state machine as tables: each step function from each state, its next state,
reply, record and broadcast; taking messages in never changes the phase; every step from every
state is allowed by `phases.TRANSITIONS`."""

import pytest
from dist_quant.coordinator import coordinator_intake as intake
from dist_quant.coordinator import coordinator_state as cs
from dist_quant.coordinator.phases import TRANSITIONS, Phase
from dist_quant.coordinator.protocol import (
    Ack,
    Alive,
    CancelDecision,
    CancelPrepare,
    CancelRequest,
    CancelVote,
    Decision,
    Prepare,
    SwitchRequest,
    Vote,
)

WORLD = 4
TP = ((0, 1), (2, 3))
PREPARE = Prepare(3, {"name": "B"}, None, 2.0)
OPENED = cs.Opened(PREPARE, "req-3", 100.0, 102.0)


def yes(rank, step=10, switch_id=3):
    return Vote(switch_id, rank, True, "d", step, "", 0.01, step + 1)


def tally(*msgs):
    t = cs.Tally(WORLD)
    for m in msgs:
        assert t.add(m.rank, m) == ""
    return t


def preparing(*votes, heard=None):
    lease = cs.Lease(100.1)  # the Prepare reached every rank's queue at t=100.1
    lease.heard.update(heard or {})
    return cs.Preparing(OPENED, tally(*votes), lease)


COMMIT = Decision(3, True, 11, {}, "commit at step 11")
ABORT = Decision(3, False, None, {1: "boom"}, "rank 1: boom")


def settled(decision=COMMIT):
    return cs.Settled(OPENED, tally(*(yes(r) for r in range(WORLD))), decision, 100.5, 0.01)


def committed(*acks):
    return cs.Committed(settled(), tally(*acks))


def cancelling(*votes):
    prepare = CancelPrepare(3, 11, 1.0)
    return cs.Cancelling(committed(), prepare, "cancel-1", 200.0, tally(*votes))


EVERY_STATE = {
    "idle": cs.Idle(),
    "preparing": preparing(yes(0)),
    "deciding": cs.Deciding(OPENED, tally(), COMMIT, 100.5),
    "committed": committed(),
    "cancelling": cancelling(),
    "published": cs.Published(settled()),
    "aborted": cs.Aborted(settled(ABORT)),
    "cancelled": cs.Cancelled(settled()),
}


def request(at_step=None, timeout_s=5.0, rid="req-9"):
    return SwitchRequest(rid, {"name": "C"}, at_step, timeout_s)


@pytest.mark.parametrize("name", ["idle", "published", "aborted", "cancelled"])
def test_a_request_after_the_last_switch_ended_opens_the_next(name):
    step = cs.on_request(EVERY_STATE[name], request(), switch_id=9, world_size=WORLD, now=50.0)
    prepare = Prepare(9, {"name": "C"}, None, 5.0)
    assert step.state.opened == cs.Opened(prepare, "req-9", 50.0, 55.0)
    assert step.state.lease.since == 50.0 and step.state.lease.heard == {}
    assert step.state.votes.by_rank == {} and step.state.votes.world_size == WORLD
    assert (step.reply.status, step.reply.switch_id) == ("accepted", 9)
    assert step.record == {"event": "open", "request_id": "req-9", **prepare.to_dict()}
    assert step.broadcast == prepare


@pytest.mark.parametrize(
    "name, words",
    [
        ("preparing", "switch 3 is still open (switch 3: ranks are voting); retry after it ends"),
        ("deciding", "(switch 3: the decision is being logged)"),
        ("committed", "committed, ranks publish at step 11); retry after it ends; `dist-quant "
         "cancel 3` cancels it"),
        ("cancelling", "(switch 3: committed at step 11, a cancel is being voted)"),
    ],
)  # fmt: skip
def test_a_request_while_a_switch_is_open_is_refused_with_its_id(name, words):
    state = EVERY_STATE[name]
    step = cs.on_request(state, request(), switch_id=9, world_size=WORLD, now=50.0)
    assert step.state is state and step.record is None and step.broadcast is None
    assert (step.reply.status, step.reply.switch_id) == ("refused", 3)
    assert words in step.reply.error


@pytest.mark.parametrize(
    "req, error",
    [
        (request(timeout_s=0.0), "timeout_s must be a positive number of seconds, got 0.0"),
        (request(timeout_s=float("inf")), "timeout_s must be a positive number of seconds"),
        (request(at_step=-1), "at_step must be >= 0, got -1"),
    ],
)
def test_an_invalid_request_is_refused_and_opens_nothing(req, error):
    step = cs.on_request(cs.Idle(), req, switch_id=1, world_size=WORLD, now=0.0)
    assert isinstance(step.state, cs.Idle) and step.record is None and step.broadcast is None
    assert step.reply.status == "refused" and error in step.reply.error


def test_an_open_record_that_cannot_be_logged_decides_abort_with_the_reason():
    step = cs.on_open_failed(preparing(), "disk full", now=100.2)
    assert step.state == cs.Deciding(OPENED, step.state.votes, Decision(3, False, None, {},
                                     "disk full"), 100.2)  # fmt: skip
    assert step.broadcast is None and step.reply is None


# (name, state, message, note, kept): taking a message in returns a log line, keeps the phase
TAKE_CASES = [
    ("a vote of the open round counts", preparing(), yes(2), "rank 2 votes yes", True),
    (
        "a vote for another switch is stale",
        preparing(),
        yes(2, switch_id=2),
        "ignored vote of rank 2: stale or too late",
        False,
    ),
    ("a second vote of a rank", preparing(yes(2)), yes(2), "ignored vote: repeated", False),
    ("a vote of an unknown rank", preparing(), yes(7), "ignored vote: unknown rank 7", False),
    ("a vote once decided", EVERY_STATE["deciding"], yes(2), "stale or too late", False),
    ("an ack counts", committed(), Ack(3, 1, 11, True, "", "B"), "", True),
    (
        "a failed ack counts and is reported",
        committed(),
        Ack(3, 1, 11, False, "boom", "A"),
        "rank 1 failed to publish: boom",
        True,
    ),
    ("an ack while a cancel is voted", cancelling(), Ack(3, 1, 11, True, "", "B"), "", True),
    ("an ack of an ended switch", EVERY_STATE["published"], Ack(3, 1, 11, True, "", "B"), "", False),
    ("a cancel vote", cancelling(), CancelVote(3, 0, True, 9, ""), "rank 0 votes yes to cancel",
     True),
    ("a cancel vote, no cancel open", committed(), CancelVote(3, 0, True, 9, ""),
     "ignored cancel vote of rank 0: stale or too late", False),
]  # fmt: skip


@pytest.mark.parametrize(
    "state, msg, note, kept", [c[1:] for c in TAKE_CASES], ids=[c[0] for c in TAKE_CASES]
)
def test_taking_a_message_in_counts_it_or_says_why_not_and_never_moves_the_phase(
    state, msg, note, kept
):
    take = {Vote: intake.take_vote, CancelVote: intake.take_cancel_vote, Ack: intake.take_ack}[
        type(msg)
    ]
    tallies = [t for t in vars(state).values() if isinstance(t, cs.Tally)]
    if isinstance(state, cs.Cancelling):
        tallies.append(state.committed.acks)
    before = [dict(t.by_rank) for t in tallies]
    got = take(state, msg)
    assert note in got if note else got == ""
    added = [
        [(r, m) for r, m in t.by_rank.items() if r not in b or b[r] is not m]
        for t, b in zip(tallies, before, strict=True)
    ]  # messages carry dicts (a vote's part digests): compared, never hashed
    assert [a for a in added if a] == ([[(msg.rank, msg)]] if kept else [])


# (name, state, now, expected): expected is "same", ("deciding", decision) or "published"
TALLY_CASES = [
    ("votes missing before the deadline", preparing(yes(0), yes(1), yes(2)), 101.0, "same"),
    (
        "every rank voted yes -> commit one past the largest step",
        preparing(yes(0, 10), yes(1, 12), yes(2, 11), yes(3, 10)),
        101.0,
        ("deciding", Decision(3, True, 13, {}, "commit at step 13")),
    ),
    (
        "deadline passed with a vote missing",
        preparing(yes(0), yes(1), yes(2)),
        102.0,
        ("deciding", Decision(3, False, None, {3: "no vote before the deadline (2 s)"},
                              "rank 3: no vote before the deadline (2 s)")),
    ),
    ("committed, an ack missing", committed(*(Ack(3, r, 11, True, "", "B") for r in range(3))),
     101.0, "same"),
    ("committed, every rank acked", committed(*(Ack(3, r, 11, True, "", "B") for r in range(4))),
     101.0, "published"),
    ("idle", cs.Idle(), 0.0, "same"),
]  # fmt: skip


@pytest.mark.parametrize(
    "state, now, expected", [c[1:] for c in TALLY_CASES], ids=[c[0] for c in TALLY_CASES]
)
def test_the_phase_moves_on_once_the_tally_is_complete_or_the_deadline_passed(state, now, expected):
    step = cs.on_tally(state, now=now, drained_to=now, tp_groups=TP)
    if expected == "same":
        assert step.state is state
    elif expected == "published":
        assert step.state == cs.Published(state.settled)
    else:
        assert step.state == cs.Deciding(OPENED, state.votes, expected[1], now)
    assert step.broadcast is None and step.reply is None


@pytest.mark.parametrize("decision, phase", [(COMMIT, Phase.COMMITTED), (ABORT, Phase.ABORTED)])
def test_a_logged_decision_goes_to_every_rank_and_the_result_to_the_client(decision, phase):
    deciding = cs.Deciding(OPENED, tally(yes(0), yes(1)), decision, 100.5)
    step = cs.on_logged(deciding, decision, log_s=0.25)
    assert step.state.phase is phase and step.state.settled.log_s == 0.25
    assert step.state.settled.decision == decision and step.record is None
    # every rank gets the verdict; the per-rank reasons go to the client (below) alone
    assert step.broadcast == Decision(3, decision.commit, decision.step, {}, decision.summary)
    assert (step.reply.request_id, step.reply.status) == ("req-3", "result")
    body = step.reply.body
    assert (body["committed"], body["step"], body["reasons"]) == (
        decision.commit,
        decision.step,
        decision.reasons,
    )
    assert body["timings"] == {"votes_s": 0.5, "log_s": 0.25, "total_s": 0.75}
    assert body["prepare_s"] == {0: 0.01, 1: 0.01}
    if decision.commit:
        assert step.state.acks.by_rank == {} and step.state.acks.world_size == WORLD


def test_only_the_open_committed_switch_can_be_cancelled():
    step = cs.on_cancel_request(committed(), CancelRequest("c", None, 1.5), now=300.0)
    assert isinstance(step.state, cs.Cancelling) and step.state.deadline == 301.5
    assert step.broadcast == CancelPrepare(3, 11, 1.5) and step.reply.status == "accepted"
    refusals = {
        "idle": "no switch is open: nothing to cancel",
        "preparing": "switch 3 cannot be cancelled now (switch 3: ranks are voting)",
        "published": "no switch is open: nothing to cancel",
    }
    for name, error in refusals.items():
        state = EVERY_STATE[name]
        refused = cs.on_cancel_request(state, CancelRequest("c", None, 1.5), now=0.0)
        assert refused.state is state and error in refused.reply.error
    other = cs.on_cancel_request(committed(), CancelRequest("c", 2, 1.5), now=0.0)
    assert "switch 2 is not the open switch (3)" in other.reply.error


def test_a_cancel_is_decided_once_every_rank_voted_and_kept_cancel_returns_to_committed():
    half = cancelling(CancelVote(3, 0, True, 9, ""))
    assert cs.cancel_outcome(half, drained_to=199.0) is None
    every = cancelling(*(CancelVote(3, r, True, 9, "") for r in range(WORLD)))
    outcome = cs.cancel_outcome(every, drained_to=199.0)
    assert outcome == CancelDecision(3, True, 11, {}, "cancelled before step 11")
    done = cs.on_cancel_logged(every, outcome)
    assert done.state == cs.Cancelled(every.committed.settled) and done.broadcast == outcome
    kept = CancelDecision(3, False, 11, {1: "x"}, "not cancelled: rank 1: x")
    back = cs.on_cancel_logged(every, kept)
    assert back.state is every.committed and back.reply.body["cancelled"] is False
    assert back.reply.body["reasons"] == {1: "x"}
    assert back.broadcast == CancelDecision(3, False, 11, {}, "not cancelled: rank 1: x")


def every_step(state):
    """Each step function applied to `state` with a representative event."""
    yield cs.on_request(state, request(), switch_id=9, world_size=WORLD, now=200.0)
    yield cs.on_cancel_request(state, CancelRequest("c", None, 1.0), now=200.0)
    yield cs.on_tally(state, now=500.0, drained_to=500.0, tp_groups=TP)
    yield cs.on_drained(state, now=500.0, drained_to=500.0, lease_s=2.0)
    if isinstance(state, cs.Preparing):
        yield cs.on_open_failed(state, "x", now=1.0)
    if isinstance(state, cs.Deciding):
        yield cs.on_logged(state, state.decision, log_s=0.0)
    if isinstance(state, cs.Cancelling):
        for cancelled in (True, False):
            yield cs.on_cancel_logged(state, CancelDecision(3, cancelled, 11, {}, ""))


@pytest.mark.parametrize("name", sorted(EVERY_STATE))
def test_every_step_from_every_state_is_in_the_transition_table(name):
    state = EVERY_STATE[name]
    for step in every_step(state):
        assert step.state is state or step.state.phase in TRANSITIONS[state.phase]
        cs.check_transition(state, step.state)


def test_a_change_outside_the_table_is_refused():
    with pytest.raises(RuntimeError, match="illegal transition idle -> committed"):
        cs.check_transition(cs.Idle(), committed())


def test_the_deadline_counts_only_once_the_inbox_is_read_up_to_it():
    state = preparing(yes(0), yes(1), yes(2))
    # the clock is past the deadline (102) but the inbox was read only up to 101.5: rank 3's
    # vote may still be queued, so the round stays open
    assert cs.on_tally(state, now=103.0, drained_to=101.5, tp_groups=TP).state is state
    decided = cs.on_tally(state, now=103.0, drained_to=102.0, tp_groups=TP).state
    assert decided.decision.reasons == {3: "no vote before the deadline (2 s)"}


SILENT = "no vote and no sign of life for 2 s: dead, stopped or cut off"

# (name, state, drained_to, silent ranks): the lease is 2 s; the Prepare went out at 100.1
SILENCE_CASES = [
    ("not read up to the first lease yet", preparing(), 102.0, []),
    ("every rank silent for the lease", preparing(), 102.1, [0, 1, 2, 3]),
    ("voted ranks are not silent", preparing(yes(0), yes(2)), 102.1, [1, 3]),
    (
        "a rank still planning said it is alive",
        preparing(yes(0), yes(1), yes(2), heard={3: 101.0}),
        102.5,
        [],
    ),
    (
        "its last sign of life is older than the lease",
        preparing(yes(0), yes(1), yes(2), heard={3: 100.4}),
        102.5,
        [3],
    ),
]


@pytest.mark.parametrize(
    "state, drained_to, silent",
    [c[1:] for c in SILENCE_CASES],
    ids=[c[0] for c in SILENCE_CASES],
)
def test_a_rank_silent_for_the_lease_aborts_the_switch_naming_it(state, drained_to, silent):
    step = cs.on_drained(state, now=drained_to + 0.01, drained_to=drained_to, lease_s=2.0)
    if not silent:
        assert step.state is state
        return
    assert isinstance(step.state, cs.Deciding) and step.state.decided_at == drained_to + 0.01
    d = step.state.decision
    assert (d.switch_id, d.commit, d.step) == (3, False, None)
    assert d.reasons == {r: SILENT for r in silent}
    names = ", ".join(map(str, silent))
    assert d.summary == f"rank{'s' if len(silent) > 1 else ''} {names}: {SILENT}"


def test_a_node_silent_as_a_whole_is_named_once_in_the_abort():
    """Ranks 0-3 in two relayed nodes (0, 1) and (2, 3); the second node's leader is lost, and
    rank 1 alone is silent too: the summary names node 2-3 once and rank 1 on its own."""
    step = cs.on_drained(
        preparing(yes(0)), now=102.2, drained_to=102.1, lease_s=2.0, nodes=((0, 1), (2, 3))
    )
    d = step.state.decision
    assert d.reasons == {1: SILENT, 2: SILENT, 3: SILENT}
    assert d.summary == f"node 2-3, rank 1: {SILENT}"


# (name, ranks, nodes, description)
DESCRIBE_CASES = [
    ("one rank", [3], (), "rank 3"),
    ("ranks", [2, 5], (), "ranks 2, 5"),
    ("a node partly silent is not named", [8, 9], ((8, 9, 10),), "ranks 8, 9"),
    (
        "a whole node and loose ranks",
        [2, 8, 9, 10, 5],
        ((8, 9, 10), (11, 12)),
        "node 8-10, ranks 2, 5",
    ),
    ("a node of ranks not in a row", [4, 9], ((4, 9),), "the node of rank 4"),
    (
        "more names than shown",
        list(range(20)),
        (),
        f"ranks {', '.join(map(str, range(16)))} and 4 more",
    ),
    (
        "nodes count as one name each",
        list(range(0, 160)),
        tuple(tuple(range(i, i + 8)) for i in range(0, 160, 8)),
        ", ".join(f"node {i}-{i + 7}" for i in range(0, 128, 8)) + " and 4 more",
    ),
]


@pytest.mark.parametrize(
    "ranks, nodes, text", [c[1:] for c in DESCRIBE_CASES], ids=[c[0] for c in DESCRIBE_CASES]
)
def test_ranks_are_described_with_whole_nodes_named_once(ranks, nodes, text):
    assert cs.describe_ranks(ranks, nodes) == text


def test_alive_is_noted_only_for_the_open_round_and_known_ranks():
    state = preparing()
    intake.take_alive(state, Alive(3, 1), now=100.7)
    intake.take_alive(state, Alive(2, 2), now=100.8)  # an older switch
    intake.take_alive(state, Alive(3, 9), now=100.9)  # no such rank
    assert state.lease.heard == {1: 100.7}
    intake.take_alive(committed(), Alive(3, 1), now=101.0)  # nothing to note once decided


def test_status_names_the_ranks_a_round_waits_for():
    assert cs.waiting_for(preparing(yes(0), yes(2))) == [1, 3]
    assert cs.waiting_for(committed(Ack(3, 1, 11, True, "", "B"))) == [0, 2, 3]
    assert cs.waiting_for(cancelling(CancelVote(3, 3, True, 9, ""))) == [0, 1, 2]
    assert cs.waiting_for(EVERY_STATE["published"]) == []
