"""In-process transport: queues in a shared `MemoryHub`, for tests and inside the Ray actor.

Inside the Ray actor every rank's listener keeps one `pop` blocked, so a push must wake only the
readers of its own queue: each queue has its own condition (all sharing the hub's one lock), and a
push notifies one reader of that queue, so N messages cost N wake-ups, not N per message.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable, Sequence

from dist_quant.coordinator.transport import TransportError


class _Queue:
    """One named FIFO and the readers waiting on it."""

    def __init__(self, lock: threading.Lock) -> None:
        self.items: deque[bytes] = deque()
        self.ready = threading.Condition(lock)


class MemoryHub:
    """The queues themselves; thread-safe. Every `MemoryTransport` on one hub sees the same ones.

    `on_push(queue)`, if given, is called after every push (outside the lock, on the pushing
    thread) and once with None on close: how readers that do not block in `pop` (the Ray actor's
    coroutines) learn that an item or the end has come."""

    def __init__(self, on_push: Callable[[str | None], None] | None = None) -> None:
        self._lock = threading.Lock()
        self._queues: dict[str, _Queue] = {}
        self._closed = False
        self._on_push = on_push

    def _queue(self, name: str) -> _Queue:
        """Called with the lock held."""
        q = self._queues.get(name)
        if q is None:
            q = self._queues[name] = _Queue(self._lock)
        return q

    def push(self, queue: str, data: bytes) -> None:
        with self._lock:
            if self._closed:
                raise TransportError("memory hub is closed")
            q = self._queue(queue)
            q.items.append(bytes(data))
            q.ready.notify()  # one item, one reader
        if self._on_push is not None:
            self._on_push(queue)

    def pop(self, queue: str, timeout: float | None = None) -> bytes | None:
        items = self.pop_many(queue, 1, timeout)
        return items[0] if items else None

    def pop_many(self, queue: str, most: int, timeout: float | None = None) -> list[bytes]:
        if most < 1:
            raise ValueError(f"memory hub: pop_many needs most >= 1, got {most}")
        with self._lock:
            q = self._queue(queue)
            ready = q.ready.wait_for(lambda: q.items or self._closed, timeout)
            if self._closed:
                raise TransportError("memory hub is closed")
            if not ready:
                return []
            items = [q.items.popleft() for _ in range(min(most, len(q.items)))]
            if q.items:
                # a reader notified for an item another thread took without waiting
                q.ready.notify()
            return items

    def close(self) -> None:
        """Makes every blocked and future call raise `TransportError`, like a dead server."""
        with self._lock:
            self._closed = True
            for q in self._queues.values():
                q.ready.notify_all()
        if self._on_push is not None:
            self._on_push(None)


class MemoryTransport:
    """A handle on a `MemoryHub`."""

    def __init__(self, hub: MemoryHub | None = None) -> None:
        self.hub = hub if hub is not None else MemoryHub()

    def push(self, queue: str, data: bytes) -> None:
        self.hub.push(queue, data)

    def push_many(self, pushes: Sequence[tuple[str, bytes]]) -> None:
        for queue, data in pushes:  # through `push`, which a subclass may watch
            self.push(queue, data)

    def pop(self, queue: str, timeout: float | None = None) -> bytes | None:
        return self.hub.pop(queue, timeout)

    def pop_many(self, queue: str, most: int, timeout: float | None = None) -> list[bytes]:
        return self.hub.pop_many(queue, most, timeout)

    def clone(self) -> MemoryTransport:
        return MemoryTransport(self.hub)

    def close(self) -> None:
        """Handles own no resources; closing the hub is its owner's call."""
