"""The in-memory queues behind the Ray actor: a push wakes only its own queue's reader, so N
messages to N blocked readers cost N wake-ups (the hub used to wake every reader per push)."""

import threading
import types

import pytest
from dist_quant.coordinator import transport_memory
from dist_quant.coordinator.transport import TransportError
from dist_quant.coordinator.transport_memory import MemoryHub


class CountingCondition(threading.Condition):
    """Counts the readers blocked now and every return from a wait (a wake-up)."""

    waiting = 0
    wakeups = 0
    _count_lock = threading.Lock()

    def wait(self, timeout=None):
        with CountingCondition._count_lock:
            CountingCondition.waiting += 1
        try:
            return super().wait(timeout)
        finally:
            with CountingCondition._count_lock:
                CountingCondition.waiting -= 1
                CountingCondition.wakeups += 1


@pytest.fixture
def counted(monkeypatch):
    CountingCondition.waiting = CountingCondition.wakeups = 0
    fake = types.SimpleNamespace(Lock=threading.Lock, Condition=CountingCondition)
    monkeypatch.setattr(transport_memory, "threading", fake)
    return CountingCondition


def blocked_readers(hub, n):
    got = {}

    def read(r):
        try:
            got[r] = hub.pop(f"rank/{r}")
        except TransportError:
            pass  # the hub closed under a reader the test left waiting

    threads = [threading.Thread(target=read, args=(r,), daemon=True) for r in range(n)]
    for t in threads:
        t.start()
    return threads, got


def wait_until(predicate):
    for _ in range(2000):
        if predicate():
            return
        threading.Event().wait(0.005)
    raise TimeoutError("the readers never got there")


def test_a_push_to_one_rank_wakes_only_that_ranks_reader(counted):
    hub = MemoryHub()
    threads, got = blocked_readers(hub, 16)
    wait_until(lambda: counted.waiting == 16)
    hub.push("rank/5", b"for five")
    threads[5].join(5)
    assert got == {5: b"for five"}
    assert counted.wakeups == 1
    assert counted.waiting == 15
    hub.close()
    for t in threads:
        t.join(5)  # before the next test resets the counts


@pytest.mark.parametrize("n", [8, 64])
def test_n_messages_to_n_blocked_readers_cost_n_wakeups(counted, n):
    hub = MemoryHub()
    threads, got = blocked_readers(hub, n)
    wait_until(lambda: counted.waiting == n)
    for r in range(n):  # one message at a time, each after every other reader is back waiting
        hub.push(f"rank/{r}", bytes([r]))
        threads[r].join(5)
        wait_until(lambda left=n - r - 1: counted.waiting == left)
    assert got == {r: bytes([r]) for r in range(n)}
    assert counted.wakeups == n


def test_queues_are_fifo_and_a_pop_times_out_with_none():
    hub = MemoryHub()
    for i in range(3):
        hub.push("q", f"m{i}".encode())
    assert [hub.pop("q", 0) for _ in range(4)] == [b"m0", b"m1", b"m2", None]


def test_two_readers_of_one_queue_each_get_one_of_two_items():
    hub = MemoryHub()
    got = []
    readers = [threading.Thread(target=lambda: got.append(hub.pop("q", 5))) for _ in range(2)]
    for t in readers:
        t.start()
    hub.push("q", b"a")
    hub.push("q", b"b")
    for t in readers:
        t.join(6)
    assert sorted(got) == [b"a", b"b"]


def test_close_raises_in_every_blocked_reader_and_in_later_calls():
    hub = MemoryHub()
    errors = []

    def read(r):
        try:
            hub.pop(f"rank/{r}")
        except TransportError as e:
            errors.append(str(e))

    threads = [threading.Thread(target=read, args=(r,)) for r in range(3)]
    for t in threads:
        t.start()
    threading.Event().wait(0.05)
    hub.close()
    for t in threads:
        t.join(5)
    assert errors == ["memory hub is closed"] * 3
    with pytest.raises(TransportError, match="closed"):
        hub.push("rank/0", b"x")
