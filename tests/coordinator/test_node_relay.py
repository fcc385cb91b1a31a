"""Node-level aggregation: two nodes of three ranks, each led by its lowest rank's relay, on a
memory transport with training threads. The coordinator hears only bundles and sends once per
node; a leader whose relay is gone before the COMMIT is logged aborts the switch (its node found
silent), one whose relay stops after leaves its ranks to ask the coordinator straight, and they
publish at the same step as everyone else. Nothing partial either way."""

import threading
import time
from collections import Counter

import pytest
from dist_quant.coordinator import fail_at, node_relay, request_switch
from dist_quant.coordinator.coordinator import Coordinator
from dist_quant.coordinator.decision_log import DecisionLog
from dist_quant.coordinator.node_relay import GATHER_S, NodeRelay, relayed_nodes
from dist_quant.coordinator.participant import Participant
from dist_quant.coordinator.protocol import Alive, Hello, Vote, run_messages
from dist_quant.coordinator.transport_memory import MemoryHub, MemoryTransport
from dist_quant.coordinator.wire import INBOX, node_queue, seal, unseal
from switch_harness import FAKE_HOOKS, FakeModel, wait_for

TOKEN = "tok"
NODES = ((0, 1, 2), (3, 4, 5))


class QueueLog(MemoryTransport):
    """Records (thread name, queue) of every push; clones share the record."""

    def __init__(self, hub, pushes):
        super().__init__(hub)
        self.pushes = pushes

    def push(self, queue, data):
        name = threading.current_thread().name  # dist_quant.<role>.<detail>, or a test thread
        role = name.split(".")[1] if name.startswith("dist_quant.") else "test"
        self.pushes[(role, queue)] += 1
        super().push(queue, data)

    def clone(self):
        return QueueLog(self.hub, self.pushes)


class Cluster:
    """Six training threads with 10 ms steps; `dead_relay`: node 3's relay never runs."""

    def __init__(self, tmp_path, *, dead_relay=False, relay_faults=()):
        self.hub, self.pushes = MemoryHub(), Counter()
        self.coord = Coordinator(
            QueueLog(self.hub, self.pushes),
            token=TOKEN,
            world_size=6,
            tp_groups=[(0, 1), (2, 3), (4, 5)],
            log=DecisionLog(tmp_path / "decisions.jsonl"),
            relayed_nodes=NODES,
        )
        self.coord.start()
        self.models = [FakeModel(r) for r in range(6)]
        self.parts = []
        for node in NODES:
            leader = min(node)
            for r in node:
                transport = QueueLog(self.hub, self.pushes)
                relay = None
                if r == leader and not (dead_relay and leader == 3):
                    relay = NodeRelay(
                        transport, transport.clone(), token=TOKEN, leader=r, ranks=node,
                        faults=relay_faults,
                    )  # fmt: skip
                self.parts.append(
                    Participant(
                        self.models[r], rank=r, transport=transport, token=TOKEN,
                        upstream=node_queue(leader), relay=relay, **FAKE_HOOKS,
                    ).start()
                )  # fmt: skip
        self.seen = [[] for _ in range(6)]  # (step, recipe) at every boundary
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._train, args=(r,)) for r in range(6)]
        for t in self._threads:
            t.start()
        wait_for(lambda: all(self.seen), 10, "every rank to train")

    def _train(self, rank):
        step = 0
        while not self._stop.is_set():
            self.parts[rank].step_boundary(step)
            self.seen[rank].append((step, self.models[rank].recipe))
            time.sleep(0.01)
            step += 1

    def request(self, **kw):
        return request_switch(
            {"name": "B"}, transport=MemoryTransport(self.hub), token=TOKEN, timeout_s=30.0, **kw
        )

    def run_past(self, step):
        wait_for(lambda: all(s and s[-1][0] > step + 2 for s in self.seen), 20, f"step {step}")

    def close(self):
        self._stop.set()
        for t in self._threads:
            t.join(10)
        for p in self.parts:
            p.close(timeout=1.0)
        self.coord.stop()
        self.hub.close()


@pytest.fixture
def cluster_factory(tmp_path):
    made = []

    def make(**kw):
        made.append(Cluster(tmp_path, **kw))
        return made[-1]

    yield make
    for c in made:
        c.close()


def switched_at(seen):
    """The first step that ran recipe B (None: never)."""
    return next((step for step, recipe in seen if recipe == "B"), None)


