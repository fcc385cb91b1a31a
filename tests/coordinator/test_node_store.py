"""Node stores: nine ranks on three simulated hosts in this process, wired as `attach` wires a
store job across hosts (node_store.py): real TCP stores (rank 0's, and one per leader off rank
0's host), the real coordinator, relays and participants with training threads. Rank 0's store
holds one connection per other node, not one per rank; a leader whose store dies after the
COMMIT is logged leaves its node learning the decision from rank 0 (on a connection opened only
then) and publishing at S; one whose store dies before aborts the switch, and its node learns the
ABORT the same way."""

import threading
import time
from pathlib import Path

import pytest
from dist_quant.coordinator import fail_at, request_switch
from dist_quant.coordinator.coordinator import Coordinator
from dist_quant.coordinator.decision_log import DecisionLog
from dist_quant.coordinator.node_relay import NodeRelay
from dist_quant.coordinator.node_store import NodeStore, node_led_by, route
from dist_quant.coordinator.participant import Participant
from dist_quant.coordinator.transport import PairedTransport
from dist_quant.coordinator.transport_store import StoreServer
from dist_quant.coordinator.transport_store_client import StoreClientTransport
from switch_harness import FAKE_HOOKS, FakeModel, wait_for

TOKEN = "tok"
NODES = ((0, 1, 2), (3, 4, 5), (6, 7, 8))
WORLD = 9


def connections(port):
    """Established TCP connections whose local end is `port`: the server's side of each."""
    count = 0
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] == "01" and int(fields[1].rsplit(":", 1)[1], 16) == port:
                count += 1
    return count


class StoreJob:
    """Nine training threads with 10 ms steps. Rank 0's store and coordinator; leaders 3 and 6
    serve their node's store; every rank connects where `route` says, as attach connects it, and
    `links_opened` counts the connections ranks opened to rank 0 after attach."""

    def __init__(self, tmp_path, *, faults=()):
        self.server = StoreServer()
        job = self.server.address
        self.coord = Coordinator(
            StoreClientTransport(job),
            token=TOKEN,
            world_size=WORLD,
            tp_groups=NODES,
            log=DecisionLog(tmp_path / "decisions.jsonl"),
            relayed_nodes=NODES,
        )
        self.coord.start()
        self.stores = {}
        for node in NODES:
            if node_led_by(node[0], NODES) is not None:
                self.stores[node[0]] = NodeStore(node[0], node)
        addresses = {leader: store.address for leader, store in self.stores.items()}
        self.links_opened = []
        self.models = [FakeModel(r) for r in range(WORLD)]
        self.parts = []
        for r in range(WORLD):
            way = route(r, NODES, job, addresses)
            first = StoreClientTransport(way.home)
            relay = None
            if way.leader == r:
                local, upstream = StoreClientTransport(way.home), StoreClientTransport(job)
                relay = NodeRelay(local, upstream, token=TOKEN, leader=r, ranks=way.node,
                                  faults=faults)  # fmt: skip
            link = None
            if way.behind_node_store and way.leader != r:
                link = self._opener(r, job)
            self.parts.append(
                Participant(
                    self.models[r], rank=r, transport=PairedTransport(first, first.clone()),
                    token=TOKEN, upstream=way.upstream, relay=relay, coordinator_link=link,
                    faults=faults, **FAKE_HOOKS,
                ).start()
            )  # fmt: skip
        self.seen = [[] for _ in range(WORLD)]  # (step, recipe) at every boundary
        self.dead = set()  # ranks whose process is gone: their training stops
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._train, args=(r,)) for r in range(WORLD)]
        for t in self._threads:
            t.start()
        wait_for(lambda: all(self.seen), 10, "every rank to train")

    def _opener(self, rank, job):
        def open_link():
            self.links_opened.append(rank)
            return StoreClientTransport(job)

        return open_link

    def _train(self, rank):
        step = 0
        while not self._stop.is_set() and rank not in self.dead:
            self.parts[rank].step_boundary(step)
            self.seen[rank].append((step, self.models[rank].recipe))
            time.sleep(0.01)
            step += 1

    def kill_leader(self, leader):
        """The leader's process is gone: its training stops and its node's store with it."""
        self.dead.add(leader)
        self.stores[leader].close()  # no drain: nobody is told

    def request(self, timeout_s=30.0):
        client = StoreClientTransport(self.server.address)
        try:
            return request_switch({"name": "B"}, transport=client, token=TOKEN,
                                  timeout_s=timeout_s)  # fmt: skip
        finally:
            client.close()

    def run_past(self, step, ranks):
        wait_for(lambda: all(self.seen[r][-1][0] > step + 2 for r in ranks), 20, f"step {step + 3}")

    def close(self):
        self._stop.set()
        for t in self._threads:
            t.join(15)
        for p in self.parts:
            p.close(timeout=1.0)
        self.coord.stop()
        for store in self.stores.values():
            store.close(token=TOKEN)
        self.server.close()


