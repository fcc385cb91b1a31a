"""The coordinator's own CPU per switch against N instant voters, in one process.

    python bench/bench_coordinator_cpu.py [--ranks 1024,4096,16384] [--per-node 8] [--json]
    python bench/bench_coordinator_cpu.py --store [--ranks 1024,16384] [--per-node 8] [--json]
        [--silent-rank R]

A real `Coordinator` (memory transport, a real fsynced decision log in a temp dir) runs one switch
for N ranks whose votes and acks are sealed beforehand and pushed the moment the Prepare is out,
so what is timed is the coordinator: unsealing, counting, deciding, logging, fanning out.
Printed per N: request -> decision (wall), decision -> every ack counted (wall), and the process
CPU over the whole switch (the coordinator's threads; the voters only push ready bytes).
With `--per-node K` the ranks sit in nodes of K behind node relays (node_relay.py): the votes and
acks arrive as one ready Bundle per node, as the relay sends it (a node whose ranks agree as one
summary, `node_relay.summarized`), the Prepare and the decision go out once per node, which is
what rank 0 does in a job across hosts (the relays' own work runs on the other hosts).

`--store` is the latency of the issue's harness (the real coordinator and the real store
transport, ranks that vote and ack instantly) with node relays: a `StoreServer` in this process,
the coordinator and the client connected to it as in a job, and scripted node voters (a few
threads, each one connection, standing in for the relays of many nodes) that pop each node's
Prepare from `node/<leader>/down` and push its ready vote bundle at once, then its decision and
its ready ack bundle. Printed per N (the `--json` keys of bench_switch_scale where they apply):
request -> decision at the client (`decision_ms`), request -> every node got the decision
(`published_ms`: an instant rank publishes once its relay hands it the decision), request -> every
ack counted (`acked_ms`), the coordinator threads' CPU (`coordinator_cpu_ms`; per thread,
`coordinator_threads_cpu_ms`: the pump and the main thread) and the messages it
moved (`rank0_messages`), the scripted relays' CPU (`voters_cpu_ms`: work a cluster does on the
other hosts, here on the same cores; with `--hand-down` they also check each Prepare and decision
and hand it to every rank's queue, as a relay does), with a projection at the issue's network cost.
The scripted relays are the harness's load, not rank 0's work: with `--voters-apart` their threads
(`--voter-threads`, 8 by default) run in a process of their own, as relays run on hosts of their
own, so that they stop taking turns with the coordinator's two threads for one GIL; on two cores
they still share the CPUs.
With `--silent-rank R` rank R never votes and its relay never says it is alive (a rank stopped
before the Prepare behind a live relay): the coordinator aborts at the library's lease
(`timing.LEASE_S`), and the row gives request -> the abort at the client (`decision_ms`), the
ranks it names, and request -> every node has the ABORT (`unblocked_ms`: a relay that has it
hands it to its ranks, which then leave the switch), the liveness target at any N with the
ranks' own work taken out (bench_switch_scale.py --stop-rank measures it with real ranks).
The end-to-end scale benchmark with real participants is bench/bench_switch_scale.py.
"""

from __future__ import annotations

import argparse
import gc
import hashlib
import json
import math
import multiprocessing
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from dist_quant.coordinator.coordinator import Coordinator
from dist_quant.coordinator.decision_log import DecisionLog
from dist_quant.coordinator.node_relay import hand_down, summarized
from dist_quant.coordinator.protocol import (
    Ack,
    Bundle,
    Decision,
    Prepare,
    StatusQuery,
    SwitchRequest,
    Vote,
)
from dist_quant.coordinator.timing import hold_step, lead_time
from dist_quant.coordinator.transport_memory import MemoryHub, MemoryTransport
from dist_quant.coordinator.wire import (
    INBOX,
    node_down_queue,
    rank_queue,
    reply_queue,
    seal,
    unseal,
)
from switch_scale_ranks import Counted

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


def _batched(msgs: list, per_node: int, summaries: bool = True) -> list[bytes]:
    """Each message sealed on its own, or (`per_node` > 1) one sealed Bundle per node that sent
    any (ranks `leader` .. `leader + per_node - 1`), as its relay sends it (`summarized`: a node whose votes or acks agree as one summary; without
    `summaries`, every rank's message in the bundle, as before summaries)."""
    if per_node <= 1:
        return [seal(m, TOKEN) for m in msgs]
    by_leader: dict[int, list] = {}
    for m in msgs:
        by_leader.setdefault(m.rank - m.rank % per_node, []).append(m)
    bundles = []
    for leader, held in sorted(by_leader.items()):
        node = range(leader, leader + per_node)
        sent = summarized(leader, node, held) if summaries else held
        bundles.append(seal(Bundle.of(leader, sent), TOKEN))
    return bundles


