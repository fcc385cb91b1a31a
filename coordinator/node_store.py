"""Node stores: in a store job that spans hosts, each node leader off rank 0's host serves its
node's queues from a store of its own, so that rank 0's store holds O(nodes) connections.

Who connects where (`route`), for a job whose hosts hold two ranks or more (`relayed_nodes`):

| rank | its queue `rank/<r>` and its connection | its messages for the coordinator go to |
|---|---|---|
| on rank 0's host, or alone on its host | rank 0's store | `node/0` (its node's relay) or `inbox` |
| on another host | its node leader's store (loopback) | `node/<leader>` in that store |
| that node's leader, also | its relay: one connection to its own store, one to rank 0's | |

Rank 0's store then holds one connection per remote node (its leader's relay), one per rank of
rank 0's own host (and of a host with one rank), the coordinator's and the relay's of rank 0's
node. The ranks of one host share one network namespace (`locality.py`), so a leader's store
listens on loopback only, and the leader's own connection to rank 0 vouches that every rank of
its node reaches rank 0 too: a rank opens one there only when it must ask for a decision its
relay did not bring (`DecisionQuery`, see `participant.py`), never at attach.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from dist_quant.coordinator.protocol import Stop
from dist_quant.coordinator.transport import Transport, TransportError
from dist_quant.coordinator.transport_store import StoreServer
from dist_quant.coordinator.transport_store_client import StoreClientTransport
from dist_quant.coordinator.wire import CLOSED, INBOX, node_queue, rank_queue, seal

LOOPBACK = "127.0.0.1"
DRAIN_S = 1.0  # how long closing a store waits for the listeners reading it to stop


@dataclass(frozen=True)
class Route:
    """Where one rank of a store job connects (`home`: the store holding its queue) and where its
    messages for the coordinator go (`upstream`); `job` is rank 0's store, `node` the ranks of
    its relayed node (empty: it talks to the coordinator itself)."""

    home: str
    job: str
    node: tuple[int, ...]

    @property
    def leader(self) -> int | None:
        return min(self.node) if self.node else None

    @property
    def upstream(self) -> str:
        return INBOX if self.leader is None else node_queue(self.leader)

    @property
    def behind_node_store(self) -> bool:
        """The rank's queue lives in its leader's store: it reaches rank 0 only through the relay
        (or a connection opened on purpose)."""
        return self.home != self.job


def route(
    rank: int,
    nodes: Sequence[Sequence[int]],
    job: str,
    node_stores: Mapping[int, str],
) -> Route:
    """`rank`'s route, given the relayed nodes, rank 0's store address and each node leader's
    store address (`node_stores`: leader -> address, for every node without rank 0)."""
    node = next((tuple(sorted(n)) for n in nodes if rank in n), ())
    if not node or 0 in node:
        return Route(job, job, node)
    leader = node[0]
    if leader not in node_stores:
        raise ValueError(
            f"node store: rank {rank}'s node {list(node)} has no store address for its leader "
            f"rank {leader}"
        )
    return Route(node_stores[leader], job, node)


def node_led_by(rank: int, nodes: Sequence[Sequence[int]]) -> tuple[int, ...] | None:
    """The node `rank` serves a store for: one it leads, off rank 0's host; else None."""
    for n in nodes:
        if rank == min(n) and 0 not in n:
            return tuple(sorted(n))
    return None


class NodeStore:
    """The store a node leader serves its node's ranks from (a `StoreServer` on loopback)."""

    def __init__(self, leader: int, ranks: Sequence[int]) -> None:
        """Raises `TransportError` naming the leader when the server cannot start."""
        self.leader = leader
        self.ranks = tuple(sorted(ranks))
        try:
            self._server: StoreServer | None = StoreServer(LOOPBACK)
        except TransportError as e:
            raise TransportError(f"rank {leader} cannot start its node's store: {e}") from e

    @property
    def address(self) -> str:
        if self._server is None:
            raise TransportError(f"rank {self.leader}'s node store is closed")
        return self._server.address

    @property
    def port(self) -> int:
        if self._server is None:
            raise TransportError(f"rank {self.leader}'s node store is closed")
        return self._server.port

    def close(self, token: str | None = None) -> None:
        """Stop the node's listeners (Stops sealed with the job's `token`; a bounded wait), then
        the server; idempotent. Without a token (attach failed before the job had one), no
        listener runs yet: the server just stops. The leader's listener and relay have stopped
        before: their `closed` notes count among those awaited."""
        if self._server is None:
            return
        if token is not None:
            self._drain(token)
        self._server.close()
        self._server = None

    def _drain(self, token: str) -> None:
        try:
            tx = StoreClientTransport(self._server.address, connect_timeout_s=DRAIN_S)
            try:
                queues = [rank_queue(r) for r in self.ranks]
                drain(tx, token, queues, expected=len(queues) + 1)  # and the relay's up
            finally:
                tx.close()
        except TransportError:
            pass  # nothing can be blocked on a store nobody reaches


def drain(tx: Transport, token: str, queues: Sequence[str], *, expected: int) -> None:
    """Push a Stop into each of `queues` on `tx`, then wait (at most DRAIN_S) for `expected`
    readers to say in `closed` that they stopped, so that closing the store leaves no reader
    blocked on it. A reader that exited without closing says nothing: the first quiet wait ends
    the drain."""
    stop = seal(Stop("store closing"), token)
    for queue in queues:
        tx.push(queue, stop)
    deadline = time.monotonic() + DRAIN_S
    for _ in range(expected):
        if tx.pop(CLOSED, max(deadline - time.monotonic(), 0.001)) is None:
            break
