"""Cancelling a switch committed for a later step: the coordinator's CANCELLING phase with
hand-played ranks, the participant holding its publish at S with a hand-played coordinator, and
both together on a memory transport through `cancel_switch`."""

import threading

import pytest
from dist_quant.coordinator import CancelRefusedError, cancel_switch, request_switch
from dist_quant.coordinator.decision_log import DecisionLog
from dist_quant.coordinator.participant import Participant
from dist_quant.coordinator.phases import Phase
from dist_quant.coordinator.protocol import (
    Ack,
    CancelDecision,
    CancelPrepare,
    CancelRequest,
    CancelVote,
    Decision,
    Hello,
    Prepare,
)
from dist_quant.coordinator.transport_memory import MemoryHub, MemoryTransport
from dist_quant.coordinator.wire import rank_queue, reply_queue
from switch_harness import FAKE_HOOKS, FakeModel, Script, wait_for
from test_coordinator import TOKEN, Job, start_coordinator


@pytest.fixture
def job(tmp_path):
    j = Job(tmp_path)
    yield j
    j.close()


def commit_at(job, step, rid="r1"):
    job.request(rid, at_step=step)
    job.prepares()
    job.vote_all_yes(1, step=3)
    assert job.result(rid).body["committed"]
    assert all(d.commit for d in job.prepares())  # the decisions


def cancel(job, rid="c1", switch_id=None, timeout_s=5.0):
    job.s.send(CancelRequest(rid, switch_id, timeout_s))
    return job.s.recv(reply_queue(rid))


def test_every_rank_before_the_step_cancels_logs_it_and_frees_the_next_switch(job):
    commit_at(job, 50)
    accepted = cancel(job)
    assert (accepted.status, accepted.switch_id) == ("accepted", 1)
    assert job.prepares() == [CancelPrepare(1, 50, 5.0)] * 2
    assert job.coord.phase is Phase.CANCELLING
    for r in range(2):
        job.s.send(CancelVote(1, r, True, 10, ""))
    result = job.result("c1")
    assert result.body == CancelDecision(1, True, 50, {}, "cancelled before step 50").to_dict()
    assert all(
        d == CancelDecision(1, True, 50, {}, "cancelled before step 50") for d in job.prepares()
    )
    assert job.coord.phase is Phase.CANCELLED
    events = [(r["event"], r["switch_id"]) for r in job.log.records() if "switch_id" in r]
    assert events == [("open", 1), ("decision", 1), ("cancel", 1)]
    assert job.log.records()[-1]["cancelled"] is True
    assert job.request("r2").status == "accepted"  # the lock-out is over


def test_a_rank_that_already_published_keeps_the_commit_and_the_switch_publishes(job):
    commit_at(job, 50)
    cancel(job)
    job.prepares()
    job.s.send(CancelVote(1, 0, True, 10, ""))
    job.s.send(CancelVote(1, 1, False, 50, "already published switch 1 at step 50"))
    body = job.result("c1").body
    assert body["cancelled"] is False
    assert body["reasons"] == {"1": "already published switch 1 at step 50"}
    assert "already published" in job.log.records()[-1]["summary"]
    assert job.coord.phase is Phase.COMMITTED
    for r in range(2):
        job.s.send(Ack(1, r, 50, True, "", "B"))
    wait_for(lambda: job.coord.phase is Phase.PUBLISHED, 5, "published")


@pytest.mark.parametrize("when", ["idle", "preparing"])
def test_cancel_is_refused_without_a_committed_switch(job, when):
    if when == "preparing":
        job.request("r1", at_step=50)
        job.prepares()
    refused = cancel(job)
    assert refused.status == "refused"
    assert ("nothing to cancel" if when == "idle" else "only a committed switch") in refused.error
    assert [r["event"] for r in job.log.records() if r["event"] != "attempt"] == (
        [] if when == "idle" else ["open"]
    )
    with pytest.raises(CancelRefusedError):
        cancel_switch(transport=MemoryTransport(job.hub), token=TOKEN)


def test_a_busy_refusal_names_the_booked_step_and_the_cancel_command(job):
    commit_at(job, 50)
    refused = job.request("r2")
    assert refused.status == "refused"
    assert "committed, ranks publish at step 50" in refused.error
    assert "dist-quant cancel 1" in refused.error


