"""Node summaries: a relay's uniform run of its ranks' votes (acks) goes up as one message the
coordinator takes in as one range. Tables for what the relay summarizes (`summarized`), proof
that a summary decides exactly as the votes it stands for (`decide` over both tallies), what the
coordinator refuses (`take_vote_summary`, `take_ack_summary`), and one coordinator fed sealed
bundles: summaries commit, a forged, malformed or stale one changes nothing."""

import json
import logging
import time

import pytest
from dist_quant.coordinator import coordinator_intake as intake
from dist_quant.coordinator import coordinator_state as cs
from dist_quant.coordinator.coordinator import Coordinator
from dist_quant.coordinator.decide import decide
from dist_quant.coordinator.decision_log import DecisionLog
from dist_quant.coordinator.node_relay import summarized
from dist_quant.coordinator.protocol import (
    Ack,
    AckSummary,
    Alive,
    AliveSummary,
    Bundle,
    Hello,
    Prepare,
    StatusQuery,
    SwitchRequest,
    Vote,
    VoteSummary,
)
from dist_quant.coordinator.tally import RankValues, Tally
from dist_quant.coordinator.transport_memory import MemoryHub, MemoryTransport
from dist_quant.coordinator.wire import INBOX, reply_queue, seal, unseal
from switch_harness import wait_for

NODE = tuple(range(8, 16))
D = "d" * 64


def yes(rank, last=10, hold=None, prepare_s=0.05, digest=D, parts=None, switch=1):
    hold = last + 4 if hold is None else hold
    return Vote(switch, rank, True, digest, last, "", prepare_s, hold, parts or {"rule": "x"})


def no(rank, switch=1):
    return Vote(switch, rank, False, "", 10, "factory failed", 0.05, None)


def ack(rank, ok=True, step=20, key="B", switch=1):
    return Ack(switch, rank, step, ok, "" if ok else "publish failed", key)


def shape(messages):
    """Each message as (kind, its ranks): a summary as its range, a vote or ack as its rank."""
    return [
        (m.kind, (m.first, m.last) if hasattr(m, "first") else m.rank) for m in messages
    ]  # fmt: skip


# (name, messages in arrival order, expected shape of what goes up)
SUMMARIZE_CASES = [
    ("a uniform node: one summary", [yes(r) for r in NODE], [("vote_summary", (8, 15))]),
    (
        "arrival order does not matter; the summary takes the last one's place",
        [yes(r) for r in (11, 8, 15, 9, 10, 12, 14, 13)],
        [("vote_summary", (8, 15))],
    ),
    (
        "a NO inside the node stays one by one, the runs around it are summarized",
        [yes(8), yes(9), yes(10), no(11), yes(12), yes(13), yes(14), yes(15)],
        [("vote_summary", (8, 10)), ("vote", 11), ("vote_summary", (12, 15))],
    ),
    (
        "another digest splits the node; a run of one stays a vote",
        [yes(8), yes(9), yes(10, digest="e" * 64), yes(11), yes(12)],
        [("vote_summary", (8, 9)), ("vote", 10), ("vote_summary", (11, 12))],
    ),
    (
        "another last step splits the node",
        [yes(8), yes(9), yes(10, last=11), yes(11, last=11)],
        [("vote_summary", (8, 9)), ("vote_summary", (10, 11))],
    ),
    (
        "different part digests do not agree",
        [yes(8), yes(9, parts={"rule": "y"})],
        [("vote", 8), ("vote", 9)],
    ),
    (
        "equal part digests agree whatever their order",
        [yes(8, parts={"a": "1", "b": "2"}), yes(9, parts={"b": "2", "a": "1"})],
        [("vote_summary", (8, 9))],
    ),
    (
        "one part digest more does not agree",
        [yes(8), yes(9, parts={"rule": "x", "other": "x"})],
        [("vote", 8), ("vote", 9)],
    ),
    ("ranks that are not consecutive", [yes(8), yes(10), yes(12)], [("vote", 8), ("vote", 10),
                                                                    ("vote", 12)]),
    (
        "a rank outside the node is never summarized",
        [yes(7), yes(8), yes(9)],
        [("vote", 7), ("vote_summary", (8, 9))],
    ),
    (
        "a rank heard twice is never summarized",
        [yes(8), yes(9), yes(10), yes(9)],
        [("vote", 8), ("vote", 9), ("vote", 10), ("vote", 9)],
    ),
    (
        "signs of life of one switch",
        [Alive(1, r) for r in NODE],
        [("alive_summary", (8, 15))],
    ),
    (
        "a sign of life and the votes that crossed it",
        [Alive(1, 9), yes(8), yes(9), Alive(1, 10), Hello(11, "k")],
        [("vote_summary", (8, 9)), ("alive_summary", (9, 10)), ("hello", 11)],
    ),
    (
        "acks: a failed one stays one by one",
        [ack(8), ack(9), ack(10, ok=False), ack(11), ack(12)],
        [("ack_summary", (8, 9)), ("ack", 10), ("ack_summary", (11, 12))],
    ),
    ("acks of another recipe key split", [ack(8), ack(9, key="C")], [("ack", 8), ("ack", 9)]),
]  # fmt: skip


