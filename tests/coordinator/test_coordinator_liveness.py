"""The coordinator judges deadlines and silence only after draining its inbox: votes queued behind
a slow reader are counted, a rank that keeps saying it is alive is waited for, a silent one aborts
the switch at its lease. Hand-played ranks on a memory transport."""

import threading
import time

import pytest
from dist_quant.coordinator.protocol import Alive, StatusQuery, Vote
from dist_quant.coordinator.transport_memory import MemoryHub, MemoryTransport
from dist_quant.coordinator.wire import INBOX, rank_queue, reply_queue, seal, unseal
from test_coordinator import TOKEN, Job

SILENT = "no vote and no sign of life for 1.5 s: dead, stopped or cut off"


class SlowInbox(MemoryTransport):
    """The coordinator's reading connection takes 2 ms per message, as a busy rank 0 would."""

    def pop_many(self, queue, most, timeout=None):
        items = super().pop_many(queue, 1, timeout)  # one at a time, as a slow reader takes them
        if queue == INBOX:
            time.sleep(0.002 * len(items))
        return items

    def clone(self):
        return SlowInbox(self.hub)


def test_votes_pushed_before_the_deadline_but_still_queued_are_counted(tmp_path):
    world = 100  # 100 votes at 2 ms each: the last is read 0.2 s after the 0.05 s deadline
    hub = MemoryHub()
    job = Job(tmp_path, world=world, hub=hub, transport=SlowInbox(hub), commit_window_s=5.0)
    try:
        assert job.request("r1", timeout_s=0.05).status == "accepted"
        job.vote_all_yes(1)  # all pushed at once, well before the deadline passes
        body = job.result("r1").body
        assert body["committed"] is True, body["summary"]
        assert body["reasons"] == {}
    finally:
        job.close()


@pytest.fixture
def job(tmp_path):
    j = Job(tmp_path)
    yield j
    j.close()


def test_a_rank_silent_for_the_lease_aborts_the_switch_long_before_its_deadline(job):
    job.request("r1", timeout_s=60.0)
    job.prepares()
    job.s.send(Vote(1, 0, True, "d", 3, "", 0.0, 4))
    job.s.send(StatusQuery("q"))
    assert job.s.recv(reply_queue("q")).body["waiting_for"] == [1]
    body = job.result("r1").body
    assert body["committed"] is False and body["reasons"] == {"1": SILENT}
    assert body["summary"] == f"rank 1: {SILENT}"


def test_a_rank_that_keeps_saying_it_is_alive_is_waited_for(job):
    job.request("r1", timeout_s=60.0)
    job.prepares()
    job.s.send(Vote(1, 0, True, "d", 3, "", 0.0, 4))
    stop = threading.Event()

    def beat():  # rank 1 plans for 3 s, longer than the lease, saying it is alive
        while not stop.wait(0.5):
            job.s.tx.push(INBOX, seal(Alive(1, 1), TOKEN))

    beats = threading.Thread(target=beat, daemon=True)
    beats.start()
    try:
        time.sleep(3.0)
        assert job.s.silent(reply_queue("r1"), wait=0.0)  # still open
        job.s.send(Vote(1, 1, True, "d", 3, "", 0.0, 4))
        body = job.result("r1").body
    finally:
        stop.set()
        beats.join()
    assert body["committed"] is True, body["summary"]


def test_an_abort_naming_every_rank_reaches_each_rank_without_the_others_reasons(tmp_path):
    """A lost rack or a job too busy to answer gets thousands of ranks named; the client is told
    every reason, each rank only the verdict, so a rank's copy does not grow with the ranks
    named (sent to all N, their reasons made the abort's bytes grow with N^2)."""
    world = 64
    job = Job(tmp_path, world=world)
    try:
        job.request("r1", timeout_s=60.0)
        job.prepares()  # and nobody votes: the lease names every rank
        body = job.result("r1").body
        assert body["committed"] is False
        assert body["reasons"] == {str(r): SILENT for r in range(world)}
        sizes = set()
        for r in range(world):
            data = job.s.tx.pop(rank_queue(r), 5.0)
            decision = unseal(data, TOKEN)
            assert (decision.switch_id, decision.commit, decision.step) == (1, False, None)
            assert decision.reasons == {} and decision.summary == body["summary"]
            sizes.add(len(data))
        # one sealed copy for all: smaller than the 64 reasons alone would be
        assert len(sizes) == 1 and sizes.pop() < len(SILENT) * world
    finally:
        job.close()
