"""The cluster switch at scale: the real coordinator and transport against N simulated ranks.

    python bench/bench_switch_scale.py [--ranks 64 1024 4096 16384] [--ranks-per-node 8]
        [--transport store|ray] [--relays] [--json] [--timeout 600] [--at-step-ahead K]
        [--step-ms 20] [--switches 1] [--stop-rank R --lease-s 1.5] [--real-ranks K]

Real: `Coordinator`, its decision log (fsynced), the transport (`store`: a `StoreServer` in this
process, every rank connected to it exactly as `attach` connects; `ray`: the coordinator actor's
body and its in-memory queues called directly, without Ray's RPC, since starting Ray with
thousands of concurrent calls is far too heavy for a 2-core machine), `Participant` (listener
thread, state machine, votes and acks) and the client's `request_switch`. Simulated: the model
and planner (a stub whose plan and publish take microseconds), the network (every rank on this
host: loopback or in-process), and training (one thread per worker process calls
`step_boundary` for each of its ranks every `--step-ms`, i.e. its ranks run in lockstep as the
collectives of a real job would keep them). Left out: what hundreds of ranks' threads sharing one
interpreter cost each other beyond a real rank's (a worker's GIL switch interval is 50 ms,
`--gil-switch-ms`, so its waiting threads do not wake every 5 ms to ask for the GIL).

Per N it reports request -> decision, request -> every rank published, the longest
`step_boundary` call any rank saw while the switch ran (`max_stall_ms`: its wall time as the
worker's trainer thread saw it, so it includes waiting for the GIL behind that process's other
simulated ranks' threads; `max_step_ms`: the longest step beyond its sleep, i.e. every rank's
boundary, then the wait for the other processes), the stall split (`max_stall_split_ms`: the
longest call as the protocol's wait, `Participant.boundary_wait_s`, the trainer's own CPU,
`time.thread_time`, and the rest, not running: the GIL; `max_protocol_wait_ms`,
`max_boundary_cpu_ms`, `max_not_running_ms`: each part's longest over every call;
`max_commit_boundary_cpu_ms`: the longest own CPU at the commit step's boundary), the waits at a
boundary before the commit step (`protocol_wait_ahead_ms`, `ranks_waited_ahead`: rank-boundaries
that waited with the commit step still ahead; `protocol_waits_by_step`: step -> [longest wait ms,
rank-boundaries]), the ranks' real step (`step_ms_real`) and the step `at_step` was counted
from (`request_step`: the ranks' step read just before the request), CPU
of the coordinator's threads per switch, CPU of all simulated ranks together (`ranks_cpu_ms`: on
2 cores the ranks' own work, which a cluster runs in parallel, dominates the latencies above a
few hundred ranks; `ranks_cpu_by_thread_ms` splits it by kind of thread, as
bench/profile_switch_ranks.py names them), messages the coordinator sent and received, and connections open at rank
0's server, before the request or after the publish, whichever is more (for `ray`: calls in
flight inside the actor, each a coroutine on its event loop). With `--relays`, each simulated
node's lowest rank relays its node's messages and, off rank 0's node, serves its node's queues
from a store of its own (as `attach` wires a job across hosts, node_store.py):
`leader_connections` is the most any of those stores holds.

With `--stop-rank R` the first switch runs with rank R's listener stopped (it reads nothing, so
it neither votes nor says it is alive, as a stopped process; its trainer runs on, since in a job
the collectives would otherwise hold every rank at R's next one). That row (`committed`: false)
reports `named_ranks` and `reasons` (the abort's), `decision_ms` (request -> the abort) and
`unblocked_ms` (request -> no simulated rank in the switch any more), the stall keys above, and
no publish; R then resumes, and the next switch's row shows whether the job switches without a
restart.

With `--real-ranks K` (and `--relays`) only the last K ranks are real participants; the nodes
before them are scripted relays whose ranks plan, read and publish instantly
(`switch_scale_scripted.py`), in a process of their own that steps in lockstep with the rest. The
coordinator then carries the whole job's load (one bundle per node and round, N ranks counted),
while the two cores run only K ranks' threads: thousands of real ranks' own work on two cores no
longer sets the latencies. The stall keys and `ranks_cpu_ms` are then the K real ranks' (plus
`scripted`, the scripted relays' CPU).
"""

from __future__ import annotations

