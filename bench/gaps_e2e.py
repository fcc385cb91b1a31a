"""Where the GPU waits during a step of one `bench_e2e.py` variant: a CPU + CUDA trace of a few
steps after warm-up, the idle gaps between consecutive kernels, largest first, each with the CPU
ops running when it began and the kernel that ended it.

    python bench/gaps_e2e.py dq-layer-delayed [--model 8b] [--top 20] [--min-us 20]
"""

from __future__ import annotations

import argparse
import bisect
import json
import tempfile
from pathlib import Path

import torch
from bench_e2e import add_dims_arguments, dims_from, variant_step
from e2e_models import VARIANTS
from profile_e2e import short


def trace_events(name: str, args: argparse.Namespace) -> list[dict]:
    step = variant_step(name, dims_from(args), "cuda")
    for _ in range(4):
        step()
    torch.cuda.synchronize()
    activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=activities, with_stack=True) as prof:
        for _ in range(args.steps):
            step()
        torch.cuda.synchronize()
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "trace.json"
        prof.export_chrome_trace(str(path))
        return json.loads(path.read_text())["traceEvents"]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("variant", choices=sorted(VARIANTS))
    p.add_argument("--top", type=int, default=20)
    p.add_argument("--min-us", type=float, default=20.0)
    p.add_argument("--steps", type=int, default=2)
    add_dims_arguments(p)
    args = p.parse_args()
    events = [e for e in trace_events(args.variant, args) if e.get("ph") == "X"]
    kernels = sorted(
        (e for e in events if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")),
        key=lambda e: e["ts"],
    )
    cpu = sorted(
        (e for e in events if e.get("cat") in ("cpu_op", "python_function")),
        key=lambda e: e["ts"],
    )
    starts = [e["ts"] for e in cpu]
    gaps = []
    for before, after in zip(kernels, kernels[1:]):
        idle = after["ts"] - (before["ts"] + before["dur"])
        if idle >= args.min_us:
            gaps.append((idle, before["ts"] + before["dur"], after))
    busy = sum(k["dur"] for k in kernels)
    span = kernels[-1]["ts"] + kernels[-1]["dur"] - kernels[0]["ts"]
    total_gap = sum(g[0] for g in gaps)
    print(f"{args.variant}: {span / args.steps / 1e3:.2f} ms per step from first to last kernel, "
          f"{busy / args.steps / 1e3:.2f} ms of kernels, {total_gap / args.steps / 1e3:.2f} ms in "
          f"{len(gaps) // args.steps} gaps >= {args.min_us:g} us per step")  # fmt: skip
    for idle, at, after in sorted(gaps, key=lambda g: g[0], reverse=True)[: args.top]:
        hi = bisect.bisect_right(starts, at)
        running = [e for e in cpu[max(0, hi - 4000) : hi] if e["ts"] + e["dur"] >= at]
        running.sort(key=lambda e: e["dur"])  # innermost first
        names = [short(e["name"])[:70] for e in running[:6]]
        print(f"  {idle:8.0f} us before {short(after['name'])[:60]}")
        for n in names:
            print(f"             cpu: {n}")


if __name__ == "__main__":
    main()
