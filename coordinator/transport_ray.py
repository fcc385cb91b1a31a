"""Ray transport: the coordinator runs inside a named Ray actor that also holds the queues.

The actor ("dist_quant.coordinator", in a namespace of the job's own) keeps a `MemoryHub`; its
`push` / `pop` methods are the transport, and the coordinator thread inside it reads the hub
directly, so the protocol code is the same as under torchrun. Every rank's listener keeps one
`pop` call waiting in the actor: the actor is an asyncio actor, so a waiting call is a coroutine on
its one event loop, not a thread (a threaded actor needed 2N + 16 threads for N ranks); a push, from
a caller or from the coordinator's threads, wakes the coroutines waiting on its queue. It is placed
on the node of the rank that creates it (rank 0) so the decision log and `coordinator.json` share
one filesystem. Ray is imported only here, and only when this transport is used.
"""

from __future__ import annotations

import asyncio
import os
import secrets
import socket
import sys
from collections.abc import Sequence
from typing import Any

from dist_quant.coordinator.coordinator import Coordinator
from dist_quant.coordinator.decision_log import DecisionLog
from dist_quant.coordinator.faults import Fault
from dist_quant.coordinator.timing import LEASE_S
from dist_quant.coordinator.transport import TransportError
from dist_quant.coordinator.transport_memory import MemoryHub, MemoryTransport

ACTOR_NAME = "dist_quant.coordinator"
_SCHEME = "ray://"
CONNECT_TIMEOUT_S = 3.0  # a live GCS accepts a connection at once


class _CoordinatorActor:
    """The actor's body (wrapped with `ray.remote` on first use). Its `push`, `pop` and `stop`
    are coroutines, run on the actor's event loop."""

    def __init__(self) -> None:
        self._hub = MemoryHub(on_push=self._pushed)
        self._coordinator: Coordinator | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._waiting: dict[str, set[asyncio.Future]] = {}

    def start(
        self,
        token: str,
        world_size: int,
        tp_groups: Sequence[Sequence[int]],
        log_path: str,
        faults: Sequence[Fault],
        commit_window_s: float,
        lease_s: float = LEASE_S,
    ) -> None:
        self._coordinator = Coordinator(
            MemoryTransport(self._hub),
            token=token,
            world_size=world_size,
            tp_groups=tp_groups,
            log=DecisionLog(log_path),
            faults=faults,
            commit_window_s=commit_window_s,
            lease_s=lease_s,
        )
        self._coordinator.start()

    def _pushed(self, queue: str | None) -> None:
        """The hub's hook (any thread): wake the coroutines waiting on `queue` (None: all)."""
        loop = self._loop
        if loop is not None and not loop.is_closed():
            loop.call_soon_threadsafe(self._wake, queue)

    def _wake(self, queue: str | None) -> None:
        waiting = self._waiting.values() if queue is None else [self._waiting.get(queue, ())]
        for futures in waiting:
            for fut in futures:
                if not fut.done():
                    fut.set_result(None)

    async def push(self, queue: str, data: bytes) -> None:
        self._loop = asyncio.get_running_loop()
        self._hub.push(queue, data)

    async def push_many(self, pushes: Sequence[tuple[str, bytes]]) -> None:
        self._loop = asyncio.get_running_loop()
        for queue, data in pushes:
            self._hub.push(queue, data)

    async def pop(self, queue: str, timeout: float | None) -> bytes | None:
        """The oldest item of `queue`, waiting up to `timeout` seconds (None: for ever) without
        holding a thread; None when the time is up. Raises `TransportError` once stopped."""
        items = await self.pop_many(queue, 1, timeout)
        return items[0] if items else None

    async def pop_many(self, queue: str, most: int, timeout: float | None) -> list[bytes]:
        """Up to `most` items of `queue`, oldest first, once at least one is there (as `pop`
        waits); [] when the time is up."""
        if most < 1:
            raise ValueError(f"coordinator actor: pop_many needs most >= 1, got {most}")
        loop = self._loop = asyncio.get_running_loop()
        deadline = None if timeout is None else loop.time() + timeout
        while True:
            fut = loop.create_future()
            waiting = self._waiting.setdefault(queue, set())
            waiting.add(fut)  # before looking: a push after the look wakes it
            try:
                items = self._hub.pop_many(queue, most, 0)
                if items:
                    return items
                left = None if deadline is None else deadline - loop.time()
                if left is not None and left <= 0:
                    return []
                try:
                    await asyncio.wait_for(fut, left)
                except asyncio.TimeoutError:
                    return []
            finally:
                waiting.discard(fut)
                if not waiting:
                    self._waiting.pop(queue, None)

    async def stop(self) -> None:
        self._loop = asyncio.get_running_loop()
        if self._coordinator is not None:
            await asyncio.to_thread(self._coordinator.stop)  # joins its threads
        self._hub.close()  # every waiting pop wakes and raises TransportError


