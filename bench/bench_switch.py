"""Cluster-wide switch costs on CPU: request -> committed latency, idle step_boundary overhead,
and plan + validate time per rank for a 32-layer model.

    python bench/bench_switch.py [--ranks 2,4,8] [--switches 6] [--layers 32]

Latency: N spawned ranks (gloo, TCPStore transport) train a small dist-quant MLP with a 5 ms step;
this process requests switches alternating delayed <-> current and times `request_switch` (request
sent -> decision logged and returned). Overhead: `step_boundary` with nothing pending, against an
empty method call, in one process. Plan: `plan_model` on a stack of TransformerLayers.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from dist_quant.coordinator import attach, request_switch, status
from dist_quant.coordinator.participant import Participant
from dist_quant.coordinator.transport_memory import MemoryTransport
from torch import nn

import dist_quant as dq

STEP_S = 0.005
RECIPES = (dq.Float8CurrentScaling(), dq.DelayedScaling(amax_history_len=16))


def _rank(rank: int, world: int, tmp: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"file://{tmp}/pg",
        rank=rank,
        world_size=world,
        timeout=timedelta(seconds=120),
    )
    torch.manual_seed(0)
    model = nn.Sequential(*[dq.Linear(64, 64, name=f"l{i}") for i in range(4)])
    dq.apply_recipe(model, RECIPES[1])
    participant = attach(model, run_dir=f"{tmp}/run")
    x = torch.randn(8, 64)
    step = 0
    while not os.path.exists(f"{tmp}/stop"):
        participant.step_boundary(step)
        with dq.autocast():
            model(x).sum().backward()
        time.sleep(STEP_S)
        step += 1
    dist.barrier()
    participant.close()


def latency(world: int, switches: int) -> dict[str, float]:
    with tempfile.TemporaryDirectory() as tmp:
        ctx = mp.start_processes(
            _rank, args=(world, tmp), nprocs=world, join=False, start_method="spawn"
        )
        try:
            run_dir = Path(tmp) / "run"
            while not (run_dir / "coordinator.json").exists():
                time.sleep(0.01)
            times, prepare, log = [], [], []
            for i in range(switches):
                t0 = time.perf_counter()
                result = request_switch(RECIPES[i % 2], run_dir=run_dir, timeout_s=30)
                times.append(time.perf_counter() - t0)
                if not result.committed:
                    raise RuntimeError(f"switch {result.switch_id} aborted: {result.reasons}")
                prepare.append(max(result.prepare_s.values()))
                log.append(result.timings["log_s"])
                while status(run_dir=run_dir)["phase"] != "published":
                    time.sleep(0.01)
        finally:
            Path(tmp, "stop").touch()
            ctx.join(60)
    return {
        "median_ms": 1e3 * statistics.median(times),
        "max_ms": 1e3 * max(times),
        "prepare_ms": 1e3 * statistics.median(prepare),
        "log_ms": 1e3 * statistics.median(log),
    }


class _Empty:
    def step_boundary(self, step: int) -> None:
        pass


def idle_overhead(calls: int = 200_000) -> tuple[float, float]:
    """(ns per idle step_boundary, ns per empty method call)."""
    participant = Participant(
        object(), rank=0, transport=MemoryTransport(), token="t", describe=lambda m: "none"
    ).start()
    try:
        out = []
        for target in (participant, _Empty()):
            fn = target.step_boundary
            best = float("inf")
            for _ in range(5):
                t0 = time.perf_counter_ns()
                for s in range(calls):
                    fn(s)
                best = min(best, (time.perf_counter_ns() - t0) / calls)
            out.append(best)
        return out[0], out[1]
    finally:
        participant.close()


def plan_time(layers: int) -> dict[str, float]:
    torch.manual_seed(0)
    model = nn.Sequential(
        *[dq.TransformerLayer(256, 1024, 8, name=f"layers.{i}") for i in range(layers)]
    )
    dq.apply_recipe(model, RECIPES[1])
    out = {}
    for recipe in RECIPES:
        best = float("inf")
        for _ in range(5):
            t0 = time.perf_counter()
            dq.plan_model(model, recipe)
            best = min(best, time.perf_counter() - t0)
        out[type(recipe).__name__] = 1e3 * best
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", default="2,4,8")
    parser.add_argument("--switches", type=int, default=6)
    parser.add_argument("--layers", type=int, default=32)
    args = parser.parse_args()

    print(f"CPU: {os.cpu_count()} cores, torch {torch.__version__}")
    print("\nrequest -> committed (TCPStore transport, 4-layer MLP per rank, 5 ms steps)")
    print(
        f"{'ranks':>5} | {'median ms':>9} | {'max ms':>7} | {'slowest prepare ms':>18} | "
        f"{'decision fsync ms':>17}"
    )
    for world in (int(w) for w in args.ranks.split(",")):
        r = latency(world, args.switches)
        print(
            f"{world:>5} | {r['median_ms']:9.1f} | {r['max_ms']:7.1f} | {r['prepare_ms']:18.2f} | "
            f"{r['log_ms']:17.1f}"
        )

    ns, empty_ns = idle_overhead()
    print(
        f"\nidle step_boundary: {ns:.0f} ns per call (empty method call: {empty_ns:.0f} ns); "
        f"{100 * ns * 1e-9 / 0.010:.4f}% of a 10 ms step"
    )

    plans = plan_time(args.layers)
    print(
        f"\nplan + validate, {args.layers} TransformerLayers (256 wide) on one rank, from delayed:"
    )
    for name, ms in plans.items():
        print(f"  -> {name:<22} {ms:7.1f} ms")


if __name__ == "__main__":
    main()
