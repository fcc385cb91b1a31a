"""The participant: votes from its listener, waits at v+1, publishes exactly at S, and refuses to
continue half-switched. Ranks are threads; the coordinator is real or played by hand."""

import threading
import time

import pytest
import torch.distributed as dist
from dist_quant.coordinator import SwitchError, fail_at, request_switch
from dist_quant.coordinator import participant as participant_module
from dist_quant.coordinator.decision_log import DecisionLog
from dist_quant.coordinator.participant import PROBE_S, Participant
from dist_quant.coordinator.protocol import Ack, Alive, Decision, Hello, Prepare, Vote
from dist_quant.coordinator.timing import BEAT_S, FIRST_BEAT_S
from dist_quant.coordinator.transport_memory import MemoryHub, MemoryTransport
from dist_quant.coordinator.wire import node_queue, rank_queue
from switch_harness import (
    FAKE_HOOKS,
    CountingTransport,
    FakeModel,
    Script,
    wait_for,
)
from test_coordinator import start_coordinator

TOKEN = "tok"


def make_participant(hub, rank=0, faults=(), grace=0.05, transport=None):
    model = FakeModel(rank)
    p = Participant(
        model,
        rank=rank,
        transport=transport or MemoryTransport(hub),
        token=TOKEN,
        faults=faults,
        decision_grace_s=grace,
        **FAKE_HOOKS,
    )
    return model, p.start()


@pytest.fixture
def solo():
    """One participant (rank 0) and a hand-played coordinator."""
    hub = MemoryHub()
    coord = Script(MemoryTransport(hub), TOKEN)
    model, p = make_participant(hub)
    assert isinstance(coord.recv(), Hello)
    yield coord, model, p
    p.close()


def vote_after_prepare(coord, p, switch_id, at_step=None, timeout_s=5.0, recipe=None):
    coord.send(Prepare(switch_id, recipe or {"name": "B"}, at_step, timeout_s), rank_queue(p.rank))
    return coord.recv()


def run_boundary(p, step):
    """step_boundary in a thread; returns (thread, box) where box gets "ok" or the exception."""
    box = []

    def go():
        try:
            p.step_boundary(step)
            box.append("ok")
        except Exception as e:  # noqa: BLE001
            box.append(e)

    t = threading.Thread(target=go)
    t.start()
    return t, box


def test_idle_step_boundary_makes_no_transport_call_and_no_collective(monkeypatch):
    hub = MemoryHub()
    counting = CountingTransport(MemoryTransport(hub))
    model, p = make_participant(hub, transport=counting)
    wait_for(lambda: counting.counts[("dist_quant.participant.r0", "pop")] == 1, 5, "listener")

    def forbidden(*a, **k):
        raise AssertionError("step_boundary issued a collective")

    for name in ("all_reduce", "broadcast", "all_gather", "barrier", "all_gather_object"):
        monkeypatch.setattr(dist, name, forbidden)
    before = sum(counting.counts.values())
    for step in range(1000):
        p.step_boundary(step)
    assert sum(counting.counts.values()) == before
    training = threading.current_thread().name
    assert not [k for k in counting.counts if k[0] == training]
    p.close()


def test_vote_carries_last_step_and_rank_waits_at_next_boundary_then_publishes(solo):
    coord, model, p = solo
    p.step_boundary(7)
    vote = vote_after_prepare(coord, p, 1)
    assert (vote.yes, vote.digest, vote.last_step) == (True, "B", 7)
    t, box = run_boundary(p, 8)
    time.sleep(0.2)
    assert t.is_alive() and model.recipe == "A"  # blocked at v+1 without a decision
    coord.send(Decision(1, True, 8, {}, ""), rank_queue(0))
    t.join(5)
    assert box == ["ok"] and model.recipe == "B"  # published before returning from boundary 8
    ack = coord.recv()
    assert ack == Ack(1, 0, 8, True, "", "B")


def test_commit_at_a_later_step_publishes_exactly_there(solo):
    coord, model, p = solo
    p.step_boundary(3)
    vote_after_prepare(coord, p, 1, at_step=6)
    coord.send(Decision(1, True, 6, {}, ""), rank_queue(0))
    seen = []
    for step in range(4, 9):
        p.step_boundary(step)
        seen.append((step, model.recipe))
    assert seen == [(4, "A"), (5, "A"), (6, "B"), (7, "B"), (8, "B")]
    assert model.publishes == ["B"]


