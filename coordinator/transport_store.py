"""torchrun transport: queues in a torch.distributed TCPStore that rank 0 hosts for the job.

The store is the job's own (not the process group's), so this works however the process group was
initialised. TCPStore binds its server to every interface when it opens the socket itself; we
bind the listening socket ourselves (127.0.0.1 unless a host is given) and hand TCPStore the file
descriptor. The store has no authentication: messages are sealed with the job's token (`wire.py`).
"""

from __future__ import annotations

import socket
import time
from collections.abc import Sequence
from datetime import timedelta

import torch.distributed as dist
from dist_quant.coordinator.endpoint import parse_address
from dist_quant.coordinator.transport import TransportError

# A pop that waits "forever" still needs a finite store timeout; ten years is long enough, and a
# wait that never times out also never makes c10d print its timeout warning.
_FOREVER = timedelta(days=3650)


class StoreServer:
    """The TCPStore server of one job, listening on `host` (default loopback) at a free port.

    `advertise`: the host clients are told to connect to (default `host`); a wildcard bind must
    advertise one of the addresses it covers."""

    def __init__(
        self, host: str = "127.0.0.1", port: int = 0, *, advertise: str | None = None
    ) -> None:
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self._sock = socket.socket(family, socket.SOCK_STREAM)
        try:
            self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            self._sock.bind((host, port))
            self._sock.listen(128)
            self.host = host
            self.advertised_host = advertise or host
            self.port = self._sock.getsockname()[1]
            self._store = dist.TCPStore(
                host,
                self.port,
                is_master=True,
                wait_for_workers=False,
                master_listen_fd=self._sock.fileno(),
            )
        except (OSError, RuntimeError) as e:
            self._sock.close()
            raise TransportError(f"cannot start the coordinator store on {host}:{port}: {e}") from e
        self._sock.detach()  # the store's server owns the descriptor now and closes it itself

    @property
    def address(self) -> str:
        host = self.advertised_host
        host = f"[{host}]" if ":" in host else host
        return f"{host}:{self.port}"

    def close(self) -> None:
        """Stops the server; connected clients then get `TransportError`."""
        self._store = None


def _probe(host: str, port: int, timeout_s: float, address: str) -> None:
    """Fail fast, with the OS's reason, where nothing listens: c10d's client would retry with
    back-off past its timeout and print a stack trace per try."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            socket.create_connection(
                (host, port), timeout=max(deadline - time.monotonic(), 0.1)
            ).close()
            return
        except OSError as e:
            if time.monotonic() >= deadline:
                reason = e.strerror or str(e) or type(e).__name__
                raise TransportError(
                    f"cannot reach the coordinator store at {address}: {reason}"
                ) from e
            time.sleep(0.05)


class StoreTransport:
    """A client connection to a `StoreServer`; one per thread (see `transport.py`)."""

    def __init__(self, address: str, *, connect_timeout_s: float = 30.0) -> None:
        self.address = address
        self._connect_timeout_s = connect_timeout_s
        host, port = parse_address(address)
        _probe(host, port, connect_timeout_s, address)
        try:
            self._store: dist.TCPStore | None = dist.TCPStore(
                host, port, is_master=False, timeout=timedelta(seconds=connect_timeout_s)
            )
        except (RuntimeError, OSError) as e:
            raise TransportError(f"cannot reach the coordinator store at {address}: {e}") from e
        self._timeout: timedelta | None = None

    def _client(self) -> dist.TCPStore:
        if self._store is None:
            raise TransportError(f"connection to the coordinator store {self.address} is closed")
        return self._store

    def push(self, queue: str, data: bytes) -> None:
        try:
            self._client().queue_push(queue, data)
        except RuntimeError as e:
            raise TransportError(f"coordinator store {self.address}: {e}") from e

    def push_many(self, pushes: Sequence[tuple[str, bytes]]) -> None:
        for queue, data in pushes:  # torch's client sends each on its own
            self.push(queue, data)

    def pop(self, queue: str, timeout: float | None = None) -> bytes | None:
        wanted = _FOREVER if timeout is None else timedelta(seconds=max(timeout, 0.001))
        try:
            store = self._client()
            if wanted != self._timeout:
                store.set_timeout(wanted)
                self._timeout = wanted
            return bytes(store.queue_pop(queue))
        except dist.DistStoreError as e:
            if "timeout" in str(e):
                return None
            raise TransportError(f"coordinator store {self.address}: {e}") from e
        except RuntimeError as e:
            raise TransportError(f"coordinator store {self.address}: {e}") from e

    def pop_many(self, queue: str, most: int, timeout: float | None = None) -> list[bytes]:
        """torch's client pops one item per round trip: the first waits, the rest are the ones
        the queue's length said were there."""
        if most < 1:
            raise ValueError(
                f"coordinator store {self.address}: pop_many needs most >= 1, got {most}"
            )
        first = self.pop(queue, timeout)
        if first is None:
            return []
        try:
            queued = self._client().queue_len(queue)
            return [first] + [
                bytes(self._client().queue_pop(queue)) for _ in range(min(queued, most - 1))
            ]
        except RuntimeError as e:
            raise TransportError(f"coordinator store {self.address}: {e}") from e

    def clone(self) -> StoreTransport:
        return StoreTransport(self.address, connect_timeout_s=self._connect_timeout_s)

    def close(self) -> None:
        self._store = None
