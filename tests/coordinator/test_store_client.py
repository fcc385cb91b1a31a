"""The plain-Python store client against the installed torch's TCPStore server and client: every
message either way arrives intact and in order, a pop times out cleanly (and the connection
stays usable), and a dead or foreign server is a `TransportError`."""

import socket
import threading
import time

import pytest
from dist_quant.coordinator.transport import TransportError
from dist_quant.coordinator.transport_store import StoreServer, StoreTransport
from dist_quant.coordinator.transport_store_client import StoreClientTransport


@pytest.fixture
def server():
    srv = StoreServer()
    yield srv
    srv.close()


@pytest.mark.parametrize("size", [0, 1, 1439, 1440, 70_000])
def test_messages_cross_between_torch_and_the_plain_client_in_order(server, size):
    torch_side = StoreTransport(server.address)
    plain = StoreClientTransport(server.address)
    payloads = [bytes([i % 251]) * size + str(i).encode() for i in range(3)]
    for p in payloads:
        plain.push("inbox", p)
    assert [torch_side.pop("inbox", 5) for _ in payloads] == payloads
    for p in payloads:
        torch_side.push("reply/r1", p)
    assert [plain.pop("reply/r1", 5) for _ in payloads] == payloads


def test_a_pop_that_times_out_returns_none_and_the_connection_stays_usable(server):
    plain = StoreClientTransport(server.address)
    assert plain.pop("reply/none", 0.05) is None
    StoreTransport(server.address).push("reply/none", b"later")
    assert plain.pop("reply/none", 5) == b"later"


def test_a_blocked_pop_wakes_when_the_item_is_pushed(server):
    plain = StoreClientTransport(server.address)
    got = []
    t = threading.Thread(target=lambda: got.append(plain.pop("reply/wait", 10)))
    t.start()
    time.sleep(0.1)
    StoreTransport(server.address).push("reply/wait", b"now")
    t.join(10)
    assert got == [b"now"]


def test_nothing_listening_is_a_transport_error_at_once():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    t0 = time.monotonic()
    with pytest.raises(TransportError, match="cannot reach the coordinator store"):
        StoreClientTransport(f"127.0.0.1:{port}", connect_timeout_s=5)
    assert time.monotonic() - t0 < 5  # refused, not waited out


def test_a_server_that_is_not_a_tcpstore_is_refused():
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(1)
        port = listener.getsockname()[1]

        def answer_garbage():
            conn, _ = listener.accept()
            with conn:
                conn.recv(64)
                conn.sendall(b"\xff\xff\xff\xff")

        t = threading.Thread(target=answer_garbage)
        t.start()
        with pytest.raises(TransportError, match="not a TCPStore"):
            StoreClientTransport(f"127.0.0.1:{port}", connect_timeout_s=5)
        t.join(5)


def test_a_server_that_stops_answering_fails_a_timed_pop_within_the_connection_timeout():
    """What a rank behind a node leader's store relies on when the leader hangs (SIGSTOP): its
    listener's timed pop fails, so it turns to rank 0 for the decision (participant.py)."""
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(1)
        port = listener.getsockname()[1]
        hang = threading.Event()

        def answer_the_ping_then_hang():
            conn, _ = listener.accept()
            with conn:
                conn.recv(5)  # validation
                ping = conn.recv(5)
                conn.sendall(ping[1:])  # the nonce echoed, as a TCPStore does
                hang.wait(10)

        t = threading.Thread(target=answer_the_ping_then_hang)
        t.start()
        client = StoreClientTransport(f"127.0.0.1:{port}", connect_timeout_s=0.5)
        began = time.monotonic()
        with pytest.raises(TransportError, match="timed out"):
            client.pop("rank/4", 0.1)
        assert time.monotonic() - began < 2.0  # the pop's 0.1 s, then the socket's 0.5 s
        hang.set()
        t.join(5)


class _HungStore:
    """A server that answers the connect's ping, then neither reads nor answers anything."""

    def __init__(self) -> None:
        self._listener = socket.socket()
        self._listener.bind(("127.0.0.1", 0))
        self._listener.listen(1)
        self.address = f"127.0.0.1:{self._listener.getsockname()[1]}"
        self._hang = threading.Event()
        self._thread = threading.Thread(target=self._serve)
        self._thread.start()

    def _serve(self) -> None:
        conn, _ = self._listener.accept()
        with conn:
            conn.recv(5)  # validation
            ping = conn.recv(5)
            conn.sendall(ping[1:])
            self._hang.wait(10)

    def close(self) -> None:
        self._hang.set()
        self._thread.join(5)
        self._listener.close()


