"""The Ray coordinator actor's queues (`transport_ray._CoordinatorActor`), without Ray: its
`push` / `pop` coroutines on one event loop, as Ray runs an asyncio actor. A waiting pop is a
coroutine, not a thread; a push from a caller or from a thread inside the actor (the
coordinator's) wakes the pop of its queue; a pop that times out returns None; stopping the actor
ends every waiting pop with `TransportError`."""

import asyncio
import threading

import pytest
from dist_quant.coordinator.transport import TransportError
from dist_quant.coordinator.transport_memory import MemoryTransport
from dist_quant.coordinator.transport_ray import _CoordinatorActor


def test_a_thousand_waiting_pops_hold_no_thread_and_each_gets_its_queues_item():
    actor = _CoordinatorActor()

    async def run():
        threads_before = threading.active_count()
        pops = [asyncio.ensure_future(actor.pop(f"rank/{r}", None)) for r in range(1000)]
        await asyncio.sleep(0.05)
        waiting_threads = threading.active_count()
        inside = MemoryTransport(actor._hub)  # the coordinator's threads push on the hub itself
        pusher = threading.Thread(
            target=lambda: [inside.push(f"rank/{r}", b"%d" % r) for r in range(0, 1000, 2)]
        )
        pusher.start()
        for r in range(1, 1000, 2):
            await actor.push(f"rank/{r}", b"%d" % r)
        pusher.join()
        return threads_before, waiting_threads, await asyncio.gather(*pops)

    before, waiting, got = asyncio.run(run())
    assert waiting == before
    assert got == [b"%d" % r for r in range(1000)]


def test_a_pop_that_times_out_returns_none_and_an_item_pushed_later_stays_queued():
    actor = _CoordinatorActor()

    async def run():
        first = await actor.pop("reply/x", 0.05)
        await actor.push("reply/x", b"late")
        return first, await actor.pop("reply/x", 0)

    assert asyncio.run(run()) == (None, b"late")


def test_stopping_the_actor_ends_every_waiting_pop_with_a_transport_error():
    actor = _CoordinatorActor()

    async def run():
        pops = [asyncio.ensure_future(actor.pop(f"rank/{r}", None)) for r in range(3)]
        await asyncio.sleep(0.05)
        await actor.stop()
        return await asyncio.gather(*pops, return_exceptions=True)

    results = asyncio.run(run())
    assert [type(r) for r in results] == [TransportError] * 3
    with pytest.raises(TransportError, match="closed"):
        asyncio.run(actor.push("rank/0", b"after"))
