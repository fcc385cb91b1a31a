"""The coordinator's state machine, driven by hand-played ranks and clients on a memory transport."""

import threading
import time

import pytest
from dist_quant.coordinator import SwitchBusyError, SwitchRequestError, fail_at, request_switch
from dist_quant.coordinator.coordinator import Coordinator
from dist_quant.coordinator.decision_log import DecisionLog, DecisionLogError
from dist_quant.coordinator.phases import Phase
from dist_quant.coordinator.protocol import (
    Ack,
    Decision,
    Hello,
    Prepare,
    StatusQuery,
    SwitchRequest,
    Vote,
)
from dist_quant.coordinator.transport_memory import MemoryHub, MemoryTransport
from dist_quant.coordinator.wire import rank_queue, reply_queue, unseal
from switch_harness import Script, wait_for

TOKEN = "job-token"


def switch_records(log):
    """The log's records about switches (every coordinator start also records its attempt)."""
    return [r for r in log.records() if r["event"] != "attempt"]


def start_coordinator(transport, world, log, *, token=TOKEN, **options) -> Coordinator:
    """A started coordinator for `world` ranks in TP groups of two (an odd world's last is one)."""
    coord = Coordinator(
        transport,
        token=token,
        world_size=world,
        tp_groups=[tuple(range(g, min(g + 2, world))) for g in range(0, world, 2)],
        log=log,
        **options,
    )
    coord.start()
    return coord


class Job:
    """A coordinator for `world` ranks (TP groups of two) plus a scripted side to talk to it."""

    def __init__(
        self, tmp_path, world=2, log=None, faults=(), hub=None, transport=None, commit_window_s=0.5
    ):
        self.hub = hub or MemoryHub()
        self.log = log or DecisionLog(tmp_path / "decisions.jsonl")
        self.coord = start_coordinator(
            transport or MemoryTransport(self.hub),
            world,
            self.log,
            faults=faults,
            commit_window_s=commit_window_s,
        )
        self.s = Script(MemoryTransport(self.hub), TOKEN)
        self.world = world

    def request(self, rid, recipe=None, at_step=None, timeout_s=5.0):
        self.s.send(SwitchRequest(rid, recipe or {"name": "B"}, at_step, timeout_s))
        return self.s.recv(reply_queue(rid))

    def prepares(self):
        return [self.s.recv(rank_queue(r)) for r in range(self.world)]

    def vote_all_yes(self, switch_id, step=10):
        for r in range(self.world):
            self.s.send(Vote(switch_id, r, True, "d", step, "", 0.01, step + 1))

    def result(self, rid):
        return self.s.recv(reply_queue(rid))

    def close(self):
        self.coord.stop()


@pytest.fixture
def job(tmp_path):
    j = Job(tmp_path)
    yield j
    j.close()


def test_commit_walks_preparing_deciding_committed_published(job):
    accepted = job.request("r1")
    assert (accepted.status, accepted.switch_id) == ("accepted", 1)
    assert all(isinstance(p, Prepare) and p.switch_id == 1 for p in job.prepares())
    assert job.coord.phase is Phase.PREPARING
    job.vote_all_yes(1, step=10)
    result = job.result("r1")
    assert (result.status, result.body["committed"], result.body["step"]) == ("result", True, 11)
    decisions = [job.s.recv(rank_queue(r)) for r in range(2)]
    assert all(d == Decision(1, True, 11, {}, "commit at step 11") for d in decisions)
    assert job.coord.phase is Phase.COMMITTED
    job.s.send(Ack(1, 0, 11, True, "", "B"))
    job.s.send(StatusQuery("q"))  # answered after the ack is processed
    assert job.s.recv(reply_queue("q")).body["phase"] == "committed"  # one ack of two
    job.s.send(Ack(1, 1, 11, True, "", "B"))
    wait_for(lambda: job.coord.phase is Phase.PUBLISHED, 5, "published")
    events = [(r["event"], r["switch_id"]) for r in switch_records(job.log)]
    assert events == [("open", 1), ("decision", 1), ("published", 1)]


def test_second_request_while_one_is_open_is_refused_with_its_id(job):
    job.request("r1")
    job.prepares()
    refused = job.request("r2")
    assert (refused.status, refused.switch_id) == ("refused", 1)
    assert "switch 1 is still open" in refused.error
    with pytest.raises(SwitchBusyError) as info:
        request_switch({"name": "C"}, transport=MemoryTransport(job.hub), token=TOKEN)
    assert info.value.open_switch_id == 1


def test_replayed_vote_and_vote_for_an_old_switch_are_ignored(job):
    job.request("r1")
    job.prepares()
    for r in range(2):
        job.s.send(Vote(1, r, False, "", 3, f"no {r}", 0.0))
    assert job.result("r1").body["committed"] is False
    job.request("r2")
    job.prepares()
    job.s.send(Vote(1, 0, True, "d", 3, "", 0.0, 4))  # old switch id
    job.s.send(Vote(1, 1, True, "d", 3, "", 0.0, 4))
    job.s.send(Vote(2, 0, False, "", 3, "first vote of rank 0", 0.0))
    job.s.send(Vote(2, 0, True, "d", 3, "", 0.0, 4))  # replay with other content
    job.s.send(Vote(2, 1, True, "d", 3, "", 0.0, 4))
    body = job.result("r2").body
    assert body["committed"] is False
    assert body["reasons"] == {"0": "first vote of rank 0"}


