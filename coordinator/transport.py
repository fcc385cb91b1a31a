"""The one seam between the protocol and the bytes: named FIFO queues.

A transport moves opaque byte strings (sealed messages, see `wire.py`) between named queues.
Every reader pops only its own queue (the coordinator pops `inbox`, rank r pops `rank/r`, a client
pops `reply/<id>`), so the protocol needs nothing else. Implementations: `transport_memory.py`
(threads of one process, for tests), `transport_store.py` (a torch.distributed TCPStore, torchrun),
`transport_ray.py` (a named Ray actor).

A transport object is used by one thread at a time; `clone()` gives another thread its own
handle on the same queues (a store client blocked in `pop` would otherwise block everyone). The
store client's clones share one connection, since a push needs no reply: only one handle of a
connection may pop (transport_store_client.py).
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from typing import Protocol


class TransportKind(str, enum.Enum):
    """Which transport a job's endpoint serves (`coordinator.json`'s "transport"); `attach`'s
    `transport="auto"` resolves to one of them. A plain `str` enum, not a `kinds.Kind`: the
    command-line client imports this file and never imports torch."""

    STORE = "store"
    """A TCPStore server on rank 0 (torchrun); the coordinator is a thread of rank 0."""
    RAY = "ray"
    """A named Ray actor holding the queues and the coordinator."""


class TransportError(ConnectionError):
    """The other side cannot be reached (server gone, connection lost)."""


class Transport(Protocol):
    def push(self, queue: str, data: bytes) -> None:
        """Append `data` to `queue`; never blocks for a reader."""
        ...

    def push_many(self, pushes: Sequence[tuple[str, bytes]]) -> None:
        """`push` each (queue, data) in order; on a store, in one write (a broadcast to every
        node is thousands of pushes, and a write per push is a system call and a GIL hand-off)."""
        ...

    def pop(self, queue: str, timeout: float | None = None) -> bytes | None:
        """Remove and return the oldest item; wait up to `timeout` seconds (None: forever).

        Returns None when the timeout passes; raises `TransportError` if the connection is lost.
        """
        ...

    def pop_many(self, queue: str, most: int, timeout: float | None = None) -> list[bytes]:
        """Remove and return up to `most` items, oldest first: whatever is queued, once at least
        one is (waiting up to `timeout` seconds, None: forever). [] when the timeout passes;
        `TransportError` as `pop`. For readers of busy queues (the coordinator's inbox, a relay's),
        which a message at a time would pay a round trip each."""
        ...

    def clone(self) -> Transport:
        """A handle on the same queues for another thread (a new connection, or a share of this
        one where the transport says so)."""
        ...

    def close(self) -> None: ...


class PairedTransport:
    """A connection and the clone made for it in advance: the first `clone()` returns that one.

    `attach` opens both of a rank's connections inside its all-or-none window, so that a failure
    of the second (the participant's own `clone()`) fails every rank together with attach's one
    message, instead of one rank alone with a raw `TransportError` after its peers moved on."""

    def __init__(self, first: Transport, second: Transport) -> None:
        self._first = first
        self._second: Transport | None = second

    def push(self, queue: str, data: bytes) -> None:
        self._first.push(queue, data)

    def push_many(self, pushes: Sequence[tuple[str, bytes]]) -> None:
        self._first.push_many(pushes)

    def pop(self, queue: str, timeout: float | None = None) -> bytes | None:
        return self._first.pop(queue, timeout)

    def pop_many(self, queue: str, most: int, timeout: float | None = None) -> list[bytes]:
        return self._first.pop_many(queue, most, timeout)

    def clone(self) -> Transport:
        second, self._second = self._second, None
        return second if second is not None else self._first.clone()

    def close(self) -> None:
        if self._second is not None:
            self._second.close()
            self._second = None
        self._first.close()
