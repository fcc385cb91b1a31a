"""A client of the job's TCPStore in plain Python, so that `dist-quant switch` / `status` /
`cancel` (and `request_switch` in any process) do not import torch just to reach the job.

It speaks the few commands of torch's TCPStore wire protocol (libuv server) that a client of the
coordinator needs, exactly as torch's own client sends them: a validation message and a ping on
connect, `queue_push`, and `queue_pop` as WAIT on the queue's key followed by QUEUE_POP (with
CANCEL_WAIT when the wait times out). Values are native-endian (little-endian on every platform
torch ships for); strings and byte strings are a uint64 length and the bytes; every key carries
the store's "/" prefix. `tests/coordinator/test_store_client.py` runs it against the installed
torch's server and client in both directions, so a protocol change in torch fails there first.
"""

from __future__ import annotations

import os
import socket
import struct

from dist_quant.coordinator.endpoint import parse_address
from dist_quant.coordinator.transport import TransportError

# c10d::detail::QueryType (TCPStoreBackend.hpp), the commands used here
_VALIDATE, _WAIT, _CANCEL_WAIT, _PING, _QUEUE_PUSH, _QUEUE_POP = 0, 6, 12, 13, 14, 15
_VALIDATION_MAGIC = 0x3C85F7CE
_STOP_WAITING, _WAIT_CANCELED = 0, 1  # c10d::detail::WaitResponseType
_KEY_PREFIX = "/"  # TCPStore's own key prefix


def _string(data: bytes) -> bytes:
    return struct.pack("<Q", len(data)) + data


class StoreClientTransport:
    """One connection to a `StoreServer`; the `Transport` of a client (see `transport.py`)."""

    def __init__(self, address: str, *, connect_timeout_s: float = 10.0) -> None:
        self.address = address
        self._connect_timeout_s = connect_timeout_s
        host, port = parse_address(address)
        self._sock: socket.socket | None = None
        try:
            self._sock = socket.create_connection((host, port), timeout=connect_timeout_s)
            self._sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            self._sock.sendall(struct.pack("<BI", _VALIDATE, _VALIDATION_MAGIC))
            nonce = os.getpid() & 0xFFFFFFFF
            self._sock.sendall(struct.pack("<BI", _PING, nonce))
            (echo,) = struct.unpack("<I", self._recv(4))
        except OSError as e:
            self.close()
            raise TransportError(f"cannot reach the coordinator store at {address}: {e}") from e
        if echo != nonce:
            self.close()
            raise TransportError(
                f"the coordinator store at {address} answered the ping with {echo}, not {nonce}: "
                "not a TCPStore of this protocol"
            )

    def _conn(self) -> socket.socket:
        if self._sock is None:
            raise TransportError(f"connection to the coordinator store {self.address} is closed")
        return self._sock

    def _recv(self, n: int) -> bytes:
        sock = self._conn()
        chunks, left = [], n
        while left:
            chunk = sock.recv(left)
            if not chunk:
                raise ConnectionResetError(f"the store at {self.address} closed the connection")
            chunks.append(chunk)
            left -= len(chunk)
        return b"".join(chunks)

    def push(self, queue: str, data: bytes) -> None:
        key = (_KEY_PREFIX + queue).encode()
        try:
            sock = self._conn()
            sock.settimeout(self._connect_timeout_s)
            sock.sendall(bytes([_QUEUE_PUSH]) + _string(key) + _string(bytes(data)))
        except OSError as e:
            raise TransportError(f"coordinator store {self.address}: {e}") from e

    def pop(self, queue: str, timeout: float | None = None) -> bytes | None:
        key = (_KEY_PREFIX + queue).encode()
        try:
            sock = self._conn()
            sock.settimeout(self._connect_timeout_s)
            sock.sendall(bytes([_WAIT]) + struct.pack("<Q", 1) + _string(key))
            sock.settimeout(None if timeout is None else max(timeout, 0.001))
            try:
                response = self._recv(1)[0]
            except TimeoutError:
                response = None
            sock.settimeout(self._connect_timeout_s)
            if response is None:
                sock.sendall(bytes([_CANCEL_WAIT]))
                # the server may have answered STOP_WAITING just before the cancel: skip it
                while self._recv(1)[0] != _WAIT_CANCELED:
                    pass
                return None
            if response != _STOP_WAITING:
                raise TransportError(f"coordinator store {self.address}: bad wait reply {response}")
            sock.sendall(bytes([_QUEUE_POP]) + _string(key))
            (count,) = struct.unpack("<q", self._recv(8))
            if count <= 0:
                return None  # another reader of this queue took the item first
            (size,) = struct.unpack("<Q", self._recv(8))
            return self._recv(size)
        except OSError as e:
            raise TransportError(f"coordinator store {self.address}: {e}") from e

    def clone(self) -> StoreClientTransport:
        return StoreClientTransport(self.address, connect_timeout_s=self._connect_timeout_s)

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None