import argparse
import json
import math
import multiprocessing as mp
import os
import secrets
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from switch_scale_ranks import (
    GIL_SWITCH_S,
    RECIPE_A,
    RECIPE_B,
    THREAD_STACK,
    ActorCalls,
    ActorLoop,
    Counted,
    Ranks,
    server_connections,
    stall_keys,
    thread_cpu_s,
    worker,
)
from switch_scale_scripted import scripted_worker

COSTS_MS = {"in a node": 0.05, "across nodes": 0.5}


# -- one measurement -----------------------------------------------------------------------------


class Bench:
    """One N: rank 0 (server, coordinator, client) here, the ranks in workers or threads."""

    def __init__(self, args: argparse.Namespace, world: int, tmp: Path) -> None:
        from dist_quant.coordinator.coordinator import Coordinator
        from dist_quant.coordinator.decision_log import DecisionLog

        self.args, self.world = args, world
        self.token = secrets.token_hex(16)
        self.deadline = time.monotonic() + args.timeout
        rpn = args.ranks_per_node
        tp_groups = [tuple(range(g, min(g + rpn, world))) for g in range(0, world, rpn)]
        # a node = a TP group; with --relays its lowest rank relays the node's messages
        self.relayed = tuple(g for g in tp_groups if len(g) > 1) if args.relays else ()
        # --real-ranks K: the last K ranks are real participants, the nodes before them scripted
        self.first_real = world - args.real_ranks if args.real_ranks else 0
        self.counts: dict[str, int] = {"sent": 0, "received": 0}
        # ray: every message crosses the actor once (a push in, or a pop out)
        self.gauge = {"now": 0, "peak": 0, "messages": 0}
        self._gauge_lock = threading.Lock()
        self.workers: list[tuple[Any, Any]] = []
        self.local: Ranks | None = None
        self.barrier: Any = None
        before = set(threading.enumerate())
        if args.transport == "store":
            from dist_quant.coordinator.job_host import connect_endpoint
            from dist_quant.coordinator.transport_store import StoreServer

            self.server = StoreServer()
            self.endpoint = {"transport": "store", "address": self.server.address,
                             "token": self.token}  # fmt: skip
            coordinator_transport = Counted(connect_endpoint(self.endpoint), self.counts)
            self.coordinator = Coordinator(
                coordinator_transport,
                token=self.token,
                world_size=world,
                tp_groups=tp_groups,
                log=DecisionLog(tmp / "decisions.jsonl"),
                commit_window_s=0.5,
                relayed_nodes=self.relayed,
                lease_s=args.lease_s,
            )
            self.coordinator.start()
        else:
            from dist_quant.coordinator.transport_ray import _CoordinatorActor

            self.server = None
            self.actor_loop = ActorLoop()
            self.actor = _CoordinatorActor()
            self.actor.start(self.token, world, tp_groups, str(tmp / "decisions.jsonl"), (), 0.5)
        self.coordinator_threads = [t for t in threading.enumerate() if t not in before]

    def _client_transport(self) -> Any:
        if self.args.transport == "store":
            from dist_quant.coordinator.job_host import connect_endpoint

            return connect_endpoint(self.endpoint)
        return ActorCalls(self.actor, self.actor_loop, self.gauge, self._gauge_lock)

    def _left(self) -> float:
        left = self.deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError(f"--timeout {self.args.timeout:g} s passed")
        return left

    def start_ranks(self) -> dict[str, Any]:
        step_s = self.args.step_ms / 1e3
        if self.args.transport == "store":
            ctx = mp.get_context("spawn")
            per = self.args.ranks_per_process
            first_real = self.first_real
            scripted = [n for n in self.relayed if n[-1] < first_real]
            real_workers = math.ceil((self.world - first_real) / per)
            self.barrier = barrier = ctx.Barrier(real_workers + bool(scripted))
            for lo in range(first_real, self.world, per):
                here, there = ctx.Pipe()
                proc = ctx.Process(
                    target=worker,
                    args=(
                        lo,
                        min(lo + per, self.world),
                        self.endpoint,
                        step_s,
                        barrier,
                        there,
                        self.relayed,
                        self.args.gil_switch_ms / 1e3,
                        self.args.stop_rank,
                    ),  # fmt: skip
                    daemon=True,
                )
                proc.start()
                self.workers.append((proc, here))
            if scripted:  # last, so that `_stopper` finds a real rank's worker by its index
                here, there = ctx.Pipe()
                proc = ctx.Process(target=scripted_worker, daemon=True,
                                   args=(scripted, self.endpoint, step_s, barrier, there))  # fmt: skip
                proc.start()
                self.workers.append((proc, here))
            hellos = [self._ask(conn, None) for _, conn in self.workers]
        else:
            threading.stack_size(THREAD_STACK)
            connect = lambda _address: self._client_transport()  # noqa: E731 - one actor
            self.local = Ranks(0, self.world, connect, "", self.token, step_s)
            self.local.started.wait(self._left())
            hellos = [{"failures": self.local.failures, "connect_s": self.local.connect_s}]
        failures = [f for h in hellos for f in h["failures"]]
        self.node_store_ports = [port for h in hellos for port in h.get("node_store_ports", ())]
        return {"attach_failures": len(failures), "first_failure": failures[:1],
                "attach_s": max(h["connect_s"] for h in hellos)}  # fmt: skip

    def _ask(self, conn: Any, cmd: str | None) -> Any:
        if cmd is not None:
            conn.send(cmd)
        if not conn.poll(self._left()):
            raise TimeoutError(f"a worker did not answer {cmd or 'hello'} within --timeout")
        return conn.recv()

    def _reports(self, cmd: Any = "report") -> list[dict[str, Any]]:
        if self.local is not None:
            r = self.local
            name = cmd[1] if isinstance(cmd, tuple) else RECIPE_B["name"]
            return [{"published": r.published(name), "last_publish": r.last_publish(),
                     "max_stall_s": r.max_stall_s, "max_step_s": r.max_step_s,
                     "stall": r.stall.report(), "step": r.step,
                     "cpu_s": time.process_time() - self._cpu0}]  # fmt: skip
        return [self._ask(conn, cmd) for _, conn in self.workers]

    def _step(self) -> int:
        """The furthest step any simulated rank has reached (they train in lockstep)."""
        if self.local is not None:
            return self.local.step
        return max(self._ask(conn, "step") for _, conn in self.workers)

    def _stopper(self) -> Any:
        """The pipe of the worker that holds `--stop-rank`."""
        index = (self.args.stop_rank - self.first_real) // self.args.ranks_per_process
        return self.workers[index][1]

    def _until_nobody_holds(self) -> None:
        """Poll until every simulated rank is out of the switch (an aborted switch's decision
        reached them all)."""
        while sum(self._ask(conn, "holding") for _, conn in self.workers):
            time.sleep(min(0.02, self._left()))

    def _messages(self) -> int:
        if self.server is None:
            return self.gauge["messages"]
        return self.counts["sent"] + self.counts["received"]

    def switch(self, recipe: dict[str, str], stopped: bool = False) -> dict[str, Any]:
        """One switch, measured. `stopped`: with `--stop-rank`'s listener stopped from before
        the request until the switch is decided and every other rank is out of it."""
        from dist_quant.coordinator.switch_requests import request_switch, status

        if self.local is not None:
            self.local.measure()
            self._cpu0 = time.process_time()
            step0 = self.local.step
        else:
            step0 = max(self._ask(conn, "measure") for _, conn in self.workers)
        measured_from = time.monotonic()
        client = self._client_transport()
        connections = server_connections(self.server.port) if self.server else self.gauge["now"]
        leaders = max(map(server_connections, self.node_store_ports), default=0)
        moved0 = self._messages()
        cpu0 = thread_cpu_s(self.coordinator_threads)
        # The ranks' step as the request goes out: counting connections above reads the kernel's
        # socket tables (seconds at thousands of ranks), while the ranks train on.
        step = self._step()
        at_step = step + self.args.at_step_ahead if self.args.at_step_ahead else None
        if stopped:
            self._ask(self._stopper(), "stop")
        t0 = time.monotonic()
        result = request_switch(
            recipe, at_step=at_step, timeout_s=self.args.vote_timeout,
            token=self.token, transport=client,
        )  # fmt: skip
        decided = time.monotonic()
        if stopped:
            return self._aborted(result, t0, decided, measured_from, step0, step, cpu0, moved0)
        if not result.committed:
            raise RuntimeError(f"switch aborted: {result.summary}")
        while True:
            reports = self._reports(("published", recipe["name"]))
            if sum(r["published"] for r in reports) == self.world:
                break
            time.sleep(min(0.02, self._left()))
        published = max(r["last_publish"] for r in reports)
        while status(token=self.token, transport=client)["phase"] != "published":
            time.sleep(min(0.02, self._left()))
        cpu = thread_cpu_s(self.coordinator_threads) - cpu0
        if self.server:  # any the switch opened (a rank asking rank 0 itself) and left open
            connections = max(connections, server_connections(self.server.port))
        final = self._reports()
        last_step = max(r["step"] for r in final)
        ranks_cpu = sum(r["cpu_s"] for r in final)  # acks sent too
        by_thread: dict[str, float] = {}
        for r in final:
            for kind, s in r.get("cpu_by_thread_s", {}).items():
                by_thread[kind] = by_thread.get(kind, 0.0) + 1e3 * s
        if self.local is not None:
            ranks_cpu -= cpu  # one process: all but the coordinator's threads (and the client)
        return {
            "committed": True,
            "decision_ms": 1e3 * (decided - t0),
            "published_ms": 1e3 * (published - t0),
            "max_stall_ms": 1e3 * max(r["max_stall_s"] for r in final),
            "max_step_ms": 1e3 * max(r["max_step_s"] for r in final),
            "coordinator_cpu_ms": 1e3 * cpu,
            "ranks_cpu_ms": 1e3 * ranks_cpu,
            "ranks_cpu_by_thread_ms": {k: round(v, 1) for k, v in sorted(by_thread.items())},
            "rank0_messages": self._messages() - moved0,
            "rank0_connections": connections if self.server else self.gauge["peak"],
            "leader_connections": leaders,
            "commit_step": result.step,
            "at_step": at_step,
            "request_step": step,
            # the steps the ranks really took (their sleep, every boundary, the barrier)
            "step_ms_real": 1e3 * (time.monotonic() - measured_from) / max(last_step - step0, 1),
            **stall_keys([r["stall"] for r in final], result.step),
        }

    def _aborted(
        self, result: Any, t0: float, decided: float, measured_from: float, step0: int,
        step: int, cpu0: float, moved0: int,
    ) -> dict[str, Any]:  # fmt: skip
        """The row of a switch run with a rank stopped: how long until it was decided (aborted,
        naming the rank, is what the library promises) and until no simulated rank was held by
        it any more; then the stopped rank resumes."""
        self._until_nobody_holds()
        unblocked = time.monotonic()
        self._ask(self._stopper(), "resume")
        final = self._reports()
        last_step = max(r["step"] for r in final)
        return {
            "committed": result.committed,
            "named_ranks": sorted(result.reasons),
            "reasons": sorted(set(result.reasons.values())),
            "decision_ms": 1e3 * (decided - t0),
            "unblocked_ms": 1e3 * (unblocked - t0),
            "max_stall_ms": 1e3 * max(r["max_stall_s"] for r in final),
            "coordinator_cpu_ms": 1e3 * (thread_cpu_s(self.coordinator_threads) - cpu0),
            "rank0_messages": self._messages() - moved0,
            "commit_step": result.step,
            "request_step": step,
            "step_ms_real": 1e3 * (time.monotonic() - measured_from) / max(last_step - step0, 1),
            **stall_keys([r["stall"] for r in final], result.step),
        }

    def close(self) -> None:
        if self.barrier is not None:
            self.barrier.abort()  # frees a worker whose peer never came
        for _, conn in self.workers:
            try:
                conn.send("exit")
            except OSError:
                pass
        for proc, _ in self.workers:
            proc.join(10)
            if proc.is_alive():
                proc.kill()
        if self.local is not None:
            self.local.stop()
        if self.server is not None:
            self.coordinator.stop()
            self.server.close()
        else:
            self.actor_loop.call(self.actor.stop())
            self.actor_loop.close()