@pytest.fixture
def job_factory(tmp_path):
    made = []

    def make(**kw):
        made.append(StoreJob(tmp_path, **kw))
        return made[-1]

    yield make
    for job in made:
        job.close()


def switched_at(seen):
    """The first step that ran recipe B (None: never)."""
    return next((step for step, recipe in seen if recipe == "B"), None)


# Rank 0's store: the three ranks of rank 0's host, its relay's two connections (each pops), one
# per other node (its leader's relay), the coordinator's, and the one the TCPStore server opens to
# itself. Each leader's store: its node's three ranks, its relay's, and the server's own.
RANK0_CONNECTIONS = 3 + 2 + (len(NODES) - 1) + 1 + 1
LEADER_CONNECTIONS = 3 + 1 + 1


def test_rank_0s_store_holds_a_connection_per_node_and_each_leader_serves_its_nodes_ranks(
    job_factory,
):
    job = job_factory()
    assert connections(job.server.port) == RANK0_CONNECTIONS
    assert [connections(s.port) for s in job.stores.values()] == [LEADER_CONNECTIONS] * 2
    result = job.request()
    assert result.committed, result
    job.run_past(result.step, range(WORLD))
    assert [switched_at(s) for s in job.seen] == [result.step] * WORLD
    wait_for(lambda: job.coord.phase.value == "published", 10, "every ack, through the relays")
    assert job.links_opened == []  # a healthy switch opens nothing to rank 0
    assert connections(job.server.port) == RANK0_CONNECTIONS


def test_a_leader_gone_after_the_commit_is_logged_leaves_its_node_publishing_at_s(job_factory):
    stuck = fail_at(rank=3, phase="relay", action="delay", seconds=60.0)
    job = job_factory(faults=(stuck,))
    result = job.request(timeout_s=5.0)
    assert result.committed, result
    job.kill_leader(3)  # the COMMIT is logged and sent, node 3's relay never hands it on
    live = [r for r in range(WORLD) if r != 3]
    job.run_past(result.step, live)
    assert [switched_at(job.seen[r]) for r in live] == [result.step] * len(live)
    assert sorted(job.links_opened) == [4, 5]  # they asked rank 0 once their store was gone
    # and closed those connections once they had the decision
    wait_for(lambda: connections(job.server.port) == RANK0_CONNECTIONS, 5, "the links to close")


def test_a_leader_gone_before_the_commit_aborts_and_its_node_learns_it_from_rank_0(job_factory):
    mute = fail_at(rank=3, phase="vote", action="delay", seconds=60.0)
    job = job_factory(faults=(mute,))
    outcome = {}
    asking = threading.Thread(target=lambda: outcome.update(result=job.request(timeout_s=10.0)))
    asking.start()
    wait_for(lambda: [job.parts[r].state for r in (4, 5)] == ["voted"] * 2, 10, "node 3 to vote")
    job.kill_leader(3)  # before its own vote: the coordinator finds rank 3 silent
    asking.join(20)
    result = outcome["result"]
    decided = time.monotonic()
    assert not result.committed
    assert "no sign of life for 1.5 s" in result.reasons[3]
    # ranks 4 and 5 learn the ABORT from rank 0, long before they would give up (10 s + grace)
    wait_for(lambda: [job.parts[r].state for r in (4, 5)] == ["idle"] * 2, 5, "the ABORT")
    assert time.monotonic() - decided < 5.0
    assert sorted(job.links_opened) == [4, 5]  # node 6 waited on its relay, which stayed up
    assert all(switched_at(s) is None for s in job.seen)


def test_route_sends_ranks_off_rank_0s_host_to_their_leaders_store_and_the_rest_to_rank_0s():
    nodes = ((0, 1), (2, 3, 4), (6, 7))  # rank 5 is alone on its host: no relay
    stores = {2: "127.0.0.1:2002", 6: "127.0.0.1:2006"}
    ways = [route(r, nodes, "10.0.0.1:1000", stores) for r in range(8)]
    assert [w.home for w in ways] == ["10.0.0.1:1000"] * 2 + ["127.0.0.1:2002"] * 3 + [
        "10.0.0.1:1000"
    ] + ["127.0.0.1:2006"] * 2
    assert [w.upstream for w in ways] == ["node/0"] * 2 + ["node/2"] * 3 + ["inbox"] + [
        "node/6"
    ] * 2
    assert [w.behind_node_store for w in ways] == [False] * 2 + [True] * 3 + [False] + [True] * 2
    assert [node_led_by(r, nodes) for r in range(8)] == [None, None, (2, 3, 4), None, None, None,
                                                         (6, 7), None]  # fmt: skip
    with pytest.raises(
        ValueError, match="rank 7's node \\[6, 7\\] has no store address for its leader rank 6"
    ):
        route(7, nodes, "10.0.0.1:1000", {2: "127.0.0.1:2002"})
