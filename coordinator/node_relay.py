"""A node leader's relay: its node's messages go up to the coordinator as one `Bundle`, the
coordinator's messages come down once per node and are handed to each rank of the node.

The lowest rank of every host runs one in a job that spans hosts (`attach` learns the hosts from
its locality all-gather). Two threads, each with its own connection: `up` pops `node/<leader>`,
takes whatever has queued up behind the first message (up to `MAX_BUNDLE`), checks each against
the token and pushes them to the coordinator's inbox as one Bundle; `down` pops
`node/<leader>/down` and pushes each message, unchanged, to every rank of the node. Rank 0 then
reads and writes O(nodes) messages per switch, not O(ranks).

The relay decides nothing, so the protocol's rules hold unchanged. A leader that dies before the
COMMIT is logged takes its node's votes and `Alive`s with it: the coordinator finds those ranks
silent after its lease and aborts. One that dies after leaves its node without the decision: each
of those ranks asks the coordinator straight (`DecisionQuery`) once it waits at its hold step, so
it still publishes at the commit step, or learns the ABORT.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

from dist_quant.coordinator.faults import Fault, inject
from dist_quant.coordinator.protocol import Bundle, Decision, Message, ProtocolError, Stop
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
    """Relays for the node whose lowest rank is `leader` and whose ranks are `ranks`."""

    def __init__(
        self,
        transport: Transport,
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
        self._up = transport.clone()
        self._down = transport.clone()
        self._say = SwitchLog(leader)
        self._threads = [
            threading.Thread(target=target, name=f"dist_quant.relay.r{leader}.{name}", daemon=True)
            for target, name in ((self._relay_up, "up"), (self._relay_down, "down"))
        ]

    def start(self) -> NodeRelay:
        for t in self._threads:
            t.start()
        return self

    def stop(self, transport: Transport, timeout: float = 5.0) -> None:
        """Ask both threads to end (a Stop in each of their queues, pushed on `transport`) and
        join them; each says so in the `closed` queue, as a listener does."""
        stop = seal(Stop(f"relay of node {self.leader}"), self._token)
        for queue in (node_queue(self.leader), node_down_queue(self.leader)):
            try:
                transport.push(queue, stop)
            except TransportError:
                return  # the store is gone: both threads have ended with it
        for t in self._threads:
            t.join(timeout)

    def _relay_up(self) -> None:
        queue = node_queue(self.leader)
        try:
            while True:
                batch = [self._up.pop(queue)]
                while len(batch) < MAX_BUNDLE:
                    more = self._up.pop(queue, 0)
                    if more is None:
                        break
                    batch.append(more)
                items, stopping = self._checked(batch)
                if items:
                    self._up.push(INBOX, seal(Bundle(self.leader, tuple(items)), self._token))
                if stopping:
                    self._closed(self._up)
                    return
        except TransportError as e:
            self._say.info(f"relay up ends: {e}")

    def _checked(self, batch: list[bytes]) -> tuple[list[dict], bool]:
        """The messages of `batch` sealed with the job's token, as dicts; and whether a Stop was
        among them (what came before it is still sent)."""
        items: list[dict] = []
        for data in batch:
            try:
                msg: Message = unseal(data, self._token)
            except ProtocolError as e:
                self._say.warning(f"relay dropped a message: {e}")
                continue
            if isinstance(msg, Stop):
                return items, True
            items.append(msg.to_dict())
        return items, False

    def _relay_down(self) -> None:
        queue = node_down_queue(self.leader)
        try:
            while True:
                data = self._down.pop(queue)
                try:
                    msg = unseal(data, self._token)
                except ProtocolError as e:
                    self._say.warning(f"relay dropped a message: {e}")
                    continue
                if isinstance(msg, Stop):
                    self._closed(self._down)
                    return
                if isinstance(msg, Decision):
                    inject(self._faults, "relay", rank=self.leader, switch_id=msg.switch_id)
                for r in self.ranks:
                    self._down.push(rank_queue(r), data)
        except TransportError as e:
            self._say.info(f"relay down ends: {e}")

    def _closed(self, transport: Transport) -> None:
        try:
            transport.push(CLOSED, seal(Stop(f"relay of node {self.leader}"), self._token))
        except TransportError:
            pass  # the store is gone: nobody waits for this
