"""The simulated ranks of bench/bench_switch_scale.py: a stub model and planner, the seams that
count messages, calls and CPU, and the worker process that runs thousands of real `Participant`s
in lockstep. Imported by the bench and by its worker processes."""

from __future__ import annotations

import asyncio
import collections
import gc
import os
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from dist_quant.coordinator.transport import TransportError

# Simulated ranks are many threads; their stacks stay tiny.
THREAD_STACK = 256 * 1024
# The GIL switch interval of a process of simulated ranks. Every thread waiting for the GIL wakes
# once per interval to ask for it; a real rank's process has a handful of threads, a worker here
# hundreds, which wake together when a Prepare or a decision reaches every rank. At CPython's 5 ms
# that churn was most of the simulated ranks' CPU on a loaded machine (1,024 relayed ranks: 10.0 s
# per switch, 3.1 s at 50 ms; BENCHMARKS.md). The interval bounds how long a thread may keep the
# GIL while others wait, and the ranks' threads give it up at their next system call anyway.
GIL_SWITCH_S = 0.05
_TICK = os.sysconf("SC_CLK_TCK")
# Python's collector as torchtitan's trainer runs it (its `gc_freq`): no automatic collection, a
# young-generation one between steps every GC_STEPS steps. Left automatic, a collection of the
# garbage of a process's hundreds of simulated ranks landed inside whichever rank's boundary
# allocated next: 1.2-1.7 ms of "own CPU" at the commit boundary of 3 ranks in 1,024, against a
# median of 34 us (BENCHMARKS.md), work that no switch causes.
GC_STEPS = 50
RECIPE_A, RECIPE_B = {"name": "A"}, {"name": "B"}


# -- the stub model and planner ------------------------------------------------------------------


class StubModel:
    def __init__(self, rank: int) -> None:
        self.rank = rank
        self.recipe = RECIPE_A["name"]
        self.published_at: float | None = None


class StubPlan:
    def __init__(self, model: StubModel, name: str) -> None:
        self.model, self.name, self.digest = model, name, name
        self.part_digests: dict[str, str] = {}

    def publish(self) -> None:
        self.model.recipe = self.name
        self.model.published_at = time.monotonic()


def stub_loader(payload: Any) -> dict:
    if not isinstance(payload, dict) or not isinstance(payload.get("name"), str):
        raise ValueError(f"stub recipe {payload!r} must be a dict with a 'name'")
    return payload


def stub_planner(model: StubModel, recipe: dict) -> StubPlan:
    """The plan, after sleeping the rank's share of the recipe's `plan_ms` (0 if absent): a real
    model's plan takes time, and not the same on every rank. The share, in [0, 1), is fixed per
    rank and spread evenly over the ranks (a multiplicative hash), so votes spread over
    `plan_ms`."""
    share = (model.rank * 2654435761 % 4096) / 4096
    time.sleep(recipe.get("plan_ms", 0.0) / 1e3 * share)
    return StubPlan(model, recipe["name"])


# -- the counting seams --------------------------------------------------------------------------


class Counted:
    """A transport that counts the messages it moves and the calls in flight through it.
    Clones share the counters, so the coordinator's two connections count as one rank 0."""

    def __init__(self, inner: Any, counts: dict[str, int] | None = None) -> None:
        self.inner = inner
        self.counts = counts if counts is not None else {"sent": 0, "received": 0}
        self._lock = threading.Lock()

    # A push counts before it goes: its reader may act on it (reply, and the bench read the
    # counts) before the pushing thread would get to count it afterwards.
    def push(self, queue: str, data: bytes) -> None:
        with self._lock:
            self.counts["sent"] += 1
        self.inner.push(queue, data)

    def push_many(self, pushes: list[tuple[str, bytes]]) -> None:
        with self._lock:
            self.counts["sent"] += len(pushes)
        self.inner.push_many(pushes)

    def pop(self, queue: str, timeout: float | None = None) -> bytes | None:
        data = self.inner.pop(queue, timeout)
        if data is not None:
            with self._lock:
                self.counts["received"] += 1
        return data

    def pop_many(self, queue: str, most: int, timeout: float | None = None) -> list[bytes]:
        items = self.inner.pop_many(queue, most, timeout)
        with self._lock:
            self.counts["received"] += len(items)
        return items

    def clone(self) -> Counted:
        return Counted(self.inner.clone(), self.counts)

    def close(self) -> None:
        self.inner.close()


