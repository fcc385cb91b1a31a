"""A client of the job's TCPStore in plain Python, so that `dist-quant switch` / `status` /
`cancel` (and `request_switch` in any process) do not import torch just to reach the job.

It speaks the few commands of torch's TCPStore wire protocol (libuv server) that a client of the
coordinator needs, exactly as torch's own client sends them: a validation message and a ping on
connect, `queue_push`, and `queue_pop` as WAIT on the queue's key followed by QUEUE_POP (with
CANCEL_WAIT when the wait times out). A QUEUE_POP reply starts with the queue's length before the
pop (0, and nothing else, for an empty queue), so `pop_many` pops first and, when that length says
more wait, sends that many QUEUE_POPs in one write and reads their replies together: a reader
that keeps up with a busy queue (rank 0's inbox, a relay's) drains it in one round trip, and
waits only once it is empty. Values are native-endian (little-endian on every platform
torch ships for); strings and byte strings are a uint64 length and the bytes; every key carries
the store's "/" prefix. `tests/coordinator/test_store_client.py` runs it against the installed
torch's server and client in both directions, so a protocol change in torch fails there first.

Every rank connects with it too (`job_host.connect_endpoint`), for two reasons that matter at
thousands of ranks. It never asks the resolver for a name: torch's client looks up the peer's
name on every connect (a reverse-DNS query, 5 s when the resolver drops one; docs/reliability.md).
And `clone()` shares the connection instead of opening another: a push has no reply, so a
training thread can push (under a send lock) while the listener's pop waits on the same socket,
and rank 0 holds one connection per rank instead of two. Only one handle of a connection may pop
(the server answers a wait on the connection it came from); a second handle that tries is
refused, loudly.
"""

from __future__ import annotations

import math
import os
import select
import socket
import struct
import threading
import time
from collections.abc import Sequence

from dist_quant.coordinator.endpoint import parse_address
from dist_quant.coordinator.transport import TransportError

# c10d::detail::QueryType (TCPStoreBackend.hpp), the commands used here
_VALIDATE, _WAIT, _CANCEL_WAIT, _PING, _QUEUE_PUSH, _QUEUE_POP = 0, 6, 12, 13, 14, 15
_VALIDATION_MAGIC = 0x3C85F7CE
_STOP_WAITING, _WAIT_CANCELED = 0, 1  # c10d::detail::WaitResponseType
_KEY_PREFIX = "/"  # TCPStore's own key prefix
_READ_AHEAD = 65536  # bytes asked of one recv: a whole reply, and whatever follows it


def _string(data: bytes) -> bytes:
    return struct.pack("<Q", len(data)) + data


class _Connection:
    """One socket, shared by the handles `clone()` makes; closed with the last of them.

    The socket blocks, and the kernel bounds each send and recv by the connection's timeout
    (SO_SNDTIMEO, SO_RCVTIMEO), so an expected reply costs one recv: one GIL hand-off, each of
    which costs a thread switch when a process holds many threads (a relay's, or a simulator's
    thousands of ranks'). Python's own socket timeout polls before each send and recv, and a
    non-blocking recv that finds the reply not there yet (57% of a relay's pops, measured) adds
    a poll and a second recv: three hand-offs. Only a wait of a caller's own length (`answered`)
    polls. Replies are read into a buffer, so a QUEUE_POP's count, size and data usually take
    one recv, not three."""

    def __init__(self, sock: socket.socket, timeout_s: float) -> None:
        sock.settimeout(None)
        # a struct timeval; at least 1 us, since a zero timeval means no limit at all
        limit = struct.pack("@ll", *divmod(max(round(timeout_s * 1e6), 1), 1_000_000))
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, limit)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, limit)
        self.sock: socket.socket | None = sock
        self.timeout_s = timeout_s  # the longest a send or an expected reply may take
        self.send_lock = threading.Lock()  # whole commands, never interleaved
        self.reader: StoreClientTransport | None = None  # the one handle that pops
        self.handles = 1
        self._received = bytearray()  # read ahead by the reader, not yet taken

    def release(self) -> None:
        with self.send_lock:
            self.handles -= 1
            if self.handles == 0 and self.sock is not None:
                self.sock.close()
                self.sock = None

    def send(self, sock: socket.socket, data: bytes) -> None:
        """All of `data` (callers hold `send_lock`); a peer that takes none of it for the
        connection's timeout is an error."""
        view = memoryview(data)
        while view:
            try:
                view = view[sock.send(view) :]
            except BlockingIOError:  # SO_SNDTIMEO passed with nothing taken
                raise TimeoutError("timed out") from None

    def answered(self, sock: socket.socket, timeout: float | None) -> bool:
        """Whether the server's reply arrives within `timeout` seconds (None: however long)."""
        return bool(self._received) or _ready(sock, select.POLLIN, timeout)

    def read(self, sock: socket.socket, n: int, address: str) -> bytes:
        """The next `n` bytes of the server's replies (the reader only); each must come within
        the connection's timeout."""
        buf = self._received
        while len(buf) < n:
            try:
                chunk = sock.recv(max(n - len(buf), _READ_AHEAD))
            except BlockingIOError:  # SO_RCVTIMEO passed with nothing received
                raise TimeoutError("timed out") from None
            if not chunk:
                raise ConnectionResetError(f"the store at {address} closed the connection")
            buf += chunk
        data = bytes(buf[:n])
        del buf[:n]
        return data