@pytest.mark.parametrize(
    "messages, expected", [c[1:] for c in SUMMARIZE_CASES], ids=[c[0] for c in SUMMARIZE_CASES]
)
def test_a_relay_summarizes_each_uniform_run_of_consecutive_ranks(messages, expected):
    assert shape(summarized(8, NODE, messages)) == expected


def test_a_summary_carries_the_slowest_plan_and_the_latest_hold_step():
    votes = [yes(r, prepare_s=0.05 + r / 100, hold=30 - r % 5) for r in NODE]
    (s,) = summarized(8, NODE, votes)
    assert s == VoteSummary(1, 8, 8, 15, D, {"rule": "x"}, 10, 30, 0.05 + 15 / 100)
    (a,) = summarized(8, NODE, [ack(r) for r in NODE])
    assert a == AckSummary(1, 8, 8, 15, 20, "B")


def test_a_summary_survives_the_wire_as_a_bundle_run():
    sent = Bundle.of(8, summarized(8, NODE, [yes(r) for r in NODE]))
    got = unseal(seal(sent, "tok"), "tok")
    assert got == sent and got.runs[0]["kind"] == "vote_summary"


def counted(votes, world):
    """A tally of `votes`, one by one."""
    t = Tally(world)
    for v in votes:
        t.add(v.rank, v)
    return t


def _preparing(tally, lead_s=0.0, at_step=None):
    prepare = Prepare(1, {"name": "B"}, at_step, 30.0, lead_s)
    return cs.Preparing(cs.Opened(prepare, "req", 0.0, 30.0), tally, cs.Lease(0.0))


