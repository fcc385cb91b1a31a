"""The coordinator's own CPU per switch against N instant voters, in one process.

    python bench/bench_coordinator_cpu.py [--ranks 1024,4096,16384] [--per-node 8] [--json]

A real `Coordinator` (memory transport, a real fsynced decision log in a temp dir) runs one switch
for N ranks whose votes and acks are sealed beforehand and pushed the moment the Prepare is out,
so what is timed is the coordinator: unsealing, counting, deciding, logging, fanning out.
Printed per N: request -> decision (wall), decision -> every ack counted (wall), and the process
CPU over the whole switch (the coordinator's threads; the voters only push ready bytes).
With `--per-node K` the ranks sit in nodes of K behind node relays (node_relay.py): the votes and
acks arrive as one ready Bundle per node, the Prepare and the decision go out once per node, which
is what rank 0 does in a job across hosts (the relays' own work runs on the other hosts).
The end-to-end scale benchmark with real participants is bench/bench_switch_scale.py.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import tempfile
import time
from pathlib import Path

from dist_quant.coordinator.coordinator import Coordinator
from dist_quant.coordinator.decision_log import DecisionLog
from dist_quant.coordinator.node_relay import summarized
from dist_quant.coordinator.protocol import Ack, Bundle, StatusQuery, SwitchRequest, Vote
from dist_quant.coordinator.transport_memory import MemoryHub, MemoryTransport
from dist_quant.coordinator.wire import INBOX, reply_queue, seal, unseal

TOKEN = "bench-token"
LAST_STEP = 10
DIGEST = hashlib.sha256(b"recipe B").hexdigest()


def _reply(hub: MemoryHub, request_id: str, limit_s: float = 600.0):
    """Polls (rather than blocking in `pop`) so that this thread is not woken by every push."""
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        data = hub.pop(reply_queue(request_id), 0)
        if data is not None:
            return unseal(data, TOKEN)
        time.sleep(0.001)
    raise TimeoutError(f"no reply to {request_id} within {limit_s} s")


def _batched(msgs: list, per_node: int) -> list[bytes]:
    """Each message sealed on its own, or (`per_node` > 1) one sealed Bundle per node, as its
    relay sends it (`summarized`: a node whose votes or acks agree as one summary)."""
    if per_node <= 1:
        return [seal(m, TOKEN) for m in msgs]
    bundles = []
    for i in range(0, len(msgs), per_node):
        node = range(i, min(i + per_node, len(msgs)))
        bundles.append(seal(Bundle.of(i, summarized(i, node, msgs[i : i + per_node])), TOKEN))
    return bundles


def _vote(rank: int) -> Vote:
    """A YES as a rank sends it: the plan's 64-hex digest (the same across the job here), and
    the rank's own plan time and seconds per step, measurements that differ from rank to rank."""
    prepare_s = 0.05 + rank * 1e-7
    step_s = 0.2 + (rank % 1000) * 1e-6
    return Vote(1, rank, True, DIGEST, LAST_STEP, "", prepare_s, step_s)


def one_switch(ranks: int, tmp: Path, per_node: int = 1) -> dict[str, float]:
    hub = MemoryHub()
    nodes = [range(i, i + per_node) for i in range(0, ranks, per_node)] if per_node > 1 else []
    coord = Coordinator(
        MemoryTransport(hub),
        token=TOKEN,
        world_size=ranks,
        tp_groups=[(r, r + 1) for r in range(0, ranks, 2)],
        # a log of its own: in one left by an earlier run of the same N the switch would not be
        # switch 1, and the votes sealed beforehand for switch 1 would be stale
        log=DecisionLog(Path(tempfile.mkdtemp(dir=tmp)) / "decisions.jsonl"),
        relayed_nodes=nodes,
    )
    coord.start()
    votes = _batched([_vote(r) for r in range(ranks)], per_node)
    try:
        cpu0, t0 = time.process_time(), time.perf_counter()
        hub.push(INBOX, seal(SwitchRequest("req", {"name": "B"}, None, 600.0), TOKEN))
        accepted = _reply(hub, "req")
        if accepted.status != "accepted":
            raise RuntimeError(f"request refused: {accepted.error}")
        for data in votes:
            hub.push(INBOX, data)
        result = _reply(hub, "req").body
        t_decided = time.perf_counter()
        if not result["committed"]:
            raise RuntimeError(f"switch aborted: {result['summary']}")
        step = result["step"]
        # the acks are sealed here, by the harness: its CPU and time are taken out of the figures
        build_cpu0, build_t0 = time.process_time(), time.perf_counter()
        acks = _batched([Ack(1, r, step, True, "", "B") for r in range(ranks)], per_node)
        build_cpu = time.process_time() - build_cpu0
        t_decided += time.perf_counter() - build_t0
        for data in acks:
            hub.push(INBOX, data)
        hub.push(INBOX, seal(StatusQuery("after-acks"), TOKEN))
        phase = _reply(hub, "after-acks").body["phase"]
        t_acked, cpu1 = time.perf_counter(), time.process_time() - build_cpu
        if phase != "published":
            raise RuntimeError(f"after every ack the coordinator is {phase}, not published")
    finally:
        coord.stop()
    return {
        "ranks": ranks,
        "per_node": per_node,
        "decision_ms": (t_decided - t0) * 1e3,
        "acks_ms": (t_acked - t_decided) * 1e3,
        "cpu_ms": (cpu1 - cpu0) * 1e3,
        "cpu_us_per_rank": (cpu1 - cpu0) * 1e6 / ranks,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", default="1024,4096,16384")
    ap.add_argument("--per-node", type=int, default=1, help="ranks per node relay (1: none)")
    ap.add_argument("--json", action="store_true", help="one JSON object per line")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        for n in (int(x) for x in args.ranks.split(",")):
            row = one_switch(n, Path(tmp), args.per_node)
            if args.json:
                print(json.dumps(row), flush=True)
            else:
                print(
                    f"{n:>6} ranks: request->decision {row['decision_ms']:9.1f} ms, "
                    f"acks {row['acks_ms']:8.1f} ms, CPU {row['cpu_ms']:9.1f} ms "
                    f"({row['cpu_us_per_rank']:.1f} us/rank)",
                    flush=True,
                )


if __name__ == "__main__":
    main()