class Stoppable:
    """A rank's reading connection whose reader can be stopped: a message that arrives while
    stopped is held, unread, until `resume()`, as a stopped process leaves its messages in the
    socket. The rank's listener, the only reader, then neither votes nor says it is alive."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self._running = threading.Event()
        self._running.set()

    def stop(self) -> None:
        self._running.clear()

    def resume(self) -> None:
        self._running.set()

    def push(self, queue: str, data: bytes) -> None:
        self._running.wait()
        self.inner.push(queue, data)

    def push_many(self, pushes: list[tuple[str, bytes]]) -> None:
        self._running.wait()
        self.inner.push_many(pushes)

    def pop(self, queue: str, timeout: float | None = None) -> bytes | None:
        data = self.inner.pop(queue, timeout)
        self._running.wait()
        return data

    def pop_many(self, queue: str, most: int, timeout: float | None = None) -> list[bytes]:
        items = self.inner.pop_many(queue, most, timeout)
        self._running.wait()
        return items

    def clone(self) -> Any:
        return self.inner.clone()

    def close(self) -> None:
        self.inner.close()


class ActorLoop:
    """The actor's event loop, on a thread of its own, as Ray runs an asyncio actor's calls."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self._thread.start()

    def call(self, coroutine: Any) -> Any:
        """The coroutine's result; `TransportError` once the actor is gone (as Ray raises for a
        dead actor), e.g. for a participant closed after the bench stopped the actor."""
        if self.loop.is_closed():
            coroutine.close()
            raise TransportError("the coordinator actor is stopped")
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop).result()

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(10)
        self.loop.close()


class ActorCalls:
    """The Ray transport without Ray: each call runs the actor body's coroutine on its event
    loop, and the number of calls inside the actor at once (each a coroutine on that loop) is
    tracked."""

    def __init__(
        self, actor: Any, loop: ActorLoop, gauge: dict[str, int], lock: threading.Lock
    ) -> None:
        self._actor, self._loop, self._gauge, self._lock = actor, loop, gauge, lock

    def _enter(self, pushing: bool = False) -> None:
        """A push counts as it enters (as `Counted.push` does, for the same reason)."""
        with self._lock:
            self._gauge["now"] += 1
            self._gauge["peak"] = max(self._gauge["peak"], self._gauge["now"])
            self._gauge["messages"] += pushing

    def _leave(self, moved: bool) -> None:
        with self._lock:
            self._gauge["now"] -= 1
            self._gauge["messages"] += moved

    def push(self, queue: str, data: bytes) -> None:
        self._enter(pushing=True)
        try:
            self._loop.call(self._actor.push(queue, data))
        finally:
            self._leave(False)

    def pop(self, queue: str, timeout: float | None = None) -> bytes | None:
        self._enter()
        data = None
        try:
            data = self._loop.call(self._actor.pop(queue, timeout))
            return data
        finally:
            self._leave(data is not None)

    def clone(self) -> ActorCalls:
        return self

    def close(self) -> None:
        pass


def thread_cpu_s(threads: list[threading.Thread]) -> float:
    total = 0.0
    for t in threads:
        if t.is_alive() and t.ident is not None:
            try:
                total += time.clock_gettime(time.pthread_getcpuclockid(t.ident))
            except OSError:
                pass  # ended between the check and the read
    return total


def role(name: str) -> str:
    """The kind of thread, from the names the library and the bench give them."""
    if ".plan" in name:
        return "planner"
    if name.startswith("dist_quant.participant"):
        return "listener"
    if name.startswith("dist_quant.relay"):
        return "relay." + name.rsplit(".", 1)[1]
    if name == "bench.trainer":
        return "trainer"
    if name.startswith("pt_tcpstore"):  # torch's server threads (not Python threads)
        return "store"
    if name.startswith("dist_quant.coordinator"):
        return "coordinator"
    return "other"  # a main thread: the bench's client, a worker's pipe