# (name, votes of ranks 0-7, at_step): decided over the votes one by one and over the relay's
# summaries of node 0-3 and node 4-7, the outcome must be the same
DECIDE_CASES = [
    ("all yes, one hold step", [yes(r) for r in range(8)], None),
    ("hold steps differ: the latest commits", [yes(r, hold=12 + (r * 5) % 8) for r in range(8)],
     None),
    ("last steps differ", [yes(r, last=10 + r // 3) for r in range(8)], None),
    ("a hold step not past its last step", [yes(r, hold=10 if r == 6 else 14) for r in range(8)],
     None),
    ("a requested step ahead", [yes(r, hold=30) for r in range(8)], 30),
    ("a requested step one node passed",
     [yes(r, last=30 if r < 4 else 10, hold=30) for r in range(8)], 30),
    ("a NO in a node", [no(r) if r == 5 else yes(r) for r in range(8)], None),
    (
        "a node whose digest differs from its TP group's",
        [yes(r, digest="e" * 64 if r >= 4 else D) for r in range(8)],
        None,
    ),
    ("one rank missing at the deadline", [yes(r) for r in range(7)], None),
]  # fmt: skip


@pytest.mark.parametrize(
    "votes, at_step", [c[1:] for c in DECIDE_CASES], ids=[c[0] for c in DECIDE_CASES]
)
def test_summaries_decide_exactly_as_the_votes_they_stand_for(votes, at_step):
    prepare = Prepare(1, {"name": "B"}, at_step, 30.0, 1.0)
    tp = [(0, 1, 2, 3, 4, 5, 6, 7)]  # one TP group over both nodes: their digests must agree
    one_by_one = decide(prepare, counted(votes, 8), tp, True)
    summaries = Tally(8)
    for node in ((0, 1, 2, 3), (4, 5, 6, 7)):
        for m in summarized(node[0], node, [v for v in votes if v.rank in node]):
            if isinstance(m, VoteSummary):
                summaries.add_range(m.first, m.last, m)
            else:
                summaries.add(m.rank, m)
    assert summaries.ranges  # the case exercises summaries
    assert decide(prepare, summaries, tp, True) == one_by_one
    if one_by_one.commit and at_step is None:  # the latest hold step, re-derived by hand
        assert one_by_one.step == max(v.hold_step for v in votes)


def test_a_summary_whose_hold_step_is_not_ahead_aborts_naming_each_of_its_ranks():
    """A relay never sends one (`_agreement` keeps such votes apart); if a faulty one did, its
    ranks could pass the commit step undecided: the switch aborts, every rank of it named."""
    votes = Tally(8)
    votes.add_range(0, 3, VoteSummary(1, 0, 0, 3, D, {}, 10, 10, 0.05))
    votes.add_range(4, 7, VoteSummary(1, 4, 4, 7, D, {}, 10, 14, 0.05))
    d = decide(Prepare(1, {"name": "B"}, None, 30.0, 1.0), votes, [(0, 1, 2, 3, 4, 5, 6, 7)], True)
    why = "hold step 10 not past last step 10 (node summary)"
    assert (d.commit, d.step, d.reasons) == (False, None, dict.fromkeys(range(4), why))


NODES = {0: (0, 1, 2, 3), 4: (4, 5, 6, 7)}


def s(first, last, leader=0, switch=1):
    return VoteSummary(switch, leader, first, last, D, {}, 10, 14, 0.05)


# (name, earlier votes, summary, note the coordinator logs (substring), ranks counted after)
TAKE_CASES = [
    ("a node's votes", [], s(0, 3), "ranks 0-3 vote yes", [0, 1, 2, 3]),
    ("part of a node", [], s(1, 2), "ranks 1-2 vote yes", [1, 2]),
    ("a summary for another switch", [], s(0, 3, switch=2), "stale or too late", []),
    ("a leader that runs no relay", [], s(0, 3, leader=1), "rank 1 leads no relayed node", []),
    ("ranks of another node", [], s(3, 5), "not ranks of its node (node 0-3)", []),
    ("ranks beyond the node", [], s(4, 8, leader=4), "not ranks of its node (node 4-7)", []),
    ("first after last", [], s(3, 1), "first rank 3 is after last rank 1", []),
    (
        "a rank already counted: refused whole",
        [yes(2)],
        s(0, 3),
        "repeated message of rank 2 (in ranks 0-3)",
        [2],
    ),
]


@pytest.mark.parametrize(
    "earlier, summary, note, after", [c[1:] for c in TAKE_CASES], ids=[c[0] for c in TAKE_CASES]
)
def test_the_coordinator_takes_a_summary_of_its_leaders_node_or_refuses_it_whole(
    earlier, summary, note, after
):
    state = _preparing(Tally(8))
    for v in earlier:
        intake.take_vote(state, v)
    got = intake.take_vote_summary(state, summary, NODES)
    assert note in got
    assert [r for r in range(8) if state.votes.has(r)] == after
    assert state.votes.count == len(after)
    assert state.phase is cs.Phase.PREPARING


def test_an_ack_summary_counts_only_for_the_committed_switch():
    settled = cs.Settled(_preparing(Tally(8)).opened, Tally(8), None, 0.0, 0.0)
    state = cs.Committed(settled, Tally(8))
    assert intake.take_ack_summary(state, AckSummary(2, 0, 0, 3, 20, "B"), NODES) == ""
    assert state.acks.count == 0  # another switch's: nothing counted
    refused = intake.take_ack_summary(state, AckSummary(1, 0, 2, 5, 20, "B"), NODES)
    assert refused.startswith("refused the ack summary of node 0 (ranks 2-5): not ranks")
    assert intake.take_ack_summary(state, AckSummary(1, 4, 4, 7, 20, "B"), NODES) == ""
    assert cs.waiting_for(state) == [0, 1, 2, 3]


def test_an_alive_summary_keeps_its_ranks_out_of_the_lease_for_the_open_switch_only():
    state = _preparing(Tally(8))
    assert intake.take_alive_summary(state, AliveSummary(1, 4, 4, 7), NODES, now=5.0) == ""
    assert intake.take_alive_summary(state, AliveSummary(2, 0, 0, 3), NODES, now=5.0) == ""  # stale
    refused = intake.take_alive_summary(state, AliveSummary(1, 0, 2, 5), NODES, now=5.0)
    assert refused.startswith("refused the alive summary of node 0 (ranks 2-5): not ranks")
    assert state.lease.heard == {4: 5.0, 5: 5.0, 6: 5.0, 7: 5.0}
    step = cs.on_drained(state, now=6.0, drained_to=6.0, lease_s=2.0, nodes=list(NODES.values()))
    assert step.state.decision.reasons.keys() == {0, 1, 2, 3}  # silent since the Prepare (0.0)
    assert step.state.decision.summary.startswith("node 0-3: no vote and no sign of life")


def test_rank_values_keep_the_latest_write_by_rank_or_range():
    keys = RankValues()
    keys.set(5, "A")
    keys.set_range(4, 7, "B")
    keys.set(6, "C")
    keys.set_range(0, 1, "D")
    assert keys.as_dict() == {0: "D", 1: "D", 4: "B", 5: "B", 6: "C", 7: "B"}


# -- one coordinator, sealed bundles pushed into its inbox ----------------------------------------

TOKEN = "tok"


@pytest.fixture
def coord(tmp_path):
    hub = MemoryHub()
    c = Coordinator(
        MemoryTransport(hub),
        token=TOKEN,
        world_size=8,
        tp_groups=[(0, 1), (2, 3), (4, 5), (6, 7)],
        log=DecisionLog(tmp_path / "decisions.jsonl"),
        relayed_nodes=list(NODES.values()),
    )
    c.start()
    c.hub = hub
    yield c
    c.stop()
    hub.close()


def ask(c, msg, request_id):
    c.hub.push(INBOX, seal(msg, TOKEN))
    return reply(c, request_id)


def reply(c, request_id, limit_s=10.0):
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        data = c.hub.pop(reply_queue(request_id), 0.05)
        if data is not None:
            return unseal(data, TOKEN)
    raise TimeoutError(request_id)


def status(c, n=[0]):  # noqa: B006 - a counter for unique request ids
    n[0] += 1
    return ask(c, StatusQuery(f"st{n[0]}"), f"st{n[0]}").body


def node_bundle(leader, messages, token=TOKEN):
    node = NODES[leader]
    return seal(Bundle.of(leader, summarized(leader, node, messages)), token)


def test_a_switch_of_summarized_nodes_commits_and_publishes(coord):
    assert ask(coord, SwitchRequest("req", {"name": "B"}, None, 30.0), "req").status == "accepted"
    node0 = [yes(r, prepare_s=0.1 * (r + 1)) for r in range(4)]
    coord.hub.push(INBOX, node_bundle(0, node0))
    coord.hub.push(INBOX, node_bundle(4, [yes(r) for r in (4, 5, 6)] + [no(7)]))
    result = reply(coord, "req")
    body = result.body
    assert body["committed"] is False and set(body["reasons"]) == {"7"}  # rank 7's NO, by rank
    assert body["prepare_s_ranges"] == {"0-3": 0.4, "4-6": 0.05}
    assert body["prepare_s"] == {"7": 0.05}


def test_acks_in_summaries_publish_and_status_names_each_ranks_recipe(coord):
    ask(coord, SwitchRequest("req", {"name": "B"}, None, 30.0), "req")
    for leader, node in NODES.items():
        coord.hub.push(INBOX, node_bundle(leader, [yes(r) for r in node]))
    result = reply(coord, "req")
    assert result.body["committed"] and result.body["prepare_s"] == {}
    step = result.body["step"]
    coord.hub.push(INBOX, node_bundle(0, [ack(r, step=step) for r in NODES[0]]))
    assert status(coord)["waiting_for"] == [4, 5, 6, 7]
    coord.hub.push(INBOX, node_bundle(4, [ack(r, step=step, key="B2") for r in NODES[4]]))
    wait_for(lambda: coord.phase.value == "published", 10, "published")
    keys = status(coord)["recipe_keys"]
    assert keys == {**{str(r): "B" for r in range(4)}, **{str(r): "B2" for r in range(4, 8)}}


def test_forged_malformed_and_stale_summaries_count_for_nothing(coord, caplog):
    ask(coord, SwitchRequest("req", {"name": "B"}, None, 30.0), "req")
    caplog.set_level(logging.WARNING, logger="dist_quant.coordinator")
    coord.hub.push(INBOX, node_bundle(0, [yes(r) for r in NODES[0]], token="not-the-token"))
    coord.hub.push(INBOX, seal(Bundle.of(4, [s(0, 5, leader=4)]), TOKEN))  # beyond its node
    coord.hub.push(INBOX, seal(Bundle.of(4, [s(4, 7, leader=4, switch=9)]), TOKEN))
    run = json.loads(json.dumps(Bundle.of(4, [s(4, 7, leader=4)]).runs[0]))
    run["same"]["first"] = "four"  # a field of the wrong type: the run is dropped whole
    coord.hub.push(INBOX, seal(Bundle(4, (run,)), TOKEN))
    assert status(coord)["waiting_for"] == list(range(8))
    text = caplog.text
    assert "bundle message refused: wrong token" in text
    assert "refused the vote summary of node 4 (ranks 0-5): not ranks of its node" in text
    assert "vote_summary.first" in text and "'four'" in text
    # the stale one is only a debug line; with the node's real votes the switch still commits
    for leader, node in NODES.items():
        coord.hub.push(INBOX, node_bundle(leader, [yes(r) for r in node]))
    result = reply(coord, "req")
    assert result.body["committed"]