def _probe_cluster(gcs_address: str) -> None:
    """Fail fast where the cluster is gone: `ray.init` would retry for tens of seconds."""
    host, _, port = gcs_address.rpartition(":")
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=CONNECT_TIMEOUT_S).close()
    except (OSError, ValueError) as e:
        raise TransportError(
            f"the job's Ray cluster at {gcs_address} cannot be reached ({e}); has the job ended?"
        ) from e


def _ray():
    try:
        import ray
    except ImportError as e:
        raise TransportError("the Ray transport needs Ray: pip install 'dist-quant[ray]'") from e
    return ray


def create_coordinator_actor(world_size: int) -> tuple[Any, str]:
    """Create the job's coordinator actor on this node; returns (handle, "ray://<namespace>")."""
    ray = _ray()
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    namespace = f"dist_quant-{secrets.token_hex(6)}"
    here = ray.get_runtime_context().get_node_id()
    actor = (
        ray.remote(_CoordinatorActor)
        .options(
            name=ACTOR_NAME,
            namespace=namespace,
            num_cpus=0,
            # calls in flight at once (coroutines, not threads): a waiting pop per rank
            # listener and relay, plus pushes and clients
            max_concurrency=2 * world_size + 16,
            scheduling_strategy=NodeAffinitySchedulingStrategy(here, soft=False),
        )
        .remote()
    )
    return actor, _SCHEME + namespace


def start_coordinator_in_actor(
    actor: Any,
    token: str,
    world_size: int,
    tp_groups: Sequence[Sequence[int]],
    log_path: str,
    faults: Sequence[Fault],
    commit_window_s: float,
    lease_s: float = LEASE_S,
) -> None:
    groups = [list(g) for g in tp_groups]
    started = actor.start.remote(token, world_size, groups, log_path, faults, commit_window_s,
                                 lease_s)  # fmt: skip
    _ray().get(started)


def stop_coordinator_actor(actor: Any) -> None:
    ray = _ray()
    try:
        ray.get(actor.stop.remote(), timeout=10)
    except ray.exceptions.RayError:
        pass  # already dead
    ray.kill(actor)


class RayTransport:
    """Queues in the coordinator actor; handles are thread-safe, so `clone` shares one."""

    def __init__(self, actor: Any, address: str) -> None:
        self._actor = actor
        self.address = address

    @classmethod
    def connect(
        cls, address: str, *, ray_address: str | None = None, ray_auth_mode: str | None = None
    ) -> RayTransport:
        """Find the actor of `address` ("ray://<namespace>"), joining the Ray cluster if needed.

        `ray_address` / `ray_auth_mode`: the job's cluster (GCS host:port) and its Ray
        authentication mode, from coordinator.json. A client outside the cluster adopts the
        job's mode unless `$RAY_AUTH_MODE` says otherwise (Ray reads the token itself, from
        `$RAY_AUTH_TOKEN` or ~/.ray/auth_token), and gives up within seconds, with
        `TransportError`, when nothing listens at the cluster's address."""
        if not address.startswith(_SCHEME):
            raise ValueError(f"Ray coordinator address {address!r} must start with {_SCHEME}")
        namespace = address[len(_SCHEME) :]
        if ray_auth_mode and "RAY_AUTH_MODE" not in os.environ and "ray" not in sys.modules:
            os.environ["RAY_AUTH_MODE"] = ray_auth_mode  # read once, when Ray is imported
        ray = _ray()
        if not ray.is_initialized():
            if ray_address:
                _probe_cluster(ray_address)
            target = ray_address or "auto"
            try:
                ray.init(address=target, namespace=namespace, log_to_driver=False)
            except (ConnectionError, RuntimeError, ray.exceptions.RayError) as e:
                raise TransportError(f"cannot join the job's Ray cluster at {target}: {e}") from e
        try:
            actor = ray.get_actor(ACTOR_NAME, namespace=namespace)
        except ValueError as e:
            raise TransportError(f"no coordinator actor at {address}: {e}") from e
        return cls(actor, address)

    def _call(self, method: Any, *args: Any) -> Any:
        ray = _ray()
        try:
            return ray.get(method.remote(*args))
        except ray.exceptions.RayError as e:
            raise TransportError(f"coordinator actor {self.address}: {e}") from e

    def push(self, queue: str, data: bytes) -> None:
        self._call(self._actor.push, queue, data)

    def push_many(self, pushes: Sequence[tuple[str, bytes]]) -> None:
        self._call(self._actor.push_many, list(pushes))

    def pop(self, queue: str, timeout: float | None = None) -> bytes | None:
        return self._call(self._actor.pop, queue, timeout)

    def pop_many(self, queue: str, most: int, timeout: float | None = None) -> list[bytes]:
        return self._call(self._actor.pop_many, queue, most, timeout)

    def clone(self) -> RayTransport:
        return RayTransport(self._actor, self.address)

    def close(self) -> None:
        """The handle owns nothing; the actor lives until rank 0 stops it."""