def _vote(rank: int, lead_s: float) -> Vote:
    """A YES as a rank sends it: the plan's 64-hex digest (the same across the job here), the
    rank's own plan time, and the hold step its own seconds per step give for the lead: numbers
    that differ from rank to rank."""
    prepare_s = 0.05 + rank * 1e-7
    step_s = 0.002 + (rank % 1000) * 1e-6
    hold = hold_step(LAST_STEP, step_s, lead_s, None)
    return Vote(1, rank, True, DIGEST, LAST_STEP, "", prepare_s, hold)


def _coordinator(transport: Any, ranks: int, tmp: Path, nodes: list[range]) -> Coordinator:
    """The coordinator of a job of `ranks` ranks in TP pairs (`nodes`: its relayed nodes), with a
    decision log of its own: in one left by an earlier run of the same N the switch would not be
    switch 1, and the votes sealed beforehand for switch 1 would be stale."""
    return Coordinator(
        transport,
        token=TOKEN,
        world_size=ranks,
        tp_groups=[(r, r + 1) for r in range(0, ranks, 2)],
        log=DecisionLog(Path(tempfile.mkdtemp(dir=tmp)) / "decisions.jsonl"),
        relayed_nodes=nodes,
    )


def one_switch(ranks: int, tmp: Path, per_node: int = 1, summaries: bool = True) -> dict[str, Any]:
    hub = MemoryHub()
    nodes = [range(i, i + per_node) for i in range(0, ranks, per_node)] if per_node > 1 else []
    coord = _coordinator(MemoryTransport(hub), ranks, tmp, nodes)
    coord.start()
    votes = _batched([_vote(r, lead_time(ranks, None)) for r in range(ranks)], per_node, summaries)
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
        acked = [Ack(1, r, step, True, "", "B") for r in range(ranks)]
        acks = _batched(acked, per_node, summaries)
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
        "summaries": summaries,
        "decision_ms": (t_decided - t0) * 1e3,
        "acks_ms": (t_acked - t_decided) * 1e3,
        "cpu_ms": (cpu1 - cpu0) * 1e3,
        "cpu_us_per_rank": (cpu1 - cpu0) * 1e6 / ranks,
        "cpu_us_per_node": (cpu1 - cpu0) * 1e6 / math.ceil(ranks / per_node),
    }


# -- the harness: the real store transport, instant node voters ----------------------------

VOTER_THREADS = 8  # by default; each stands in for the relays of nodes / 8 nodes, on a connection
COSTS_MS = {"in a node": 0.05, "across nodes": 0.5}  # the stated per-message network cost


def _thread_cpu_s(threads: list[threading.Thread]) -> dict[str, float]:
    """Each thread's CPU so far, by the last part of its name ("pump", "main")."""
    return {
        t.name.rsplit(".", 1)[-1]: time.clock_gettime(time.pthread_getcpuclockid(t.ident))
        for t in threads
    }


def _voter(
    transport: Any,
    leaders: list[int],
    votes: dict,
    acks: dict,
    got: list,
    cpu: list,
    nodes: dict[int, range] | None = None,
) -> None:
    """The relays of `leaders`' nodes, scripted: each node's ready votes once its Prepare is
    there, then its ready acks once its decision is; `got` gets the time of the last decision,
    `cpu` this thread's CPU (on a cluster, the relays' work runs on their own hosts); a node
    without an entry in `votes` (`acks`) sends none. With
    `nodes` (leader -> its ranks), each Prepare and decision is also checked against the token
    and handed to every rank's queue of its node, as a relay's down thread does, before the
    node counts as having it."""
    try:
        # each pops as a relay does (`pop_many`: a QUEUE_POP first, a WAIT only when empty)
        for expected, answers in ((Prepare, votes), (Decision, acks)):
            for leader in leaders:
                (data,) = transport.pop_many(node_down_queue(leader), 1)
                if nodes is not None:
                    msg = unseal(data, TOKEN)
                    if not isinstance(msg, expected):
                        raise RuntimeError(f"node {leader} got {msg.kind}, not {expected.kind}")
                    hand_down(transport, nodes[leader], data)
                if expected is Decision:
                    got.append(time.monotonic())
                if leader in answers:  # an ABORT is not acked
                    transport.push(INBOX, answers[leader])
    finally:
        cpu.append(time.thread_time())
        transport.close()