class StoreClientTransport:
    """A connection to a `StoreServer`; the `Transport` of a client and of every rank (see
    `transport.py`). `clone()` is another handle on the same connection."""

    def __init__(self, address: str, *, connect_timeout_s: float = 10.0) -> None:
        self.address = address
        self._connect_timeout_s = connect_timeout_s
        self._closed = False
        host, port = parse_address(address)
        sock = None
        try:
            sock = socket.create_connection((host, port), timeout=connect_timeout_s)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            sock.sendall(struct.pack("<BI", _VALIDATE, _VALIDATION_MAGIC))
            nonce = os.getpid() & 0xFFFFFFFF
            sock.sendall(struct.pack("<BI", _PING, nonce))
            (echo,) = struct.unpack("<I", _recv(sock, 4, address))
        except OSError as e:
            if sock is not None:
                sock.close()
            raise TransportError(f"cannot reach the coordinator store at {address}: {e}") from e
        if echo != nonce:
            sock.close()
            raise TransportError(
                f"the coordinator store at {address} answered the ping with {echo}, not {nonce}: "
                "not a TCPStore of this protocol"
            )
        self._conn = _Connection(sock, connect_timeout_s)
        self._backlog = ("", 0)  # (queue, items the last QUEUE_POP reply said were left)

    def _sock(self) -> socket.socket:
        sock = self._conn.sock
        if self._closed or sock is None:
            raise TransportError(f"connection to the coordinator store {self.address} is closed")
        return sock

    def _send(self, data: bytes) -> None:
        with self._conn.send_lock:
            self._conn.send(self._sock(), data)

    def push(self, queue: str, data: bytes) -> None:
        self.push_many(((queue, data),))

    def push_many(self, pushes: Sequence[tuple[str, bytes]]) -> None:
        # QUEUE_PUSH has no reply: the commands go out back to back, in one write
        command = bytes([_QUEUE_PUSH])
        wire = b"".join(
            command + _string((_KEY_PREFIX + queue).encode()) + _string(bytes(data))
            for queue, data in pushes
        )
        try:
            self._send(wire)
        except OSError as e:
            raise TransportError(f"coordinator store {self.address}: {e}") from e

    def pop(self, queue: str, timeout: float | None = None) -> bytes | None:
        # a single pop keeps waiting first unless a reply said items are queued: a listener's
        # queue is usually empty, and a QUEUE_POP before every WAIT would cost it a round trip
        items = self._take(queue, 1, timeout, eager=False)
        return items[0] if items else None

    def pop_many(self, queue: str, most: int, timeout: float | None = None) -> list[bytes]:
        """Up to `most` items, oldest first, taking everything already queued in one round trip
        where it can: QUEUE_POP first (a pipelined run of them when the last reply said how many
        wait), WAIT only once the queue is found empty. [] when `timeout` passes."""
        if most < 1:
            raise ValueError(
                f"coordinator store {self.address}: pop_many needs most >= 1, got {most}"
            )
        return self._take(queue, most, timeout, eager=True)

    def _take(self, queue: str, most: int, timeout: float | None, *, eager: bool) -> list[bytes]:
        with self._conn.send_lock:
            if self._conn.reader is None:
                self._conn.reader = self
            elif self._conn.reader is not self:
                raise RuntimeError(
                    f"coordinator store {self.address}: another handle of this connection already "
                    "pops; a second reader needs a connection of its own"
                )
        key = (_KEY_PREFIX + queue).encode()
        deadline = None if timeout is None else time.monotonic() + timeout
        # QUEUE_POP answers with the queue's length before the pop: what is known to wait
        queued = self._backlog[1] if self._backlog[0] == queue else 0
        items: list[bytes] = []
        try:
            sock = self._sock()
            while True:
                if queued > 0 or eager:
                    queued = self._pop_run(sock, key, max(min(queued, most - len(items)), 1), items)
                    eager = False
                    if len(items) == most or (items and queued == 0):
                        break
                    if queued > 0:
                        continue
                if not self._wait(sock, key, deadline):
                    break
                queued = 1  # the server saw an item
        except TransportError:
            raise
        except OSError as e:
            raise TransportError(f"coordinator store {self.address}: {e}") from e
        finally:
            self._backlog = (queue, queued)
        return items

    def _pop_run(self, sock: socket.socket, key: bytes, n: int, items: list[bytes]) -> int:
        """`n` QUEUE_POPs in one write, their replies read in order; what the last reply says is
        still queued after it (a reply of an empty queue has no item)."""
        conn = self._conn
        self._send((bytes([_QUEUE_POP]) + _string(key)) * n)
        left = 0
        for _ in range(n):
            (count,) = struct.unpack("<q", conn.read(sock, 8, self.address))
            if count > 0:
                (size,) = struct.unpack("<Q", conn.read(sock, 8, self.address))
                items.append(conn.read(sock, size, self.address))
            left = max(count - 1, 0)
        return left

    def _wait(self, sock: socket.socket, key: bytes, deadline: float | None) -> bool:
        """Whether an item is in the queue before `deadline` (WAIT, CANCEL_WAIT when it passes)."""
        conn = self._conn
        self._send(bytes([_WAIT]) + struct.pack("<Q", 1) + _string(key))
        left = None if deadline is None else max(deadline - time.monotonic(), 0.0)
        if not conn.answered(sock, left):
            self._send(bytes([_CANCEL_WAIT]))
            # the server may have answered STOP_WAITING just before the cancel: skip it
            while conn.read(sock, 1, self.address)[0] != _WAIT_CANCELED:
                pass
            return False
        response = conn.read(sock, 1, self.address)[0]
        if response != _STOP_WAITING:
            raise TransportError(f"coordinator store {self.address}: bad wait reply {response}")
        return True

    def clone(self) -> StoreClientTransport:
        """Another handle on this connection, for a thread that pushes (or the one that pops)."""
        self._sock()  # a closed connection has no clones
        twin = object.__new__(StoreClientTransport)
        twin.address, twin._connect_timeout_s = self.address, self._connect_timeout_s
        twin._closed, twin._conn, twin._backlog = False, self._conn, ("", 0)
        with self._conn.send_lock:
            self._conn.handles += 1
        return twin

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self._conn.release()


def _ready(sock: socket.socket, event: int, timeout: float | None) -> bool:
    """Whether `sock` is ready for `event` within `timeout` seconds (None: however long). A
    poll, which unlike select takes descriptors above 1024 (thousands of ranks per process)."""
    if sock.fileno() < 0:
        raise ConnectionResetError("the connection was closed")
    poller = select.poll()
    poller.register(sock, event | select.POLLERR | select.POLLHUP)
    # rounded up: a poll of fewer milliseconds than asked would end a timed pop early
    wait_ms = -1 if timeout is None else max(math.ceil(timeout * 1000), 1)
    return bool(poller.poll(wait_ms))


def _recv(sock: socket.socket, n: int, address: str) -> bytes:
    chunks, left = [], n
    while left:
        chunk = sock.recv(left)
        if not chunk:
            raise ConnectionResetError(f"the store at {address} closed the connection")
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)