def test_the_coordinator_hears_bundles_and_sends_once_per_node(cluster_factory):
    c = cluster_factory()
    result = c.request()
    assert result.committed, result
    c.run_past(result.step)
    assert [switched_at(s) for s in c.seen] == [result.step] * 6
    wait_for(lambda: c.coord.phase.value == "published", 10, "every ack, through the relays")
    by_thread = {}
    for (thread, queue), n in c.pushes.items():
        by_thread.setdefault(thread, Counter())[queue] += n
    # the coordinator wrote each Prepare and Decision once per node, never to a rank
    assert set(by_thread["coordinator"]) <= {"node/0/down", "node/3/down", "inbox"} | {
        q for q in by_thread["coordinator"] if q.startswith("reply/")
    }
    assert by_thread["coordinator"]["node/0/down"] == by_thread["coordinator"]["node/3/down"] == 2
    # ranks (listeners, planners, training threads) write to their leader's relay, never to the
    # inbox; only the relays do, one bundle at a time
    assert by_thread["participant"]["inbox"] == 0
    assert set(by_thread["participant"]) <= {"node/0", "node/3"}
    assert by_thread["relay"]["inbox"] >= 2


def test_a_node_whose_leader_is_gone_before_the_commit_is_found_silent_and_nobody_switches(
    cluster_factory,
):
    c = cluster_factory(dead_relay=True)
    result = c.request()
    assert not result.committed
    assert set(result.reasons) == {3, 4, 5}
    assert all("no sign of life for 1.5 s" in why for why in result.reasons.values())
    time.sleep(1.5)  # ranks 4 and 5 learn the ABORT by asking the coordinator straight
    assert [p.state for p in c.parts] == ["idle"] * 6
    assert all(switched_at(s) is None for s in c.seen)


def test_a_relay_that_stops_after_the_commit_is_logged_leaves_its_node_publishing_at_s(
    cluster_factory,
):
    stuck = fail_at(rank=3, phase="relay", action="delay", seconds=60.0)
    c = cluster_factory(relay_faults=(stuck,))
    result = c.request()
    assert result.committed, result
    c.run_past(result.step)
    assert [switched_at(s) for s in c.seen] == [result.step] * 6  # nothing partial


def test_relayed_nodes_are_hosts_with_two_ranks_or_more_in_a_job_across_hosts():
    assert relayed_nodes(["a", "a", "a", "b", "b", "b"]) == ((0, 1, 2), (3, 4, 5))
    assert relayed_nodes(["a", "b", "a", "c"]) == ((0, 2),)  # lone ranks talk directly
    assert relayed_nodes(["a", "a", "a"]) == ()  # one host: rank 0 is every rank's host anyway
    with pytest.raises(ValueError, match="leader 1 is not the lowest of ranks"):
        NodeRelay(MemoryTransport(), MemoryTransport(), token=TOKEN, leader=1, ranks=(0, 1))


def relay_bundles(pushes_before_start, pushes_after_start=(), quiet_s=0.2):
    """Start a relay for node (0, 1, 2), push the messages, return the Bundles it sent (each a
    list of (kind, rank), or of (kind, (first, last)) for a summary) once the inbox has been
    quiet for `quiet_s`."""
    hub = MemoryHub()
    transport = MemoryTransport(hub)
    for msg in pushes_before_start:
        transport.push(node_queue(0), seal(msg, TOKEN))
    relay = NodeRelay(transport, transport.clone(), token=TOKEN, leader=0, ranks=(0, 1, 2)).start()
    for msg in pushes_after_start:
        transport.push(node_queue(0), seal(msg, TOKEN))
    bundles = []
    while (data := transport.pop(INBOX, quiet_s)) is not None:
        bundle = unseal(data, TOKEN)
        messages = [m for run in bundle.runs for m in run_messages(run)]
        bundles.append(
            [(m.kind, m.rank if hasattr(m, "rank") else (m.first, m.last)) for m in messages]
        )
    relay.stop()
    hub.close()
    return bundles


def vote(rank, switch_id=7):
    return Vote(switch_id, rank, True, "digest", 10, "", 0.001, 11)


@pytest.fixture
def long_gather(monkeypatch):
    """A gather window far longer than the test waits: what arrives was sent without waiting."""
    monkeypatch.setattr(node_relay, "GATHER_S", 60.0)


def test_a_nodes_votes_of_a_switch_go_as_one_bundle_once_the_last_arrives(long_gather):
    votes = [vote(r) for r in (2, 0, 1)]
    got = relay_bundles(votes[:1], votes[1:], quiet_s=5.0)
    assert got == [[("vote_summary", (0, 2))]]  # the node agrees: one summary


def test_a_hello_goes_at_once_with_whatever_is_held(long_gather):
    assert relay_bundles([vote(0), Hello(1, "k")], quiet_s=5.0) == [[("vote", 0), ("hello", 1)]]


def test_a_nodes_signs_of_life_go_as_one_summary_once_each_planning_rank_beat(long_gather):
    beats = [Alive(7, r) for r in (1, 0, 2)]
    assert relay_bundles(beats[:1], beats[1:], quiet_s=5.0) == [[("alive_summary", (0, 2))]]


def test_a_rank_that_does_not_vote_holds_its_nodes_votes_only_for_the_gather_window():
    assert relay_bundles([], [vote(0), vote(1)], quiet_s=10 * GATHER_S) == [
        [("vote_summary", (0, 1))]
    ]