def _voter_threads(
    endpoint: dict, groups: list[list[int]], votes: dict, acks: dict, got: list, cpu: list,
    nodes: dict | None,
) -> list[threading.Thread]:  # fmt: skip
    """One `_voter` thread per group of leaders, each on a connection of its own."""
    from dist_quant.coordinator.job_host import connect_endpoint

    return [
        threading.Thread(
            target=_voter,
            args=(connect_endpoint(endpoint), group, votes, acks, got, cpu, nodes),
            daemon=True,
        )
        for group in groups
    ]


def _voters_apart(
    endpoint: dict, groups: list[list[int]], votes: dict, acks: dict, nodes: dict | None,
    ready: Any, results: Any,
) -> None:  # fmt: skip
    """The scripted relays' threads, in a process of their own (`--voters-apart`); puts the
    decisions' arrival times (`time.monotonic`, one clock for every process of the host) and the
    threads' CPU on `results`."""
    got: list[float] = []
    cpu: list[float] = []
    threads = _voter_threads(endpoint, groups, votes, acks, got, cpu, nodes)
    for t in threads:
        t.start()
    ready.set()
    for t in threads:
        t.join()
    results.put((got, cpu))


def one_switch_store(
    ranks: int,
    tmp: Path,
    per_node: int,
    summaries: bool,
    handing_down: bool = False,
    voters_apart: bool = False,
    voter_threads: int = VOTER_THREADS,
    silent_rank: int | None = None,
) -> dict[str, Any]:
    """One switch; with `silent_rank` that rank never votes and its relay never says it is
    alive (a rank stopped before the Prepare behind a live relay): the coordinator aborts it at
    the library's lease, and the row reports when every node had the ABORT."""
    # imported here: they import torch, whose objects would make the memory mode's garbage
    # collections (and its CPU figures) heavier than in the runs it is compared with
    from dist_quant.coordinator.job_host import connect_endpoint
    from dist_quant.coordinator.transport_store import StoreServer

    leaders = list(range(0, ranks, per_node))
    nodes = [range(r, min(r + per_node, ranks)) for r in leaders]
    # the commit step the coordinator will book (no switch before: the lead is its estimate),
    # so that the acks can be sealed before the switch like the votes
    lead_s = lead_time(ranks, None)
    sent = [_vote(r, lead_s) for r in range(ranks) if r != silent_rank]
    step = max(v.hold_step or 0 for v in sent)
    voted = _batched(sent, per_node, summaries)
    acked = _batched([Ack(1, r, step, True, "", "B") for r in range(ranks)], per_node, summaries)
    votes = dict(zip(leaders, voted, strict=True))
    acks = {} if silent_rank is not None else dict(zip(leaders, acked, strict=True))
    server = StoreServer()
    endpoint = {"transport": "store", "address": server.address, "token": TOKEN}
    counted = Counted(connect_endpoint(endpoint))
    before = set(threading.enumerate())
    coord = _coordinator(counted, ranks, tmp, nodes)
    coord.start()
    coordinator_threads = [t for t in threading.enumerate() if t not in before]
    client = connect_endpoint(endpoint)
    got: list[float] = []
    voters_cpu: list[float] = []
    groups = [leaders[i::voter_threads] for i in range(min(voter_threads, len(leaders)))]
    by_leader = dict(zip(leaders, nodes, strict=True)) if handing_down else None
    apart = None
    if voters_apart:
        spawn = multiprocessing.get_context("spawn")
        ready, results = spawn.Event(), spawn.Queue()
        apart = spawn.Process(
            target=_voters_apart,
            args=(endpoint, groups, votes, acks, by_leader, ready, results),
            daemon=True,
        )
        voters = []
    else:
        voters = _voter_threads(endpoint, groups, votes, acks, got, voters_cpu, by_leader)
    # A training process that has imported torch holds a large heap: a full garbage collection
    # then costs ~90 ms on this machine and lands on whichever thread allocates. The setup's
    # objects (torch's, the pre-sealed messages) are frozen out of the collector, as a trainer
    # that freezes after its setup does, so the figures are the switch's, not one collection's.
    gc.collect()
    gc.freeze()
    try:
        for t in voters:
            t.start()
        if apart is not None:
            apart.start()
            if not ready.wait(120.0):
                raise TimeoutError("the scripted relays' process did not start")
        cpu0 = _thread_cpu_s(coordinator_threads)
        t0 = time.monotonic()
        client.push(INBOX, seal(SwitchRequest("req", {"name": "B"}, None, 600.0), TOKEN))
        replies = [unseal(client.pop(reply_queue("req"), 600.0), TOKEN) for _ in range(2)]
        t_decided = time.monotonic()
        result = replies[1].body
        if silent_rank is not None:
            if result["committed"] or list(result["reasons"]) != [str(silent_rank)]:
                raise RuntimeError(f"switch {result['summary']}, expected an abort naming "
                                   f"rank {silent_rank} alone")  # fmt: skip
        elif not result["committed"] or result["step"] != step:
            raise RuntimeError(f"switch {result['summary']}, expected a commit at step {step}")
        while silent_rank is None and coord.phase.value != "published":
            if time.monotonic() - t0 > 600.0:
                raise TimeoutError(f"not every ack counted: {coord.phase.value}")
            time.sleep(0.0005)
        t_acked = time.monotonic()
        cpu1 = _thread_cpu_s(coordinator_threads)
        cpu_by_thread = {name: cpu1[name] - cpu0[name] for name in cpu1}
        # before the Stop that ends the coordinator
        messages = counted.counts["sent"] + counted.counts["received"]
        for t in voters:
            t.join(60.0)
        if apart is not None:
            got, voters_cpu = results.get(timeout=60.0)
            apart.join(60.0)
        handed = _handed_down(connect_endpoint(endpoint), ranks) if handing_down else 0
    finally:
        gc.unfreeze()
        if apart is not None and apart.is_alive():
            apart.kill()
        coord.stop()
        client.close()
        server.close()
    every_node_ms = (max(got) - t0) * 1e3
    reached = {"published_ms": every_node_ms, "acked_ms": (t_acked - t0) * 1e3}
    if silent_rank is not None:  # nothing publishes or acks: every node has the ABORT
        reached = {"committed": False, "named_ranks": [int(r) for r in result["reasons"]],
                   "reasons": sorted(set(result["reasons"].values())),
                   "unblocked_ms": every_node_ms}  # fmt: skip
    return {
        "ranks": ranks,
        "per_node": per_node,
        "nodes": len(leaders),
        "summaries": summaries,
        "transport": "store",
        "silent_rank": silent_rank,
        "decision_ms": (t_decided - t0) * 1e3,
        **reached,
        "coordinator_cpu_ms": sum(cpu_by_thread.values()) * 1e3,
        # the pump reads and unseals the inbox; main counts, decides, logs and sends
        "coordinator_threads_cpu_ms": {name: s * 1e3 for name, s in sorted(cpu_by_thread.items())},
        "rank0_messages": messages,
        "voters_cpu_ms": sum(voters_cpu) * 1e3,
        "voters_apart": voters_apart,
        "voter_threads": len(groups),
        "hand_down": handing_down,
        "handed_down": handed,
    }