# ---- the participant, with a hand-played coordinator -------------------------------------------
@pytest.fixture
def solo():
    hub = MemoryHub()
    coord = Script(MemoryTransport(hub), TOKEN)
    model = FakeModel(0)
    p = Participant(
        model,
        rank=0,
        transport=MemoryTransport(hub),
        token=TOKEN,
        decision_grace_s=0.05,
        **FAKE_HOOKS,
    ).start()
    assert isinstance(coord.recv(), Hello)
    yield coord, model, p
    p.close()


def committed_for(coord, p, step):
    p.step_boundary(0)
    coord.send(Prepare(1, {"name": "B"}, step, 5.0), rank_queue(0))
    assert coord.recv().yes
    coord.send(Decision(1, True, step, {}, ""), rank_queue(0))
    wait_for(lambda: p.state == "committing", 5, "COMMIT")


def boundary_in_thread(p, step):
    box = []
    t = threading.Thread(target=lambda: box.append(p.step_boundary(step) or "ok"))
    t.start()
    return t, box


def test_a_cancelled_rank_holds_its_publish_at_s_then_keeps_its_recipe(solo):
    coord, model, p = solo
    committed_for(coord, p, 5)
    p.step_boundary(3)
    coord.send(CancelPrepare(1, 5, 5.0), rank_queue(0))
    assert coord.recv() == CancelVote(1, 0, True, 3, "")
    p.step_boundary(4)  # before S: no wait
    t, box = boundary_in_thread(p, 5)
    t.join(0.3)
    assert t.is_alive() and model.publishes == []  # held at S until the cancel is decided
    coord.send(CancelDecision(1, True, 5, {}, "cancelled"), rank_queue(0))
    t.join(5)
    assert box == ["ok"] and model.publishes == [] and p.state == "idle"
    p.step_boundary(6)
    assert model.recipe == "A"


def test_a_cancel_that_fails_lets_the_rank_publish_at_s(solo):
    coord, model, p = solo
    committed_for(coord, p, 5)
    coord.send(CancelPrepare(1, 5, 5.0), rank_queue(0))
    assert coord.recv().yes
    coord.send(CancelDecision(1, False, 5, {1: "late"}, "not cancelled"), rank_queue(0))
    wait_for(lambda: p.state == "committing", 5, "back to committing")
    p.step_boundary(5)
    assert model.publishes == ["B"]
    assert isinstance(coord.recv(), Ack)


def test_a_rank_that_published_votes_no_to_a_cancel(solo):
    coord, model, p = solo
    committed_for(coord, p, 5)
    p.step_boundary(5)
    assert isinstance(coord.recv(), Ack)
    coord.send(CancelPrepare(1, 5, 5.0), rank_queue(0))
    vote = coord.recv()
    assert not vote.yes and "already published switch 1" in vote.reason


def test_a_rank_that_stopped_waiting_and_published_breaks_on_a_late_cancel(solo):
    coord, model, p = solo
    committed_for(coord, p, 5)
    coord.send(CancelPrepare(1, 5, 0.05), rank_queue(0))
    assert coord.recv().yes
    p.step_boundary(5)  # waits 0.05 s + grace 0.05 s, then publishes as committed
    assert model.publishes == ["B"]
    coord.send(CancelDecision(1, True, 5, {}, "cancelled"), rank_queue(0))
    wait_for(lambda: p.state == "broken", 5, "broken")
    with pytest.raises(Exception, match="stopped waiting for the cancel"):
        p.step_boundary(6)


# ---- coordinator and two participants, through the client API ---------------------------------
def test_cancel_switch_through_the_client_cancels_on_both_ranks(tmp_path):
    hub = MemoryHub()
    coord = start_coordinator(MemoryTransport(hub), 2, DecisionLog(tmp_path / "decisions.jsonl"))
    models = [FakeModel(r) for r in range(2)]
    ranks = [
        Participant(m, rank=r, transport=MemoryTransport(hub), token=TOKEN, **FAKE_HOOKS).start()
        for r, m in enumerate(models)
    ]
    client = {"transport": MemoryTransport(hub), "token": TOKEN}
    try:
        for p in ranks:
            p.step_boundary(0)
        booked = request_switch({"name": "B"}, at_step=20, timeout_s=5, **client)
        assert booked.committed and booked.step == 20
        result = cancel_switch(timeout_s=5, **client)
        assert (result.switch_id, result.cancelled, result.step) == (1, True, 20)
        for step in range(1, 25):
            for p in ranks:
                p.step_boundary(step)
        assert [m.publishes for m in models] == [[], []]
        again = request_switch({"name": "C"}, timeout_s=5, **client)
        assert again.committed and again.switch_id == 2
    finally:
        for p in ranks:
            p.close()
        coord.stop()
