"""A node leader's relay: its node's messages go up to the coordinator as one `Bundle`, the
coordinator's messages come down once per node and are handed to each rank of the node.

The lowest rank of every host runs one in a job that spans hosts (`attach` learns the hosts from
its locality all-gather). It joins two stores: the node's own (`local`: off rank 0's host, the
store the leader serves for its node, `node_store.py`; on rank 0's host, the job's) and rank 0's
(`upstream`, where the coordinator's inbox is). Two threads, each popping its own connection:
`up` pops `node/<leader>` from the node's store, gathers the node's messages, checks each against
the token and pushes them to the coordinator's inbox as one Bundle: votes and acks of a switch wait
(at most `GATHER_S`) until every rank of the node has sent its own, so a node's round costs rank 0
one message, not one per rank, and so do the signs of life (`Alive`) of a node's ranks that are
still planning, beat by beat; anything else (hellos, cancel votes) goes at once, with
whatever is held; `down` pops `node/<leader>/down` from rank 0's store and pushes each message,
unchanged, to every rank's queue in the node's store. Rank 0 then reads and writes O(nodes)
messages per switch, not O(ranks), and (with node stores) holds one connection per node.

A bundle's uniform runs of votes (acks, signs of life) go up summarized (`summarized`):
consecutive ranks of the node that all voted YES on one switch with one digest after one last
step (all acked ok at one step with one recipe; all said they are alive planning one switch)
become one `VoteSummary` (`AckSummary`, `AliveSummary`) carrying what the coordinator uses of
them, so it takes a node in as one range and a switch costs it O(nodes). Whatever is not uniform
(a NO, another digest or step, a failed ack) goes one by one as before.

The relay decides nothing, so the protocol's rules hold unchanged. A leader that dies before the
COMMIT is logged takes its node's votes and `Alive`s with it: the coordinator finds those ranks
silent after its lease and aborts. One that dies after leaves its node without the decision: each
of those ranks asks the coordinator straight (`DecisionQuery`, on a connection to rank 0 it opens
only then) once it waits at its hold step, so it still publishes at the commit step, or learns
the ABORT.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence

from dist_quant.coordinator.faults import Fault, inject
from dist_quant.coordinator.protocol import (
    Ack,
    AckSummary,
    Alive,
    AliveSummary,
    Bundle,
    Decision,
    Message,
    ProtocolError,
    Stop,
    Vote,
    VoteSummary,
)
from dist_quant.coordinator.switch_log import SwitchLog
from dist_quant.coordinator.transport import Transport, TransportError
from dist_quant.coordinator.wire import (
    CLOSED,
    INBOX,
    node_down_queue,
    node_queue,
    rank_queue,
    seal,
    unseal,
)

MAX_BUNDLE = 4096  # messages per Bundle; a node holds far fewer ranks
_DOWN_BATCH = 16  # the coordinator's messages to a node come a few per switch
# how long a vote or ack waits for the rest of its node: a node's ranks plan and publish the same
# model at the same step, so they answer within milliseconds of each other; a rank that does not
# (slow, dead) delays its node's others by this much, far inside the coordinator's 1.5 s lease
GATHER_S = 0.02
# one per rank per switch (a sign of life: per rank per beat): the rounds worth gathering
_GATHERED = (Vote, Ack, Alive)


def relayed_nodes(hosts: Sequence[str]) -> tuple[tuple[int, ...], ...]:
    """The nodes that get a relay, from each rank's host (`hosts[rank]`): in a job that spans
    hosts, every host with two ranks or more (a lone rank talks to the coordinator itself)."""
    nodes: dict[str, list[int]] = {}
    for rank, host in enumerate(hosts):
        nodes.setdefault(host, []).append(rank)
    if len(nodes) < 2:
        return ()
    return tuple(tuple(ranks) for ranks in nodes.values() if len(ranks) > 1)


class NodeRelay:
    """Relays for the node whose lowest rank is `leader` and whose ranks are `ranks`, between the
    node's store (`local`) and rank 0's (`upstream`); it owns both connections and closes them
    in `stop`. Both may be connections to one store (rank 0's node), never one connection: each
    is popped by a thread of its own."""

    def __init__(
        self,
        local: Transport,
        upstream: Transport,
        *,
        token: str,
        leader: int,
        ranks: Sequence[int],
        faults: Sequence[Fault] = (),
    ) -> None:
        if leader not in ranks or leader != min(ranks):
            raise ValueError(f"node relay: leader {leader} is not the lowest of ranks {ranks}")
        self.leader = leader
        self.ranks = tuple(sorted(ranks))
        self._token = token
        self._faults = tuple(faults)
        # a pop holds its connection, a push does not: each thread pushes on a share of the
        # connection the other pops (store clients' clones share it, transport_store_client.py)
        self._up_in, self._up_out = local, upstream.clone()
        self._down_in, self._down_out = upstream, local.clone()
        self._stop_local, self._stop_upstream = local.clone(), upstream.clone()
        self._say = SwitchLog(leader)
        self._stopped = False
        self._threads = [
            threading.Thread(target=target, name=f"dist_quant.relay.r{leader}.{name}", daemon=True)
            for target, name in ((self._relay_up, "up"), (self._relay_down, "down"))
        ]

    def start(self) -> NodeRelay:
        for t in self._threads:
            t.start()
        return self

    def stop(self, timeout: float = 5.0) -> None:
        """Ask both threads to end (a Stop in each of their queues), join them and close the
        relay's connections; idempotent. Each thread says so in the `closed` queue of the store
        it was reading, as a listener does. Either store may be gone already (the job's end, or
        rank 0's): that thread has ended with it."""
        if self._stopped:
            return
        self._stopped = True
        stop = seal(Stop(f"relay of node {self.leader}"), self._token)
        for transport, queue in (
            (self._stop_local, node_queue(self.leader)),
            (self._stop_upstream, node_down_queue(self.leader)),
        ):
            try:
                transport.push(queue, stop)
            except TransportError:
                pass  # that store is gone, and the thread reading it with it
        for t in self._threads:
            if t.ident is not None:  # started
                t.join(timeout)
        for transport in (self._up_out, self._down_out, self._stop_local, self._stop_upstream,
                          self._up_in, self._down_in):  # fmt: skip
            transport.close()

    def _relay_up(self) -> None:
        queue = node_queue(self.leader)
        held = _Gather(self.ranks)
        try:
            while True:
                wait = held.wait_s(time.monotonic())
                # everything its node queued at once, never more than a bundle holds
                batch = self._up_in.pop_many(queue, MAX_BUNDLE - len(held.items), wait)
                stopping = False
                now = time.monotonic()
                for data in batch:
                    msg = self._checked(data)
                    if isinstance(msg, Stop):
                        stopping = True  # its node's ranks have stopped: nothing follows it
                        break
                    if msg is not None:
                        held.add(msg, now)
                if held.items and (stopping or held.due(time.monotonic())):
                    items = held.take()
                    bundle = Bundle.of(self.leader, summarized(self.leader, self.ranks, items))
                    self._up_out.push(INBOX, seal(bundle, self._token))
                if stopping:
                    self._closed(self._up_in)
                    return
        except TransportError as e:
            self._say.info(f"relay up ends: {e}")

    def _checked(self, data: bytes) -> Message | None:
        """The message if it is sealed with the job's token (else None, with a warning)."""
        try:
            return unseal(data, self._token)
        except ProtocolError as e:
            self._say.warning(f"relay dropped a message: {e}")
            return None

    def _relay_down(self) -> None:
        queue = node_down_queue(self.leader)
        try:
            while True:
                for data in self._down_in.pop_many(queue, _DOWN_BATCH):
                    try:
                        msg = unseal(data, self._token)
                    except ProtocolError as e:
                        self._say.warning(f"relay dropped a message: {e}")
                        continue
                    if isinstance(msg, Stop):
                        self._closed(self._down_in)
                        return
                    if isinstance(msg, Decision):
                        inject(self._faults, "relay", rank=self.leader, switch_id=msg.switch_id)
                    hand_down(self._down_out, self.ranks, data)
        except TransportError as e:
            self._say.info(f"relay down ends: {e}")

    def _closed(self, transport: Transport) -> None:
        try:
            transport.push(CLOSED, seal(Stop(f"relay of node {self.leader}"), self._token))
        except TransportError:
            pass  # the store is gone: nobody waits for this


def hand_down(out: Transport, ranks: Sequence[int], data: bytes) -> None:
    """Hand one of the coordinator's messages, as sealed, to every rank of a node: one write."""
    out.push_many([(rank_queue(r), data) for r in ranks])


def summarized(leader: int, node: Sequence[int], messages: Sequence[Message]) -> list[Message]:
    """`messages` with every run of two or more consecutive ranks of `node` whose votes (acks,
    signs of life) agree replaced by one summary. Votes agree when they are YES on one switch
    with one digest, the same part digests and the same last step, with no reason; acks when
    they are ok on one switch at one step with one recipe key and no error; `Alive`s when they
    are for one switch. A summary takes the place of its run's last message: the coordinator
    takes a whole bundle in before its phase moves on, and what a rank sends in one round (a
    sign of life that crossed its vote) does not depend on the order. A rank with two messages in one group, or outside the node, is never
    summarized. The relay only restates what each rank sent: it decides nothing."""
    members = frozenset(node)
    groups: dict[tuple, dict[int, int]] = {}  # agreement key -> rank -> its message's position
    twice: set[tuple] = set()
    for i, m in enumerate(messages):
        key = _agreement(m)
        if key is None or m.rank not in members:
            continue
        at = groups.setdefault(key, {})
        if m.rank in at:
            twice.add((key, m.rank))
        at[m.rank] = i
    placed: dict[int, list[Message]] = {}  # position -> the summaries that take it
    gone: set[int] = set()
    for key, at in groups.items():
        ranks = sorted(r for r in at if (key, r) not in twice)
        for run in _consecutive(ranks):
            if len(run) < 2:
                continue
            positions = [at[r] for r in run]
            gone.update(positions)
            summary = _summary(leader, [messages[i] for i in sorted(positions)], run[0], run[-1])
            placed.setdefault(max(positions), []).append(summary)
    out: list[Message] = []
    for i, m in enumerate(messages):
        out.extend(placed.get(i, ()))
        if i not in gone:
            out.append(m)
    return out


def _agreement(m: Message) -> tuple | None:
    """What a vote (ack) must share with the others of a run to be summarized with them; None
    for a message that is never summarized."""
    if (
        isinstance(m, Vote)
        and m.yes
        and not m.reason
        and type(m.last_step) is int
        and type(m.hold_step) is int
        and m.hold_step > m.last_step  # else `decide` refuses it, naming this rank alone
    ):
        # names -> digests, strings both (the wire schema's check): equal items, equal dicts
        parts = tuple(sorted(m.part_digests.items()))
        return ("vote", m.switch_id, m.digest, parts, m.last_step)
    if isinstance(m, Ack) and m.ok and not m.error:
        return ("ack", m.switch_id, m.step, m.recipe_key)
    if isinstance(m, Alive):
        return ("alive", m.switch_id)
    return None


def _consecutive(ranks: list[int]) -> list[list[int]]:
    """Sorted distinct ranks as runs of consecutive ranks."""
    runs: list[list[int]] = []
    for r in ranks:
        if runs and runs[-1][-1] == r - 1:
            runs[-1].append(r)
        else:
            runs.append([r])
    return runs


def _summary(leader: int, run: list[Message], first: int, last: int) -> Message:
    """The summary of `run` (votes or acks that agree) for ranks `first`..`last`."""
    m = run[0]
    if isinstance(m, Ack):
        return AckSummary(m.switch_id, leader, first, last, m.step, m.recipe_key)
    if isinstance(m, Alive):
        return AliveSummary(m.switch_id, leader, first, last)
    return VoteSummary(
        m.switch_id, leader, first, last, m.digest, dict(m.part_digests), m.last_step,
        max(v.hold_step for v in run), max(v.prepare_s for v in run),
    )  # fmt: skip


class _Gather:
    """The messages a relay holds for its next Bundle, and when it must send them: at once for
    anything but a vote, ack or sign of life; for those, once every rank of the node has sent
    its own for the switch (of each kind held), or `GATHER_S` after the first of them arrived,
    or when the bundle is full. (A node's ranks get the Prepare together and beat every `BEAT_S`
    from then, so their signs of life go as one bundle per beat; a rank that already voted no
    longer beats, and the others' wait `GATHER_S`, far inside the coordinator's lease.)"""

    def __init__(self, ranks: Sequence[int]) -> None:
        self._node = frozenset(ranks)
        self.items: list[Message] = []
        self._waiting: dict[tuple[str, int], set[int]] = {}  # (kind, switch) -> ranks heard
        self._urgent = False
        self._since: float | None = None

    def add(self, msg: Message, now: float) -> None:
        self.items.append(msg)
        if isinstance(msg, _GATHERED) and msg.rank in self._node:
            self._waiting.setdefault((msg.kind, msg.switch_id), set()).add(msg.rank)
            if self._since is None:
                self._since = now
        else:
            self._urgent = True

    def due(self, now: float) -> bool:
        if self._urgent or len(self.items) >= MAX_BUNDLE:
            return True
        if all(heard == self._node for heard in self._waiting.values()):
            return True
        return self._since is not None and now - self._since >= GATHER_S

    def wait_s(self, now: float) -> float | None:
        """How long the next pop may block: until the held messages are due, or for ever."""
        if self._since is None:
            return None
        return max(0.0, self._since + GATHER_S - now)

    def take(self) -> list[Message]:
        items, self.items = self.items, []
        self._waiting.clear()
        self._urgent, self._since = False, None
        return items
