"""Where a simulated rank's CPU goes: one worker's ranks of bench/bench_switch_scale.py, by thread.

    python bench/profile_switch_ranks.py [--ranks 256] [--switches 6] [--idle-s 2]

Runs, in this one process, what one worker of `bench_switch_scale.py --relays` runs (N real
`Participant`s, 8 per node, each node's lowest rank relaying and, off rank 0's node, serving its
node's store; one lockstep trainer thread, 20 ms steps) against the real coordinator and rank 0's
store, then switches back and forth. It prints the CPU of each kind of thread (read from the
kernel, so idle waits cost nothing), idle for `--idle-s` and per switch, and the store commands
the connections of this process sent: `listener` (a rank's reader: Prepare, decision, its probes
and `Alive`s), `planner` (a thread per switch per rank: plan, vote), `relay.up` / `relay.down`
(the leaders' relays), `trainer` (every rank's `step_boundary`, publish and ack, and the
simulator's lockstep loop), `store` (the TCPStore servers' own threads: rank 0's and the node
stores), `coordinator` and `other` (rank 0's threads and the client's, which a worker does not
hold). What the ranks cost a real job is the per-rank share of the first five; on its own CPU a
real rank pays none of the thread switching that hundreds of ranks sharing one interpreter's GIL
add here. `bench_switch_scale.py` reports the same split per switch (`ranks_cpu_by_thread_ms`).
"""

from __future__ import annotations

import argparse
import collections
import os
import secrets
import shutil
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

from dist_quant.coordinator import transport_store_client
from dist_quant.coordinator.coordinator import Coordinator
from dist_quant.coordinator.decision_log import DecisionLog
from dist_quant.coordinator.job_host import connect_endpoint
from dist_quant.coordinator.switch_requests import request_switch, status
from dist_quant.coordinator.transport_store import StoreServer
from switch_scale_ranks import GIL_SWITCH_S, RECIPE_A, RECIPE_B, THREAD_STACK, Ranks, ThreadClock


class StoreOps:
    """Counts the store commands every connection in this process sends."""

    def __init__(self) -> None:
        self.counts: collections.Counter[str] = collections.Counter()
        cls = transport_store_client.StoreClientTransport
        push, pop, counts = cls.push, cls.pop, self.counts

        def counted_push(t: object, queue: str, data: bytes) -> None:
            counts["push"] += 1
            push(t, queue, data)

        def counted_pop(t: object, queue: str, timeout: float | None = None) -> bytes | None:
            data = pop(t, queue, timeout)
            counts["pop" if data is not None else "pop timed out"] += 1
            return data

        cls.push, cls.pop = counted_push, counted_pop  # type: ignore[method-assign]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=256)
    parser.add_argument("--ranks-per-node", type=int, default=8)
    parser.add_argument("--switches", type=int, default=6)
    parser.add_argument("--idle-s", type=float, default=2.0)
    parser.add_argument("--step-ms", type=float, default=20.0)
    parser.add_argument("--gil-switch-ms", type=float, default=1e3 * GIL_SWITCH_S,
                        help="this process's GIL switch interval, as a worker's (CPython: 5)")  # fmt: skip
    args = parser.parse_args()
    sys.setswitchinterval(args.gil_switch_ms / 1e3)
    clock, ops = ThreadClock(), StoreOps()
    world, rpn, token = args.ranks, args.ranks_per_node, secrets.token_hex(16)
    nodes = tuple(tuple(range(g, min(g + rpn, world))) for g in range(0, world, rpn))
    relayed = tuple(n for n in nodes if len(n) > 1)
    server = StoreServer()
    endpoint = {"transport": "store", "address": server.address, "token": token}
    tmp = tempfile.mkdtemp()
    try:
        coordinator = Coordinator(connect_endpoint(endpoint), token=token, world_size=world,
                                  tp_groups=nodes, log=DecisionLog(Path(tmp) / "log.jsonl"),
                                  relayed_nodes=relayed, lease_s=30.0)  # fmt: skip
        coordinator.start()
        threading.stack_size(THREAD_STACK)
        connect = lambda address: connect_endpoint({**endpoint, "address": address})  # noqa: E731
        ranks = Ranks(0, world, connect, server.address, token, args.step_ms / 1e3, None, relayed)
        if ranks.failures or not ranks.started.wait(60):
            sys.exit(f"attach failed: {ranks.failures[:1]}")
        time.sleep(1.0)  # the attach's stragglers
        cpu0, ops0 = clock.read(), ops.counts.copy()
        time.sleep(args.idle_s)
        idle = {k: v / args.idle_s for k, v in (clock.read() - cpu0).items()}
        print(f"{world} ranks idle, CPU ms per second: " + _ms(idle, world))
        print(f"  store commands: {dict(ops.counts - ops0) or 'none'}")
        client = connect_endpoint(endpoint)
        per_switch = []
        for i in range(args.switches):
            recipe = (RECIPE_B, RECIPE_A)[i % 2]
            cpu0, ops0 = clock.read(), ops.counts.copy()
            t0 = time.monotonic()
            result = request_switch(recipe, timeout_s=60.0, token=token, transport=client)
            if not result.committed:
                sys.exit(f"switch {i + 1} aborted: {result.summary}")
            while sum(m.recipe == recipe["name"] for m in ranks.models) < world:
                time.sleep(0.01)
            published = time.monotonic() - t0
            while status(token=token, transport=client)["phase"] != "published":
                time.sleep(0.02)
            used = clock.read() - cpu0
            per_switch.append(used)
            print(f"switch {i + 1}: published in {1e3 * published:.0f} ms, CPU ms: "
                  f"{_ms(used, world)}; store commands {dict(ops.counts - ops0)}")  # fmt: skip
            time.sleep(0.3)
        kinds = sorted({k for s in per_switch for k in s})
        median = {k: statistics.median(s.get(k, 0.0) for s in per_switch) for k in kinds}
        print(f"median of {args.switches} switches, CPU ms: {_ms(median, world)}")
        ranks.stop()
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    os._exit(0)  # the ranks' threads and stores end with the process, as a worker's do


def _ms(cpu: dict[str, float], world: int) -> str:
    ranks = sum(v for k, v in cpu.items() if k not in ("coordinator", "other"))
    parts = ", ".join(f"{k} {1e3 * v:.1f}" for k, v in sorted(cpu.items()) if v > 0)
    return (
        f"{parts}; ranks' threads and stores {1e3 * ranks:.1f} ({1e6 * ranks / world:.0f} us/rank)"
    )


if __name__ == "__main__":
    main()