def test_with_a_requested_step_the_rank_trains_on_undecided_until_that_step(solo):
    coord, model, p = solo
    p.step_boundary(3)
    assert vote_after_prepare(coord, p, 1, at_step=20).yes
    for step in range(4, 20):  # none of these waits: the decision is not needed before 20
        p.step_boundary(step)
    assert (p.state, model.recipe) == ("voted", "A")
    t, box = run_boundary(p, 20)
    t.join(0.2)
    assert t.is_alive() and model.recipe == "A"  # at 20 undecided: waits
    coord.send(Decision(1, True, 20, {}, ""), rank_queue(0))
    t.join(5)
    assert box == ["ok"] and model.publishes == ["B"]


def test_without_a_requested_step_the_rank_trains_on_undecided_until_its_hold_step(solo):
    coord, model, p = solo
    for step in range(3):
        p.step_boundary(step)
        time.sleep(0.01)  # a measured pace of at least 10 ms per step
    coord.send(Prepare(1, {"name": "B"}, None, 5.0, 0.5), rank_queue(0))
    vote = coord.recv()
    hold = vote.hold_step
    # 2 + 1 + the whole steps of at least 10 ms (the pace) in the 0.5 s lead
    assert vote.yes and vote.last_step == 2 and 3 < hold <= 2 + 1 + 50, hold
    for step in range(3, hold):
        p.step_boundary(step)
    assert (p.state, model.recipe, p.boundary_wait_s) == ("voted", "A", 0.0)
    t, box = run_boundary(p, hold)
    t.join(0.2)
    assert t.is_alive() and model.recipe == "A"
    coord.send(Decision(1, True, hold, {}, ""), rank_queue(0))
    t.join(5)
    assert box == ["ok"] and model.publishes == ["B"]
    assert p.boundary_wait_s > 0.0  # the wait at the hold step, the only one, is accounted


def test_a_rank_planning_slowly_says_it_is_alive_until_it_votes(solo):
    coord, model, p = solo
    p.step_boundary(0)
    slow = {"name": "B", "sleep_rank": 0, "sleep_s": 1.2}  # more than two beats of 0.5 s
    coord.send(Prepare(1, slow, None, 5.0), rank_queue(0))
    heard = [coord.recv()]
    while not isinstance(heard[-1], Vote):
        heard.append(coord.recv())
    assert heard[0] == Alive(1, 0) and set(heard[:-1]) == {Alive(1, 0)}
    assert heard[-1].yes and heard[-1].switch_id == 1
    assert coord.silent(wait=0.7)  # voted: no more beats


def test_an_abort_while_the_rank_still_plans_frees_it_and_the_late_plan_is_dropped(solo):
    coord, model, p = solo
    p.step_boundary(0)
    coord.send(Prepare(1, {"name": "B", "sleep_rank": 0, "sleep_s": 1.0}, None, 5.0), rank_queue(0))
    coord.send(Decision(1, False, None, {0: "too slow"}, ""), rank_queue(0))
    wait_for(lambda: p.state == "idle", 5, "the abort to free the rank")
    vote = vote_after_prepare(coord, p, 2, recipe={"name": "C"})
    assert (vote.switch_id, vote.yes) == (2, True)
    assert coord.silent(wait=1.5)  # the plan of switch 1 ended meanwhile: no vote for it
    coord.send(Decision(2, True, 1, {}, ""), rank_queue(0))
    p.step_boundary(1)
    assert model.publishes == ["C"]


def test_abort_drops_the_candidate(solo):
    coord, model, p = solo
    p.step_boundary(0)
    vote_after_prepare(coord, p, 1)
    coord.send(Decision(1, False, None, {1: "no"}, ""), rank_queue(0))
    p.step_boundary(1)
    p.step_boundary(2)
    assert model.recipe == "A" and model.publishes == [] and p.state == "idle"


def test_planning_failure_votes_no_with_the_error_text(solo):
    coord, model, p = solo
    p.step_boundary(0)
    vote = vote_after_prepare(coord, p, 1, recipe={"name": "B", "fail_rank": 0})
    assert vote.yes is False
    assert vote.reason == "ValueError: factory raised for role layers.0.fc1 on rank 0"
    assert p.state == "idle"
    vote = vote_after_prepare(coord, p, 2, recipe="not a recipe")
    assert vote.yes is False and "malformed recipe" in vote.reason