def test_late_vote_past_the_deadline_aborts_and_is_then_ignored(job):
    job.request("r1", timeout_s=0.2)
    job.prepares()
    job.s.send(Vote(1, 0, True, "d", 3, "", 0.0, 4))
    body = job.result("r1").body
    assert body["committed"] is False
    assert "no vote before the deadline" in body["reasons"]["1"]
    job.s.send(Vote(1, 1, True, "d", 3, "", 0.0, 4))  # too late
    job.s.send(StatusQuery("q"))
    status = job.s.recv(reply_queue("q")).body
    assert status["phase"] == "aborted" and status["decisions"][-1]["commit"] is False


def test_request_with_the_wrong_token_is_refused_and_opens_nothing(job):
    wrong = Script(MemoryTransport(job.hub), "not-the-token")
    wrong.send(SwitchRequest("bad", {"name": "B"}, None, 1.0))
    reply = wrong.tx.pop(reply_queue("bad"), 5)
    assert reply is not None and b"wrong token" in reply
    with pytest.raises(SwitchRequestError, match="wrong token"):
        request_switch({"name": "B"}, transport=MemoryTransport(job.hub), token="nope")
    assert job.coord.phase is Phase.IDLE
    assert switch_records(job.log) == []
    assert job.s.silent(rank_queue(0))


def test_invalid_request_is_refused_without_opening_a_switch(job):
    refused = job.request("r1", timeout_s=-1.0)
    assert refused.status == "refused" and "timeout_s" in refused.error
    assert job.coord.phase is Phase.IDLE


@pytest.mark.skipif(not __import__("os").path.exists("/dev/full"), reason="needs /dev/full")
def test_unwritable_log_aborts_and_tells_the_requester(tmp_path):
    job = Job(tmp_path, log=DecisionLog("/dev/full"))
    try:
        assert job.request("r1").status == "accepted"
        body = job.result("r1").body
        assert body["committed"] is False and "not writable" in body["summary"]
        # No rank was asked to prepare; the only message a rank gets is the ABORT.
        first = job.s.recv(rank_queue(0))
        assert isinstance(first, Decision) and first.commit is False
        assert job.coord.phase is Phase.ABORTED
    finally:
        job.close()


class DecisionFailsLog(DecisionLog):
    """Writes "open" records but fails on "decision" ones, like a disk that fills up mid-switch."""

    def append(self, record):
        if record["event"] == "decision":
            raise DecisionLogError(28, "decision log is not writable: No space left on device")
        super().append(record)


def test_commit_that_cannot_be_logged_becomes_abort(tmp_path):
    job = Job(tmp_path, log=DecisionFailsLog(tmp_path / "d.jsonl"))
    try:
        job.request("r1")
        job.prepares()
        job.vote_all_yes(1)
        body = job.result("r1").body
        assert body["committed"] is False and "No space left" in body["summary"]
        assert [job.s.recv(rank_queue(r)).commit for r in range(2)] == [False, False]
    finally:
        job.close()


class CheckLogBeforeDecision(MemoryTransport):
    """Records, for every Decision pushed to a rank, whether the log already holds it."""

    def __init__(self, hub, log):
        super().__init__(hub)
        self.log, self.checks = log, []

    def push(self, queue, data):
        if queue.startswith("rank/") and isinstance(unseal(data, TOKEN), Decision):
            self.checks.append(any(r["event"] == "decision" for r in self.log.records()))
        super().push(queue, data)

    def clone(self):
        return self


def test_decision_is_in_the_log_before_any_rank_can_read_it(tmp_path):
    hub = MemoryHub()
    log = DecisionLog(tmp_path / "d.jsonl")
    spy = CheckLogBeforeDecision(hub, log)
    job = Job(tmp_path, log=log, hub=hub, transport=spy)
    try:
        job.request("r1")
        job.prepares()
        job.vote_all_yes(1)
        job.result("r1")
        assert spy.checks == [True, True]
    finally:
        job.close()


def test_coordinator_killed_before_deciding_leaves_no_decision_and_restart_aborts(tmp_path):
    job = Job(tmp_path, faults=[fail_at(phase="decide", action="stop")])
    job.request("r1")
    job.prepares()
    job.vote_all_yes(1)
    wait_for(lambda: not job.coord._threads[1].is_alive(), 5, "coordinator thread to end")
    assert job.s.silent(rank_queue(0), wait=0.2)  # nobody ever sees a decision
    assert [r["event"] for r in switch_records(job.log)] == ["open"]
    # A coordinator restarted on the same log closes switch 1 as aborted and continues at 2.
    again = Job(tmp_path, log=job.log)
    try:
        assert job.log.records()[-1]["commit"] is False
        assert again.request("r2").switch_id == 2
    finally:
        again.close()