def measure(args: argparse.Namespace, world: int) -> list[dict[str, Any]]:
    """One row per switch (`--switches`, alternating two recipes; from the second on, the
    coordinator books the commit step from the last switch's measured latency instead of its
    estimate by ranks); a row with an `error` ends the list."""
    rows: list[dict[str, Any]] = []
    row: dict[str, Any] = {"ranks": world, "transport": args.transport, "plan_ms": args.plan_ms,
                           "real_ranks": args.real_ranks or world}  # fmt: skip
    with tempfile.TemporaryDirectory() as tmp:
        bench = None
        try:
            bench = Bench(args, world, Path(tmp))
            attached = {**row, **bench.start_ranks()}
            row = attached
            if attached["attach_failures"]:
                row["error"] = f"{attached['attach_failures']} rank(s) failed to attach"
                return [row]
            committed = 0
            for i in range(args.switches):
                row = {**attached, "switch": i + 1}
                recipe = (RECIPE_B, RECIPE_A)[committed % 2]
                recipe = {**recipe, "plan_ms": args.plan_ms} if args.plan_ms else recipe
                row.update(bench.switch(recipe, stopped=i == 0 and args.stop_rank is not None))
                committed += row.get("committed", True)
                rows.append(row)
        except (TimeoutError, RuntimeError, OSError) as e:
            row["error"] = f"{type(e).__name__}: {e}"
            rows.append(row)
        finally:
            if bench is not None:
                bench.close()
    return rows