def test_injected_prepare_fault_becomes_a_no_vote():
    hub = MemoryHub()
    coord = Script(MemoryTransport(hub), TOKEN)
    model, p = make_participant(hub, faults=[fail_at(rank=0, phase="prepare")])
    coord.recv()
    p.step_boundary(0)
    vote = vote_after_prepare(coord, p, 1)
    assert vote.yes is False and "injected fault: rank 0 at prepare" in vote.reason
    p.close()


def test_prepare_before_the_first_boundary_votes_once_training_has_started(solo):
    coord, model, p = solo
    coord.send(Prepare(1, {"name": "B"}, None, 5.0), rank_queue(0))
    time.sleep(0.5)
    p.step_boundary(100)
    heard = [coord.recv()]
    while not isinstance(heard[-1], Vote):
        heard.append(coord.recv())
    # no vote before a step was known; meanwhile the rank, still planning, said it was alive
    assert set(heard[:-1]) == {Alive(1, 0)}
    vote = heard[-1]
    assert vote.yes and vote.last_step == 100


def test_replayed_prepare_is_ignored(solo):
    coord, model, p = solo
    p.step_boundary(0)
    vote_after_prepare(coord, p, 1)
    coord.send(Prepare(1, {"name": "B"}, None, 5.0), rank_queue(0))
    assert coord.silent(wait=0.2)


def test_gave_up_rank_keeps_old_recipe_and_raises_if_commit_arrives_later(solo):
    coord, model, p = solo
    p.step_boundary(0)
    vote_after_prepare(coord, p, 1, timeout_s=0.1)
    t0 = time.monotonic()
    p.step_boundary(1)  # waits timeout + grace, then gives up
    assert time.monotonic() - t0 >= 0.1
    assert p.state == "gave_up" and model.recipe == "A"
    p.step_boundary(2)  # trains on with the old recipe
    coord.send(Decision(1, True, 2, {}, ""), rank_queue(0))
    nack = coord.recv()
    assert isinstance(nack, Ack) and nack.ok is False and "gave up waiting" in nack.error
    with pytest.raises(SwitchError, match="recorded COMMIT at step 2"):
        p.step_boundary(3)
    with pytest.raises(SwitchError):  # and it stays that way
        p.step_boundary(4)
    assert model.recipe == "A"


def test_gave_up_rank_returns_to_idle_when_the_late_decision_is_abort(solo):
    coord, model, p = solo
    p.step_boundary(0)
    vote_after_prepare(coord, p, 1, timeout_s=0.05)
    p.step_boundary(1)
    coord.send(Decision(1, False, None, {}, ""), rank_queue(0))
    wait_for(lambda: p.state == "idle", 5, "idle")
    p.step_boundary(2)


def test_skipping_the_commit_step_raises(solo):
    coord, model, p = solo
    p.step_boundary(0)
    vote_after_prepare(coord, p, 1)
    coord.send(Decision(1, True, 3, {}, ""), rank_queue(0))
    p.step_boundary(1)
    with pytest.raises(SwitchError, match="without a step_boundary at the commit step 3"):
        p.step_boundary(5)
    assert model.recipe == "A"


def test_failed_publish_raises_and_acks_not_ok():
    hub = MemoryHub()
    coord = Script(MemoryTransport(hub), TOKEN)
    model, p = make_participant(hub, faults=[fail_at(rank=0, phase="commit")])
    coord.recv()
    p.step_boundary(0)
    vote_after_prepare(coord, p, 1)
    coord.send(Decision(1, True, 1, {}, ""), rank_queue(0))
    with pytest.raises(SwitchError, match="failed to publish switch 1"):
        p.step_boundary(1)
    ack = coord.recv()
    assert ack.ok is False and "injected fault" in ack.error
    p.close()


def test_commit_without_a_yes_vote_breaks_the_rank(solo):
    coord, model, p = solo
    p.step_boundary(0)
    vote = vote_after_prepare(coord, p, 1, recipe={"name": "B", "fail_rank": 0})
    assert vote.yes is False
    coord.send(Decision(1, True, 1, {}, ""), rank_queue(0))
    wait_for(lambda: p.state == "broken", 5, "broken")
    with pytest.raises(SwitchError, match="without a YES vote"):
        p.step_boundary(1)