class ThreadClock:
    """CPU per kind of thread: live threads read from /proc, ended ones added up as they end."""

    def __init__(self) -> None:
        self.ended: collections.Counter[str] = collections.Counter()
        run = threading.Thread.run
        clock = self

        def timed_run(thread: threading.Thread) -> None:
            try:
                run(thread)
            finally:
                clock.ended[role(thread.name)] += time.thread_time()

        threading.Thread.run = timed_run  # type: ignore[method-assign]

    def read(self) -> collections.Counter[str]:
        total = collections.Counter(self.ended)
        python = {}
        for t in threading.enumerate():
            try:
                python[t.native_id] = (t.name, time.pthread_getcpuclockid(t.ident))
            except (OSError, TypeError):
                continue  # not started, or ended meanwhile: counted in `ended`
        for tid in map(int, os.listdir("/proc/self/task")):
            try:
                if tid in python:  # the thread's own clock, to the nanosecond
                    name, clock = python[tid]
                    total[role(name)] += time.clock_gettime(clock)
                    continue
                # torch's server threads: only /proc knows them, in clock ticks (utime + stime)
                stat = Path(f"/proc/self/task/{tid}/stat").read_text().rsplit(")", 1)[1].split()
                name = Path(f"/proc/self/task/{tid}/comm").read_text().strip()
            except OSError:
                continue  # ended meanwhile
            total[role(name)] += (int(stat[11]) + int(stat[12])) / _TICK
        return total


def server_connections(port: int) -> int:
    """Established TCP connections whose local end is `port` (the server's side of each)."""
    count = 0
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            local, state = fields[1], fields[3]
            if state == "01" and int(local.rsplit(":", 1)[1], 16) == port:
                count += 1
    return count


# -- simulated ranks -----------------------------------------------------------------------------


class BoundaryStalls:
    """What the `step_boundary` calls of one process's ranks were made of, while measuring. Each
    call's wall time splits into the protocol's wait (`Participant.boundary_wait_s`: blocked at a
    hold step, or at S with a cancel open), the trainer thread's own CPU (`time.thread_time`) and
    the rest: not running, i.e. waiting for the GIL behind this process's other simulated ranks'
    threads (or for the rank's lock, held by its listener while that waits for the GIL), which a
    rank with a process of its own does not pay."""

    def __init__(self) -> None:
        self.longest = (0.0, 0.0, 0.0)  # (wall, protocol, cpu) of the longest call
        self.most = {"protocol": 0.0, "cpu": 0.0, "not_running": 0.0}  # each part's longest
        # step -> [its longest protocol wait, the calls that waited]
        self.waits: dict[int, list[float]] = {}
        self.cpu_by_step: dict[int, float] = {}  # step -> its boundaries' longest own CPU

    def add(self, step: int, wall: float, protocol: float, cpu: float) -> None:
        if wall > self.longest[0]:
            self.longest = (wall, protocol, cpu)
        parts = {"protocol": protocol, "cpu": cpu, "not_running": max(wall - protocol - cpu, 0.0)}
        for k, v in parts.items():
            self.most[k] = max(self.most[k], v)
        self.cpu_by_step[step] = max(self.cpu_by_step.get(step, 0.0), cpu)
        if protocol > 0:
            seen = self.waits.setdefault(step, [0.0, 0])
            seen[0], seen[1] = max(seen[0], protocol), seen[1] + 1

    def report(self) -> dict[str, Any]:
        wall, protocol, cpu = self.longest
        split = {"protocol": protocol, "cpu": cpu, "not_running": max(wall - protocol - cpu, 0.0)}
        return {"longest_split_s": split, "most_s": dict(self.most), "waits": dict(self.waits),
                "cpu_by_step": dict(self.cpu_by_step)}  # fmt: skip


def stall_keys(reports: list[dict[str, Any]], commit_step: int | None) -> dict[str, Any]:
    """The bench's JSON keys for the stall, over every process's `BoundaryStalls.report()`."""
    longest = max(reports, key=lambda r: sum(r["longest_split_s"].values()))["longest_split_s"]
    waits: dict[int, list[float]] = {}
    for r in reports:
        for step, (most, calls) in r["waits"].items():
            seen = waits.setdefault(int(step), [0.0, 0])
            seen[0], seen[1] = max(seen[0], most), seen[1] + calls
    ahead = [w for step, w in waits.items() if commit_step is not None and step < commit_step]
    return {
        "max_stall_split_ms": {k: round(1e3 * v, 3) for k, v in longest.items()},
        "max_protocol_wait_ms": 1e3 * max(r["most_s"]["protocol"] for r in reports),
        "max_boundary_cpu_ms": 1e3 * max(r["most_s"]["cpu"] for r in reports),
        # the boundary that publishes (and sends the ack)
        "max_commit_boundary_cpu_ms": 1e3
        * max((r["cpu_by_step"].get(commit_step, 0.0) for r in reports), default=0.0),
        "max_not_running_ms": 1e3 * max(r["most_s"]["not_running"] for r in reports),
        "protocol_wait_ahead_ms": 1e3 * max((w[0] for w in ahead), default=0.0),
        "ranks_waited_ahead": sum(w[1] for w in ahead),
        "protocol_waits_by_step": {
            s: [round(1e3 * w[0], 3), w[1]] for s, w in sorted(waits.items())
        },
    }


