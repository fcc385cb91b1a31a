"""A client of the job's TCPStore in plain Python, so that `dist-quant switch` / `status` /
`cancel` (and `request_switch` in any process) do not import torch just to reach the job.

It speaks the few commands of torch's TCPStore wire protocol (libuv server) that a client of the
coordinator needs, exactly as torch's own client sends them: a validation message and a ping on
connect, `queue_push`, and `queue_pop` as WAIT on the queue's key followed by QUEUE_POP (with
CANCEL_WAIT when the wait times out). Values are native-endian (little-endian on every platform
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

import os
import select
import socket
import struct
import threading

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

    The socket is non-blocking and every wait is an explicit poll: a socket with a timeout polls
    before each send and recv, which doubled the system calls (and the GIL hand-offs, each of
    which costs a thread switch when a process holds thousands of ranks' threads) of every
    message. Replies are read into a buffer, so a QUEUE_POP's count, size and data usually take
    one recv, not three."""

    def __init__(self, sock: socket.socket, timeout_s: float) -> None:
        sock.setblocking(False)
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
            except BlockingIOError:
                if not _ready(sock, select.POLLOUT, self.timeout_s):
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
            except BlockingIOError:
                if not _ready(sock, select.POLLIN, self.timeout_s):
                    raise TimeoutError("timed out") from None
                continue
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

    def _sock(self) -> socket.socket:
        sock = self._conn.sock
        if self._closed or sock is None:
            raise TransportError(f"connection to the coordinator store {self.address} is closed")
        return sock

    def _send(self, data: bytes) -> None:
        with self._conn.send_lock:
            self._conn.send(self._sock(), data)

    def push(self, queue: str, data: bytes) -> None:
        key = (_KEY_PREFIX + queue).encode()
        try:
            self._send(bytes([_QUEUE_PUSH]) + _string(key) + _string(bytes(data)))
        except OSError as e:
            raise TransportError(f"coordinator store {self.address}: {e}") from e

    def pop(self, queue: str, timeout: float | None = None) -> bytes | None:
        key = (_KEY_PREFIX + queue).encode()
        with self._conn.send_lock:
            if self._conn.reader is None:
                self._conn.reader = self
            elif self._conn.reader is not self:
                raise RuntimeError(
                    f"coordinator store {self.address}: another handle of this connection already "
                    "pops; a second reader needs a connection of its own"
                )
        conn = self._conn
        try:
            sock = self._sock()
            self._send(bytes([_WAIT]) + struct.pack("<Q", 1) + _string(key))
            if conn.answered(sock, timeout):
                response = conn.read(sock, 1, self.address)[0]
            else:
                self._send(bytes([_CANCEL_WAIT]))
                # the server may have answered STOP_WAITING just before the cancel: skip it
                while conn.read(sock, 1, self.address)[0] != _WAIT_CANCELED:
                    pass
                return None
            if response != _STOP_WAITING:
                raise TransportError(f"coordinator store {self.address}: bad wait reply {response}")
            self._send(bytes([_QUEUE_POP]) + _string(key))
            (count,) = struct.unpack("<q", conn.read(sock, 8, self.address))
            if count <= 0:
                return None  # another reader of this queue took the item first
            (size,) = struct.unpack("<Q", conn.read(sock, 8, self.address))
            return conn.read(sock, size, self.address)
        except OSError as e:
            raise TransportError(f"coordinator store {self.address}: {e}") from e

    def clone(self) -> StoreClientTransport:
        """Another handle on this connection, for a thread that pushes (or the one that pops)."""
        self._sock()  # a closed connection has no clones
        twin = object.__new__(StoreClientTransport)
        twin.address, twin._connect_timeout_s = self.address, self._connect_timeout_s
        twin._closed, twin._conn = False, self._conn
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
    wait_ms = -1 if timeout is None else max(int(timeout * 1000), 1)
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
