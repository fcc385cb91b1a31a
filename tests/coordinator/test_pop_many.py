"""`pop_many` and `push_many` on every transport (the plain store client, torch's store client, the memory hub,
the Ray actor's queues without Ray): what is queued comes out oldest first and never more than
asked, an empty queue waits out the timeout and returns [], `pop` and `pop_many` mixed keep one
order, and a closed store or hub is a `TransportError`; `push_many` lands each item in its queue, in
order. The store client's own claim, a queue
drained in one pipelined write once a reply has said how long it is, is counted in writes."""

import asyncio
import threading
import time

import pytest
from dist_quant.coordinator.transport import TransportError
from dist_quant.coordinator.transport_memory import MemoryHub, MemoryTransport
from dist_quant.coordinator.transport_ray import _CoordinatorActor
from dist_quant.coordinator.transport_store import StoreServer, StoreTransport
from dist_quant.coordinator.transport_store_client import StoreClientTransport, _Connection


class ActorHandle:
    """The Ray actor's coroutines called one at a time, each on a loop of its own, as Ray runs
    an asyncio actor's calls (without Ray)."""

    def __init__(self) -> None:
        self.actor = _CoordinatorActor()

    def push(self, queue, data):
        asyncio.run(self.actor.push(queue, data))

    def push_many(self, pushes):
        asyncio.run(self.actor.push_many(pushes))

    def pop(self, queue, timeout=None):
        return asyncio.run(self.actor.pop(queue, timeout))

    def pop_many(self, queue, most, timeout=None):
        return asyncio.run(self.actor.pop_many(queue, most, timeout))

    def close_queues(self):
        asyncio.run(self.actor.stop())


def _memory():
    hub = MemoryHub()
    return MemoryTransport(hub), MemoryTransport(hub), hub.close


def _store(client):
    server = StoreServer()
    return client(server.address), StoreTransport(server.address), server.close


def _actor():
    handle = ActorHandle()
    return handle, handle, handle.close_queues


TRANSPORTS = {
    "memory": _memory,
    "store client": lambda: _store(StoreClientTransport),
    "torch store": lambda: _store(StoreTransport),
    "ray actor": _actor,
}


@pytest.fixture(params=list(TRANSPORTS))
def pair(request):
    """(reader, writer, close): two handles on the same queues and what closes them."""
    reader, writer, close = TRANSPORTS[request.param]()
    yield reader, writer, close
    close()


def test_pop_many_takes_what_is_queued_oldest_first_and_never_more_than_asked(pair):
    reader, writer, _ = pair
    for i in range(5):
        writer.push("inbox", b"m%d" % i)
    assert reader.pop_many("inbox", 3, 5) == [b"m0", b"m1", b"m2"]
    assert reader.pop_many("inbox", 10, 5) == [b"m3", b"m4"]


def test_pop_many_of_an_empty_queue_waits_its_timeout_and_returns_nothing(pair):
    reader, writer, _ = pair
    began = time.monotonic()
    assert reader.pop_many("inbox", 4, 0.05) == []
    assert time.monotonic() - began >= 0.05
    writer.push("inbox", b"after the timeout")  # the handle is still usable
    assert reader.pop_many("inbox", 4, 5) == [b"after the timeout"]


def test_pop_and_pop_many_mixed_keep_one_order(pair):
    reader, writer, _ = pair
    for i in range(6):
        writer.push("inbox", b"m%d" % i)
    got = [reader.pop("inbox", 5), *reader.pop_many("inbox", 2, 5), reader.pop("inbox", 5)]
    got += reader.pop_many("inbox", 10, 5)
    assert got == [b"m%d" % i for i in range(6)]
    assert reader.pop("inbox", 0.05) is None


def test_pop_many_on_a_closed_store_is_a_transport_error(pair):
    reader, _, close = pair
    close()
    with pytest.raises(TransportError):
        reader.pop_many("inbox", 4, 1.0)


def test_pop_many_rejects_asking_for_nothing(pair):
    reader, writer, _ = pair
    writer.push("inbox", b"kept")
    with pytest.raises(ValueError, match="most >= 1, got 0"):
        reader.pop_many("inbox", 0, 1.0)
    assert reader.pop("inbox", 5) == b"kept"


def test_push_many_lands_each_item_in_its_queue_in_order(pair):
    reader, writer, _ = pair
    writer.push("rank/1", b"before")
    writer.push_many([("rank/1", b"a1"), ("rank/2", b"b1"), ("rank/1", b"a2"), ("rank/2", b"")])
    assert reader.pop_many("rank/1", 10, 5) == [b"before", b"a1", b"a2"]
    assert reader.pop_many("rank/2", 10, 5) == [b"b1", b""]


@pytest.fixture
def server():
    srv = StoreServer()
    yield srv
    srv.close()


def test_push_many_on_a_closed_connection_or_hub_is_a_transport_error(server):
    """(A push has no reply: a store that went away is only seen by the next pop.)"""
    plain = StoreClientTransport(server.address)
    plain.close()
    hub = MemoryHub()
    hub.close()
    for closed in (plain, MemoryTransport(hub)):
        with pytest.raises(TransportError, match="closed"):
            closed.push_many([("rank/1", b"late")])


def test_the_store_client_drains_a_known_queue_in_one_write(server, monkeypatch):
    """A QUEUE_POP's reply gives the queue's length: the first pop_many of ten items sends one
    QUEUE_POP, then the other nine in one write; with five more queued behind a full take, the
    next pop_many sends its five in one write and needs no WAIT."""
    reader = StoreClientTransport(server.address)
    writer = StoreTransport(server.address)
    writes = []
    real = _Connection.send
    monkeypatch.setattr(_Connection, "send", lambda self, sock, data: writes.append(data[0]) or real(self, sock, data))  # fmt: skip
    for i in range(15):
        writer.push("inbox", b"m%d" % i)
    assert reader.pop_many("inbox", 10, 5) == [b"m%d" % i for i in range(10)]
    assert writes == [15, 15]  # QUEUE_POP; nine QUEUE_POPs in one write
    writes.clear()
    assert reader.pop_many("inbox", 10, 5) == [b"m%d" % i for i in range(10, 15)]
    assert writes == [15]


def test_the_store_client_loses_nothing_when_pushes_race_its_timeouts(server):
    """A wait cancelled as an item arrives: the server's late STOP_WAITING is not taken for the
    reply to the next command, and the item stays queued for the next pop."""
    reader = StoreClientTransport(server.address)
    writer = StoreTransport(server.address)
    sent = [b"m%d" % i for i in range(200)]

    def push_slowly():
        for data in sent:
            writer.push("inbox", data)
            time.sleep(0.0002)

    t = threading.Thread(target=push_slowly)
    t.start()
    got: list[bytes] = []
    deadline = time.monotonic() + 20
    while len(got) < len(sent) and time.monotonic() < deadline:
        got += reader.pop_many("inbox", 7, 0.001)
    t.join(5)
    assert got == sent
