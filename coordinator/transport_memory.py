"""In-process transport: queues in a shared `MemoryHub`, for tests and inside the Ray actor."""

from __future__ import annotations

import threading
from collections import defaultdict, deque

from dist_quant.coordinator.transport import TransportError


class MemoryHub:
    """The queues themselves; thread-safe. Every `MemoryTransport` on one hub sees the same ones."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._queues: defaultdict[str, deque[bytes]] = defaultdict(deque)
        self._closed = False

    def push(self, queue: str, data: bytes) -> None:
        with self._cond:
            if self._closed:
                raise TransportError("memory hub is closed")
            self._queues[queue].append(bytes(data))
            self._cond.notify_all()

    def pop(self, queue: str, timeout: float | None = None) -> bytes | None:
        with self._cond:
            ready = self._cond.wait_for(lambda: self._queues[queue] or self._closed, timeout)
            if self._closed:
                raise TransportError("memory hub is closed")
            if not ready:
                return None
            return self._queues[queue].popleft()

    def close(self) -> None:
        """Makes every blocked and future call raise `TransportError`, like a dead server."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()


class MemoryTransport:
    """A handle on a `MemoryHub`."""

    def __init__(self, hub: MemoryHub | None = None) -> None:
        self.hub = hub if hub is not None else MemoryHub()

    def push(self, queue: str, data: bytes) -> None:
        self.hub.push(queue, data)

    def pop(self, queue: str, timeout: float | None = None) -> bytes | None:
        return self.hub.pop(queue, timeout)

    def clone(self) -> MemoryTransport:
        return MemoryTransport(self.hub)

    def close(self) -> None:
        """Handles own no resources; closing the hub is its owner's call."""