class Ranks:
    """Participants for ranks [lo, hi) in this process, and the thread that trains them."""

    def __init__(
        self,
        lo: int,
        hi: int,
        connect: Any,
        job: str,
        token: str,
        step_s: float,
        barrier: Any = None,
        relayed: tuple[tuple[int, ...], ...] = (),
        stoppable: int | None = None,
    ) -> None:
        """`relayed`: the job's nodes whose lowest rank runs a `NodeRelay` (as `attach` sets it
        up across hosts): their ranks send upstream through it, its leader runs it and, off
        rank 0's node, serves the node's queues from a store of its own (node_store.py), which
        its ranks connect to instead of rank 0's. `connect(address)` opens a connection to a
        store; `job` is rank 0's. Rank `stoppable`'s listener reads through a `Stoppable`
        (`self.stopper`); its trainer runs on while it is stopped, since in a job the others'
        collectives would otherwise wait for it."""
        from dist_quant.coordinator.node_relay import NodeRelay
        from dist_quant.coordinator.node_store import NodeStore, node_led_by, route
        from dist_quant.coordinator.participant import Participant
        from dist_quant.coordinator.transport import PairedTransport

        self.models: list[StubModel] = []
        self.parts: list[Any] = []
        self.failures: list[str] = []
        self._step_s = step_s
        self._barrier = barrier
        self._stop = threading.Event()
        self.measuring = threading.Event()
        self.started = threading.Event()
        self.step = 0
        self.max_stall_s = 0.0
        self.max_step_s = 0.0
        self.stall = BoundaryStalls()
        self.node_stores: list[Any] = []
        self.stopper: Stoppable | None = None
        t0 = time.monotonic()
        stores: dict[int, str] = {}
        leaders = [(r, led) for r in range(lo, hi) if (led := node_led_by(r, relayed)) is not None]
        # Started together, as each leader starts its own on its host: torch's server opens a
        # client connection to itself, whose name lookup can wait out a lost DNS query (5 s).
        with ThreadPoolExecutor(max(len(leaders), 1)) as pool:
            started = [(r, pool.submit(NodeStore, r, led)) for r, led in leaders]
        for r, future in started:
            try:
                self.node_stores.append(future.result())
                stores[r] = self.node_stores[-1].address
            except Exception as e:  # noqa: BLE001 - counted and reported as attach failures
                self.failures.append(f"rank {r}'s node store: {type(e).__name__}: {e}")
        for r in range(lo, hi):
            try:
                way = route(r, relayed, job, stores)
                relay = None
                if way.leader == r:  # its node's store and rank 0's, one popping thread each
                    relay = NodeRelay(connect(way.home), connect(job), token=token, leader=r,
                                      ranks=way.node)  # fmt: skip
                first = connect(way.home)
                if r == stoppable:
                    first = self.stopper = Stoppable(first)
                model = StubModel(r)
                part = Participant(
                    model,
                    rank=r,
                    transport=PairedTransport(first, first.clone()),
                    token=token,
                    planner=stub_planner,
                    recipe_loader=stub_loader,
                    describe=lambda m: m.recipe,
                    upstream=way.upstream,
                    relay=relay,
                    coordinator_link=(
                        (lambda: connect(job))
                        if way.behind_node_store and way.leader != r
                        else None
                    ),
                )
            except Exception as e:  # noqa: BLE001 - counted and reported as attach failures
                self.failures.append(f"rank {r}: {type(e).__name__}: {e}")
                continue
            self.models.append(model)
            self.parts.append(part.start())
        self.connect_s = time.monotonic() - t0
        self._trainer = threading.Thread(target=self._train, name="bench.trainer", daemon=True)
        self._trainer.start()

    def _train(self) -> None:
        gc.disable()
        while not self._stop.is_set():
            began, worst = time.perf_counter(), 0.0
            measuring = self.measuring.is_set()
            for part in self.parts:
                waited0, cpu0 = part.boundary_wait_s, time.thread_time()
                t0 = time.perf_counter()
                part.step_boundary(self.step)
                wall = time.perf_counter() - t0
                worst = max(worst, wall)
                if measuring:
                    cpu = time.thread_time() - cpu0
                    self.stall.add(self.step, wall, part.boundary_wait_s - waited0, cpu)
            sweep = time.perf_counter() - began
            if measuring:
                self.max_stall_s = max(self.max_stall_s, worst)
                self.max_step_s = max(self.max_step_s, sweep)
            self.started.set()
            self.step += 1
            if self.step % GC_STEPS == 0:
                gc.collect(1)
            self._stop.wait(self._step_s)
            if self._barrier is not None:
                # the other processes' ranks: a real job's collectives keep every rank in step
                t0 = time.perf_counter()
                try:
                    self._barrier.wait()
                except threading.BrokenBarrierError:
                    return
                if measuring:  # a step: every boundary, then the barrier
                    self.max_step_s = max(self.max_step_s, sweep + time.perf_counter() - t0)

    def measure(self) -> None:
        """Start measuring a switch: its stalls and steps only, not the previous switch's."""
        self.max_stall_s, self.max_step_s, self.stall = 0.0, 0.0, BoundaryStalls()
        self.measuring.set()

    def published(self, name: str = RECIPE_B["name"]) -> int:
        return sum(m.recipe == name for m in self.models)

    def holding(self) -> int:
        """How many of these ranks are in a switch (planning, voted, or committing)."""
        return sum(p.state != "idle" for p in self.parts)

    def last_publish(self) -> float:
        return max((m.published_at or 0.0) for m in self.models) if self.models else 0.0

    def stop(self) -> None:
        self._stop.set()
        if self._barrier is not None:
            self._barrier.abort()
        self._trainer.join(10)