# -- output --------------------------------------------------------------------------------------


def projection(world: int, rpn: int, measured: dict[str, Any] | None) -> list[str]:
    """The switch's latency for `world` ranks over world / rpn nodes: network time at the stated
    per-message costs, plus the protocol's CPU as measured here at `world` ranks (`measured`, if
    that N ran): rank 0's coordinator CPU (serial) and one rank's share of the ranks' CPU (ranks
    run in parallel in a cluster). Four message rounds (prepare, vote, decision, ack), two bounds:
    pipelined (a round costs one hop) and serialised (a round costs its messages one after the
    other at rank 0). Flat: every rank talks to rank 0. Node leaders: ranks talk to their node's
    lowest rank, leaders to rank 0."""
    nodes = math.ceil(world / rpn)
    local, remote = COSTS_MS["in a node"], COSTS_MS["across nodes"]
    rounds = 4
    ran = measured is not None and measured.get("ranks") == world and "ranks_cpu_ms" in measured
    if ran:
        base = measured["coordinator_cpu_ms"] + measured["ranks_cpu_ms"] / world
        where = (
            f"+ {base:.0f} ms of CPU measured here at {world} ranks (rank 0's coordinator "
            f"{measured['coordinator_cpu_ms']:.0f} ms, one rank's share "
            f"{measured['ranks_cpu_ms'] / world:.2f} ms)"
        )
    else:
        base, where = 0.0, f"only ({world} ranks were not measured in this run)"
    lines = [
        f"projection for {world} ranks on {nodes} nodes ({rpn} per node): {local} ms per "
        f"message in a node, {remote} ms across nodes, {rounds} rounds, network time {where}:"
    ]
    for name, pipelined, serial in (
        ("flat", remote, world * remote),
        ("node leaders", local + remote, rpn * local + nodes * remote),
    ):
        lines.append(
            f"  {name:<12}: pipelined {base + rounds * pipelined:9.0f} ms, "
            f"serialised at rank 0 {base + rounds * serial:9.0f} ms"
        )
    lines.append(
        "not simulated: network round trips (every rank shares this host), liveness at the "
        "library's 1.5 s lease beyond ~2,048 ranks (--stop-rank with --lease-s 1.5 measures it; a live "
        "rank sharing 2 cores with thousands can be silent longer), planning time (the "
        "stub plans in microseconds; bench/bench_switch.py measures plan_model), GPU work and "
        "the collectives between steps (a barrier per step stands in for them)."
    )
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, nargs="+", default=[64, 1024, 4096, 16384])
    parser.add_argument("--ranks-per-node", type=int, default=8)
    parser.add_argument("--transport", choices=("store", "ray"), default="store")
    parser.add_argument("--json", action="store_true", help="one JSON object per line")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds per N")
    parser.add_argument("--vote-timeout", type=float, default=300.0)
    parser.add_argument("--step-ms", type=float, default=20.0,
                        help="the simulated ranks' sleep per step (a real large job's step is "
                        "seconds: BENCHMARKS.md uses 1000)")  # fmt: skip
    parser.add_argument(
        "--plan-ms",
        type=float,
        default=0.0,
        help="each simulated rank's plan sleeps its own share of this, spread "
        "evenly over the ranks (a real plan takes time, unequal across ranks)",
    )
    parser.add_argument("--switches", type=int, default=1,
                        help="switches per N, one JSON row each")  # fmt: skip
    parser.add_argument("--at-step-ahead", type=int, default=0,
                        help="request at_step = the ranks' step as the request goes out + this "
                        "(0: no at_step); the margin is this times step_ms_real")  # fmt: skip
    parser.add_argument(
        "--ranks-per-process",
        type=int,
        default=256,
        help="simulated ranks per worker process (their threads share its GIL)",
    )
    parser.add_argument("--lease-s", type=float, default=30.0,
                        help="store: the coordinator's liveness lease; the library's 1.5 s assumes "
                        "each rank has a CPU of its own, here thousands share 2 cores and a live "
                        "rank can wait seconds to read the Prepare")  # fmt: skip
    parser.add_argument("--relays", action="store_true",
                        help="store: each node's lowest rank relays its node's messages, as "
                        "attach sets up across hosts (rank 0 then handles O(nodes) messages)")  # fmt: skip
    parser.add_argument("--stop-rank", type=int, default=None,
                        help="store: this rank's listener stops reading (as a stopped process's "
                        "would) from before the first switch until it is decided, so that "
                        "switch's row shows how soon the lease (--lease-s; the library's is 1.5) "
                        "aborts it and frees every other rank; the next switch (--switches 2) "
                        "runs with the rank back")  # fmt: skip
    parser.add_argument("--real-ranks", type=int, default=0,
                        help="store, --relays: only the last this many ranks are real "
                        "participants; the nodes before them are scripted relays whose ranks "
                        "plan instantly (switch_scale_scripted.py), so the real ones meet the "
                        "coordinator's load at full N (0: every rank real)")  # fmt: skip
    parser.add_argument("--gil-switch-ms", type=float, default=1e3 * GIL_SWITCH_S,
                        help="store: the GIL switch interval of the simulated ranks' processes "
                        "(CPython's default is 5; switch_scale_ranks.py says why it is longer)")  # fmt: skip
    args = parser.parse_args()
    if min(args.ranks_per_node, args.ranks_per_process, args.switches, *args.ranks) < 1:
        parser.error("--ranks, --ranks-per-node, --ranks-per-process and --switches must be >= 1")
    if args.relays and (args.transport != "store" or args.ranks_per_process % args.ranks_per_node):
        parser.error("--relays needs --transport store and whole nodes per process "
                     "(--ranks-per-process a multiple of --ranks-per-node)")  # fmt: skip

    if args.stop_rank is not None and (
        args.transport != "store" or not 0 < args.stop_rank < min(args.ranks)
    ):
        parser.error("--stop-rank needs --transport store and a rank in [1, smallest --ranks)")
    if args.real_ranks and (
        not args.relays
        or args.real_ranks % args.ranks_per_node
        or args.real_ranks >= min(args.ranks)
    ):
        parser.error("--real-ranks needs --relays and a multiple of --ranks-per-node below the "
                     "smallest --ranks (the scripted nodes come first)")  # fmt: skip
    if (
        args.real_ranks
        and args.stop_rank is not None
        and (any(args.stop_rank < n - args.real_ranks for n in args.ranks))
    ):
        parser.error("--stop-rank with --real-ranks K: a real rank, one of the last K of "
                     "every --ranks")  # fmt: skip

    import torch

    if not args.json:
        print(f"{os.cpu_count()} CPU cores, torch {torch.__version__}, transport "
              f"{args.transport}, {args.ranks_per_node} ranks per node (= TP group"
              f"{', relayed' if args.relays else ''}), "
              f"{args.step_ms:g} ms steps, {args.ranks_per_process} ranks per process, "
              f"lease {args.lease_s:g} s")  # fmt: skip
        print(f"{'ranks':>6} | {'decision ms':>11} | {'published ms':>12} | {'max stall ms':>12} |"
              f" {'coord CPU ms':>12} | {'rank0 msgs':>10} | {'rank0 conns':>11} |"
              f" {'leader conns':>12}")  # fmt: skip
    largest = None
    rows = (row for world in args.ranks for row in measure(args, world))
    for row in rows:
        world = row["ranks"]
        if "error" not in row and row["committed"]:
            largest = row
        if args.json:
            print(json.dumps(row), flush=True)
        elif "error" in row:
            print(f"{world:>6} | {row['error']}", flush=True)
        elif not row["committed"]:
            print(f"{world:>6} | aborted in {row['decision_ms']:.1f} ms naming ranks "
                  f"{row['named_ranks']} ({'; '.join(row['reasons'])}); no rank held after "
                  f"{row['unblocked_ms']:.1f} ms; longest protocol wait "
                  f"{row['max_protocol_wait_ms']:.1f} ms", flush=True)  # fmt: skip
        else:
            print(f"{world:>6} | {row['decision_ms']:11.1f} | {row['published_ms']:12.1f} | "
                  f"{row['max_stall_ms']:12.1f} | {row['coordinator_cpu_ms']:12.1f} | "
                  f"{row['rank0_messages']:10d} | {row['rank0_connections']:11d} | "
                  f"{row['leader_connections']:12d}", flush=True)  # fmt: skip
    if not args.json:
        print("\n" + "\n".join(projection(16384, 8, largest)))


if __name__ == "__main__":
    sys.exit(main())