@pytest.mark.parametrize("timeout_s", [0.3, 1.2])
def test_a_pop_whose_reply_never_comes_fails_within_the_connection_timeout(timeout_s):
    """An eager `pop_many` sends QUEUE_POP and reads its reply at once (no wait of its own):
    only the socket's receive limit ends it, at the connection's timeout (whole and fractional
    seconds both reach the kernel's limit). Without a limit the pop would end only when the
    server closes the connection, 10 s later, saying so instead."""
    hung = _HungStore()
    try:
        client = StoreClientTransport(hung.address, connect_timeout_s=timeout_s)
        with pytest.raises(TransportError, match="timed out"):
            client.pop_many("inbox", 8)
    finally:
        hung.close()


def test_a_push_the_server_never_reads_fails_within_the_connection_timeout():
    """Pushes have no reply: a server that stops reading fills the socket's buffers, and the
    send limit ends the push that finds them full (without it, the server's close 10 s later
    would, with another error)."""
    hung = _HungStore()
    try:
        client = StoreClientTransport(hung.address, connect_timeout_s=0.3)
        with pytest.raises(TransportError, match="timed out"):
            for _ in range(1000):  # 1000 MB: far more than any socket buffers hold
                client.push("inbox", bytes(1 << 20))
    finally:
        hung.close()


def test_a_clone_pushes_on_the_same_connection_while_the_reader_waits_on_it(server, monkeypatch):
    """One connection per rank: the training thread's acks go out on the socket the listener's
    pop is waiting on, and arrive in order."""
    reader = StoreClientTransport(server.address)
    opened = []
    real = socket.create_connection
    monkeypatch.setattr(
        socket, "create_connection", lambda *a, **k: opened.append(a) or real(*a, **k)
    )
    writer = reader.clone()
    assert opened == []
    got = []
    t = threading.Thread(target=lambda: got.append(reader.pop("rank/3", 10)))
    t.start()
    time.sleep(0.1)  # the reader's WAIT is at the server now
    torch_side = StoreTransport(server.address)
    for i in range(3):
        writer.push("inbox", f"ack{i}".encode())
    assert [torch_side.pop("inbox", 5) for _ in range(3)] == [b"ack0", b"ack1", b"ack2"]
    torch_side.push("rank/3", b"decision")
    t.join(10)
    assert got == [b"decision"]
    writer.push("inbox", b"after the pop")
    assert torch_side.pop("inbox", 5) == b"after the pop"
    assert reader.pop("rank/3", 0.05) is None  # the reader's timeouts still work


def test_a_second_handle_that_pops_is_refused(server):
    reader = StoreClientTransport(server.address)
    other = reader.clone()
    assert reader.pop("q", 0.01) is None
    with pytest.raises(RuntimeError, match="another handle of this connection already pops"):
        other.pop("q", 0.01)
    other.push("q", b"pushing is fine")
    assert reader.pop("q", 5) == b"pushing is fine"


def test_the_connection_closes_with_its_last_handle(server):
    first = StoreClientTransport(server.address)
    second = first.clone()
    first.close()
    with pytest.raises(TransportError, match="closed"):
        first.push("q", b"x")
    second.push("q", b"still open")
    assert StoreTransport(server.address).pop("q", 5) == b"still open"
    second.close()
    with pytest.raises(TransportError, match="closed"):
        second.push("q", b"x")
    with pytest.raises(TransportError, match="closed"):
        second.clone()


def test_connecting_asks_the_resolver_for_no_name(server, monkeypatch):
    """torch's client looks up the peer's name on every connect (a reverse-DNS query); ranks use
    this client so that a slow resolver cannot stall attach."""
    asked = []
    for name in ("getnameinfo", "gethostbyaddr"):
        monkeypatch.setattr(socket, name, lambda *a, name=name: asked.append(name) or 1 / 0)
    t = StoreClientTransport(server.address)
    t.clone().push("q", b"x")
    assert t.pop("q", 5) == b"x"
    assert asked == []


def test_pushes_from_a_clone_survive_the_readers_pops_timing_out_on_the_same_socket(server):
    reader = StoreClientTransport(server.address)
    writer = reader.clone()
    timed_out = []

    def read():
        for _ in range(40):
            timed_out.append(reader.pop("rank/1", 0.005))

    t = threading.Thread(target=read)
    t.start()
    for i in range(200):
        writer.push("inbox", f"ack{i}".encode() * 50)
    t.join(30)
    torch_side = StoreTransport(server.address)
    assert [torch_side.pop("inbox", 5) for _ in range(200)] == [
        f"ack{i}".encode() * 50 for i in range(200)
    ]
    assert timed_out == [None] * 40
    torch_side.push("rank/1", b"then a real one")
    assert reader.pop("rank/1", 5) == b"then a real one"