def worker(
    lo: int,
    hi: int,
    endpoint: dict,
    step_s: float,
    barrier: Any,
    conn: Any,
    relayed: tuple[tuple[int, ...], ...] = (),
    gil_switch_s: float = GIL_SWITCH_S,
    stoppable: int | None = None,
) -> None:
    """A process of simulated ranks, driven by `conn` (a Pipe): "measure", "step",
    ("published", recipe name), "holding", "stop" and "resume" (rank `stoppable`'s listener),
    "report", "exit"."""
    threading.stack_size(THREAD_STACK)
    sys.setswitchinterval(gil_switch_s)
    clock = ThreadClock()
    from dist_quant.coordinator.job_host import connect_endpoint

    connect = lambda address: connect_endpoint({**endpoint, "address": address})  # noqa: E731
    job = endpoint["address"]
    ranks = Ranks(lo, hi, connect, job, endpoint["token"], step_s, barrier, relayed, stoppable)
    ranks.started.wait(60)
    ports = [store.port for store in ranks.node_stores]
    conn.send({"failures": ranks.failures, "connect_s": ranks.connect_s, "step": ranks.step,
               "node_store_ports": ports})  # fmt: skip
    while True:
        cmd = conn.recv()
        if cmd == "measure":
            ranks.measure()
            cpu0 = time.process_time()  # every rank's threads in this process
            kinds0 = clock.read()
            conn.send(ranks.step)
        elif cmd == "step":
            conn.send(ranks.step)
        elif cmd == "holding":
            conn.send(ranks.holding())
        elif cmd in ("stop", "resume"):
            getattr(ranks.stopper, cmd)()
            conn.send(ranks.step)
        elif isinstance(cmd, tuple):  # ("published", recipe name): polled while a switch runs,
            # so no /proc walk under the GIL
            conn.send({"published": ranks.published(cmd[1]), "last_publish": ranks.last_publish()})
        elif cmd == "report":
            conn.send(
                {
                    "last_publish": ranks.last_publish(),
                    "max_stall_s": ranks.max_stall_s,
                    "max_step_s": ranks.max_step_s,
                    "stall": ranks.stall.report(),
                    "step": ranks.step,
                    "cpu_s": time.process_time() - cpu0,
                    "cpu_by_thread_s": dict(clock.read() - kinds0),
                }
            )
        else:
            ranks.stop()
            conn.send("bye")
            os._exit(0)  # the ranks' sockets close with the process, as a job's would
