"""The one seam between the protocol and the bytes: named FIFO queues.

A transport moves opaque byte strings (sealed messages, see `wire.py`) between named queues.
Every reader pops only its own queue (the coordinator pops `inbox`, rank r pops `rank/r`, a client
pops `reply/<id>`), so the protocol needs nothing else. Implementations: `transport_memory.py`
(threads of one process, for tests), `transport_store.py` (a torch.distributed TCPStore, torchrun),
`transport_ray.py` (a named Ray actor).

A transport object is used by one thread at a time; `clone()` gives another thread its own
connection to the same queues (a store client blocked in `pop` would otherwise block everyone).
"""

from __future__ import annotations

from typing import Protocol


class TransportError(ConnectionError):
    """The other side cannot be reached (server gone, connection lost)."""


class Transport(Protocol):
    def push(self, queue: str, data: bytes) -> None:
        """Append `data` to `queue`; never blocks for a reader."""
        ...

    def pop(self, queue: str, timeout: float | None = None) -> bytes | None:
        """Remove and return the oldest item; wait up to `timeout` seconds (None: forever).

        Returns None when the timeout passes; raises `TransportError` if the connection is lost.
        """
        ...

    def clone(self) -> Transport:
        """A new connection to the same queues, for another thread."""
        ...

    def close(self) -> None: ...