def test_dropped_vote_times_out_and_every_rank_keeps_the_old_recipe(tmp_path):
    hub = MemoryHub()
    coord = start_coordinator(
        MemoryTransport(hub), 2, DecisionLog(tmp_path / "d.jsonl"), token=TOKEN
    )
    ranks = [
        make_participant(hub, rank=r, faults=[fail_at(rank=1, phase="vote", action="drop")])
        for r in range(2)
    ]
    for _, p in ranks:
        p.step_boundary(0)
    result = request_switch(
        {"name": "B"}, timeout_s=0.3, transport=MemoryTransport(hub), token=TOKEN
    )
    assert result.committed is False and "no vote before the deadline" in result.reasons[1]
    for step in range(1, 4):
        for _, p in ranks:
            p.step_boundary(step)
    assert [m.recipe for m, _ in ranks] == ["A", "A"]
    for _, p in ranks:
        p.close()
    coord.stop()


def test_four_ranks_in_lockstep_publish_at_the_same_step(tmp_path):
    """TP peers wait for each other every step (a barrier per TP group, standing in for the
    collective): if voting blocked the training thread this would deadlock."""
    hub = MemoryHub()
    coord = start_coordinator(
        MemoryTransport(hub), 4, DecisionLog(tmp_path / "d.jsonl"), token=TOKEN
    )
    ranks = [make_participant(hub, rank=r, grace=1.0) for r in range(4)]
    barriers = [threading.Barrier(2, timeout=10), threading.Barrier(2, timeout=10)]
    stop = threading.Event()
    logs = {r: [] for r in range(4)}
    errors = []

    def train(r):
        model, p = ranks[r]
        try:
            step = 0
            while not (stop.is_set() and step >= 60):
                p.step_boundary(step)
                logs[r].append(model.recipe)
                barriers[r // 2].wait()
                time.sleep(0.002 * (r + 1))
                step += 1
        except Exception as e:  # noqa: BLE001
            errors.append((r, e))

    threads = [threading.Thread(target=train, args=(r,)) for r in range(4)]
    for t in threads:
        t.start()
    time.sleep(0.05)
    result = request_switch({"name": "B"}, transport=MemoryTransport(hub), token=TOKEN)
    stop.set()
    for t in threads:
        t.join(20)
    for _, p in ranks:
        p.close()
    coord.stop()
    assert not errors, errors
    assert result.committed and sorted(result.prepare_s) == [0, 1, 2, 3]
    for r in range(4):
        first_b = logs[r].index("B")
        assert first_b == result.step, (r, first_b, result.step)
        assert set(logs[r][:first_b]) == {"A"} and set(logs[r][first_b:]) == {"B"}


class FakeClock:
    """The participant's `time`, read by the test: boundaries at chosen instants."""

    def __init__(self):
        self.now = 100.0

    def monotonic(self):
        return self.now

    def perf_counter(self):
        return time.perf_counter()


def test_one_slow_step_before_the_vote_does_not_pull_the_hold_step_in(solo, monkeypatch):
    """A rank's pace was its last interval smoothed upward by halves: one 2 s step among 0.125 s
    ones made it 1.06 s, so the rank booked no step ahead of a 0.5 s lead and waited at v + 1,
    while its peers (same job, same pace, no hiccup) booked v + 5: it blocked the job with the
    commit step still 4 steps ahead."""
    coord, model, p = solo
    clock = FakeClock()
    monkeypatch.setattr(participant_module, "time", clock)
    for step, dt in enumerate([0.0, 0.125, 0.125, 0.125, 0.125, 2.0]):
        clock.now += dt
        p.step_boundary(step)
    coord.send(Prepare(1, {"name": "B"}, None, 5.0, 0.5), rank_queue(0))
    vote = coord.recv()
    assert vote.yes and (vote.last_step, vote.hold_step) == (5, 10)  # 5 + 1 + 0.5 s / 0.125 s
    for step in range(6, 10):
        clock.now += 0.125
        p.step_boundary(step)
    assert (p.state, p.boundary_wait_s) == ("voted", 0.0)
    t, box = run_boundary(p, 10)
    t.join(0.2)
    assert t.is_alive()  # undecided at its hold step: waits there, and only there
    coord.send(Decision(1, True, 12, {}, ""), rank_queue(0))
    t.join(5)
    assert box == ["ok"] and p.state == "committing"


def test_the_pace_a_vote_reports_counts_only_consecutive_boundaries(solo):
    coord, model, p = solo
    for step in (0, 1, 2):
        p.step_boundary(step)
        time.sleep(0.02)
    for _ in range(5):
        p.step_boundary(2)  # a repeated boundary (a retried step) is not a fast step
    p.step_boundary(7)  # nor is a jump
    coord.send(Prepare(1, {"name": "B"}, None, 5.0, 0.5), rank_queue(0))
    vote = coord.recv()
    assert 8 < vote.hold_step <= 7 + 1 + 25  # a pace of at least 20 ms: at most 25 steps ahead


class PopTimeouts(MemoryTransport):
    """The listener's connection: records the timeout of every pop of its rank's queue."""

    def __init__(self, hub, rank):
        super().__init__(hub)
        self.rank, self.timeouts = rank, []

    def pop(self, queue, timeout=None):
        if queue == rank_queue(self.rank):
            self.timeouts.append(timeout)
        return super().pop(queue, timeout)

    def clone(self):
        return MemoryTransport(self.hub)


@pytest.mark.parametrize(("behind_leaders_store", "voted_beat"), [(True, PROBE_S), (False, BEAT_S)])
def test_a_yes_voter_behind_a_relay_wakes_every_probe_behind_a_store_every_beat_otherwise(
    behind_leaders_store, voted_beat
):
    """Behind its leader's store, a rank holding a YES vote only checks that the store answers
    (every PROBE_S); a rank that can reach the coordinator asks it for the decision every beat.
    Both read without a timeout once decided, and plan with the beat (their `Alive`s)."""
    hub = MemoryHub()
    rx = PopTimeouts(hub, rank=5)
    link = (lambda: MemoryTransport(hub)) if behind_leaders_store else None
    p = Participant(FakeModel(5), rank=5, transport=rx, token=TOKEN, upstream=node_queue(4),
                    coordinator_link=link, **FAKE_HOOKS).start()  # fmt: skip
    coord = Script(MemoryTransport(hub), TOKEN)
    try:
        assert isinstance(coord.recv(node_queue(4)), Hello)
        p.step_boundary(0)
        planning = {"name": "B", "sleep_rank": 5, "sleep_s": 0.1}  # the listener reads meanwhile
        coord.send(Prepare(1, planning, None, 30.0, 10.0), rank_queue(5))
        assert isinstance(coord.recv(node_queue(4)), Vote)
        wait_for(lambda: len(rx.timeouts) >= 3, 10, "a pop while voted")
        coord.send(Decision(1, False, None, {}, "aborted"), rank_queue(5))
        wait_for(lambda: p.state == "idle", 10, "the abort")
        wait_for(lambda: rx.timeouts[-1] is None, 10, "the idle pop")
    finally:
        p.close()
    # idle, planning (the first beat), then as many voted pops as the wait took, then idle again
    waits = rx.timeouts
    assert waits[:2] == [None, FIRST_BEAT_S]
    assert set(waits[2:-1]) == {voted_beat}
    assert waits[-1] is None


def test_a_planning_rank_first_says_it_is_alive_after_the_first_beat_then_every_beat():
    """A plan of 0.8 s: the listener waits FIRST_BEAT_S after the Prepare, says Alive, then
    waits BEAT_S between signs of life until the vote; a rank slow to plan is heard early in the
    coordinator's lease."""
    hub = MemoryHub()
    rx = PopTimeouts(hub, rank=0)
    p = Participant(FakeModel(0), rank=0, transport=rx, token=TOKEN, **FAKE_HOOKS).start()
    coord = Script(MemoryTransport(hub), TOKEN)
    try:
        assert isinstance(coord.recv(), Hello)
        p.step_boundary(0)
        coord.send(Prepare(1, {"name": "B", "sleep_rank": 0, "sleep_s": 0.8}, None, 30.0),
                   rank_queue(0))  # fmt: skip
        heard = [coord.recv()]
        while not isinstance(heard[-1], Vote):
            heard.append(coord.recv())
    finally:
        p.close()
    assert heard[:2] == [Alive(1, 0), Alive(1, 0)] and heard[-1].yes
    assert rx.timeouts[:3] == [None, FIRST_BEAT_S, BEAT_S]