def test_coordinator_killed_after_logging_never_makes_the_decision_visible(tmp_path):
    job = Job(tmp_path, faults=[fail_at(phase="publish", action="stop")])
    job.request("r1")
    job.prepares()
    job.vote_all_yes(1)
    wait_for(lambda: not job.coord._threads[1].is_alive(), 5, "coordinator thread to end")
    assert [r["event"] for r in switch_records(job.log)] == ["open", "decision"]
    assert job.s.silent(rank_queue(0), wait=0.2)
    assert job.s.silent(reply_queue("r1"), wait=0.05)  # the client never gets a result


def test_status_reports_phase_open_switch_and_recipe_per_rank(job):
    job.s.send(Hello(0, "A"))
    job.s.send(Hello(1, "A"))
    job.request("r1")
    job.s.send(StatusQuery("q"))
    body = job.s.recv(reply_queue("q")).body
    assert body["phase"] == "preparing" and body["open_switch"] == 1
    assert body["recipe_keys"] == {"0": "A", "1": "A"}
    assert body["world_size"] == 2 and body["tp_groups"] == [[0, 1]]


def test_requests_from_two_threads_at_once_open_exactly_one_switch(tmp_path):
    job = Job(tmp_path)
    outcomes = []

    def client(name):
        try:
            outcomes.append(
                request_switch({"name": name}, transport=MemoryTransport(job.hub), token=TOKEN)
            )
        except SwitchBusyError as e:
            outcomes.append(e)

    threads = [threading.Thread(target=client, args=(n,)) for n in ("B", "C")]
    for t in threads:
        t.start()
    try:
        wait_for(lambda: len(outcomes) == 1, 5, "the refused client")
        assert isinstance(outcomes[0], SwitchBusyError) and outcomes[0].open_switch_id == 1
        job.prepares()
        job.vote_all_yes(1)
        for t in threads:
            t.join(5)
        assert outcomes[1].committed is True and outcomes[1].switch_id == 1
    finally:
        job.close()


class SlowDecisionLog(DecisionLog):
    """A decision record whose fsync takes 0.4 s (a stalled disk)."""

    def append(self, record):
        if record["event"] == "decision" and record["commit"]:
            time.sleep(0.4)
        super().append(record)


def test_commit_logged_after_the_ranks_may_have_given_up_becomes_abort(tmp_path):
    """Ranks give up `decision_grace_s` after the deadline; a COMMIT that only becomes durable
    later than the commit window past the deadline must not be published."""
    log = SlowDecisionLog(tmp_path / "d.jsonl")
    job = Job(tmp_path, log=log, commit_window_s=0.1)
    try:
        job.request("r1", timeout_s=0.2)
        job.prepares()
        time.sleep(0.1)  # vote near the deadline; the decision is logged 0.4 s later
        job.vote_all_yes(1)
        body = job.result("r1").body
        assert body["committed"] is False and "after the vote deadline" in body["summary"]
        assert [job.s.recv(rank_queue(r)).commit for r in range(2)] == [False, False]
        outcomes = [r["commit"] for r in log.records() if r["event"] == "decision"]
        assert outcomes == [True, False]  # the ABORT is the switch's last word
    finally:
        job.close()


def test_commit_logged_within_the_window_is_published(tmp_path):
    job = Job(tmp_path, log=SlowDecisionLog(tmp_path / "d.jsonl"), commit_window_s=5.0)
    try:
        job.request("r1", timeout_s=0.2)
        job.prepares()
        job.vote_all_yes(1)
        assert job.result("r1").body["committed"] is True
    finally:
        job.close()


def test_the_commit_step_is_booked_ahead_by_the_lead_the_prepare_announced(job):
    job.request("r1")
    prepares = job.prepares()
    lead = prepares[0].lead_s
    assert lead == 0.05 + 2 * 100e-6  # no switch measured yet: the estimate for two ranks
    assert all(p.lead_s == lead for p in prepares)
    # the holds of ranks that voted where the Prepare found them, rank 0 at 10 ms per step:
    # 10 + 1 + floor(0.0502 / 0.01) = 16; rank 1 at 20 ms: 9 + 1 + floor(0.0502 / 0.02) = 12
    job.s.send(Vote(1, 0, True, "d", 10, "", 0.01, 16))
    job.s.send(Vote(1, 1, True, "d", 9, "", 0.01, 12))
    assert job.result("r1").body["step"] == 16
    assert [d.step for d in job.prepares()] == [16, 16]  # the Decision each rank reads
    for r in range(2):
        job.s.send(Ack(1, r, 16, True, "", "B"))
    wait_for(lambda: job.coord.phase is Phase.PUBLISHED, 5, "published")
    job.request("r2")
    again = job.prepares()[0].lead_s
    assert again >= 0.05 and again != lead  # from the first switch's measured latency