def _handed_down(reader: Any, ranks: int) -> int:
    """How many messages wait in the ranks' own queues (nobody reads them here); closes
    `reader`."""
    try:
        return sum(len(reader.pop_many(rank_queue(r), 4, 0.0)) for r in range(ranks))
    finally:
        reader.close()


def projection(row: dict[str, Any]) -> list[str]:
    """Request -> every rank published with the network added at the issue's cost: the path is
    three hops across nodes (Prepare to the leaders, their votes up, the decision down) and three
    in a node (the Prepare handed to the ranks, their votes to the leader, the decision handed
    on). Two bounds: pipelined (each hop costs its latency once) and serialised at rank 0 (its
    messages of those three rounds one after the other)."""
    local, remote = COSTS_MS["in a node"], COSTS_MS["across nodes"]
    hops = 3 * (remote + local)
    serial = 3 * row["nodes"] * remote + 3 * row["per_node"] * local
    base = row["published_ms"]
    return [
        f"  projected with {local} ms per message in a node, {remote} ms across nodes: "
        f"pipelined {base + hops:.1f} ms, serialised at rank 0 {base + serial:.0f} ms",
    ]


LEFT_OUT = (
    "left out: the ranks' own planning (instant here; bench/bench_switch.py measures plan_model) "
    "and publishing (at their commit step's boundary, booked lead_s ahead of the votes), the "
    "relays' work on their hosts (gathering, checking each rank's seal, summarizing; checking "
    "and handing the Prepare and decision to each rank unless --hand-down), and the network "
    "(one host, loopback: projected above)"
)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", default="1024,4096,16384")
    ap.add_argument("--per-node", type=int, default=1, help="ranks per node relay (1: none)")
    ap.add_argument("--store", action="store_true", help="latency over the real store transport")
    ap.add_argument("--json", action="store_true", help="one JSON object per line")
    ap.add_argument(
        "--no-summaries", action="store_true", help="relays send each rank's vote and ack"
    )
    ap.add_argument(
        "--hand-down",
        action="store_true",
        help="--store: the scripted relays also check each Prepare and decision against the token "
        "and hand it to every rank's queue of the node, as a relay does",
    )
    ap.add_argument(
        "--voters-apart",
        action="store_true",
        help="--store: the scripted relays run in a process of their own, as relays run on hosts "
        "of their own, instead of taking turns with the coordinator for this process's GIL",
    )
    ap.add_argument(
        "--voter-threads",
        type=int,
        default=VOTER_THREADS,
        help="--store: threads of scripted relays, each for an equal share of the nodes",
    )
    ap.add_argument(
        "--silent-rank",
        type=int,
        default=None,
        help="--store: this rank never votes nor says it is alive (stopped before the Prepare): "
        "the row is the abort at the library's lease, and when every node has it",
    )
    args = ap.parse_args()
    if args.silent_rank is not None and not args.store:
        ap.error("--silent-rank needs --store")
    if args.store and args.per_node < 2:
        ap.error("--store scripts node relays: give --per-node 2 or more")
    if args.voter_threads < 1:
        ap.error("--voter-threads: give 1 or more")
    with tempfile.TemporaryDirectory() as tmp:
        for n in (int(x) for x in args.ranks.split(",")):
            if args.store:
                row = one_switch_store(
                    n, Path(tmp), args.per_node, not args.no_summaries, args.hand_down,
                    args.voters_apart, args.voter_threads, args.silent_rank,
                )  # fmt: skip
                if args.json:
                    print(json.dumps(row), flush=True)
                    continue
                if args.silent_rank is not None:
                    print(
                        f"{n:>6} ranks on {row['nodes']} nodes (store), rank {args.silent_rank} "
                        f"silent: request->abort {row['decision_ms']:7.1f} ms naming "
                        f"{row['named_ranks']}, -> every node has it {row['unblocked_ms']:7.1f} ms",
                        flush=True,
                    )
                    continue
                print(
                    f"{n:>6} ranks on {row['nodes']} nodes (store): request->decision "
                    f"{row['decision_ms']:7.1f} ms, -> every node has it "
                    f"{row['published_ms']:7.1f} ms, -> every ack counted {row['acked_ms']:7.1f}"
                    f" ms; CPU: coordinator {row['coordinator_cpu_ms']:6.1f} ms (pump "
                    f"{row['coordinator_threads_cpu_ms']['pump']:.1f}, main "
                    f"{row['coordinator_threads_cpu_ms']['main']:.1f}), scripted "
                    f"relays {row['voters_cpu_ms']:6.1f} ms; {row['rank0_messages']} messages "
                    "at rank 0",
                    flush=True,
                )
                print("\n".join(projection(row)), flush=True)
                continue
            row = one_switch(n, Path(tmp), args.per_node, not args.no_summaries)
            if args.json:
                print(json.dumps(row), flush=True)
            else:
                print(
                    f"{n:>6} ranks: request->decision {row['decision_ms']:9.1f} ms, "
                    f"acks {row['acks_ms']:8.1f} ms, CPU {row['cpu_ms']:9.1f} ms "
                    f"({row['cpu_us_per_rank']:.1f} us/rank, "
                    f"{row['cpu_us_per_node']:.0f} us/node)",
                    flush=True,
                )
    if args.store and not args.json:
        print(LEFT_OUT)


if __name__ == "__main__":
    main()
