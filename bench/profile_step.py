"""Where the host time of one eager dq Linear step goes (GPU): kernels per step, host us per step,
cProfile's top entries. Diagnostic, prints only.

    python bench/profile_step.py [--shape 4096x4096x4096] [--top 30] [--prepared-ab]
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import time

import torch
from bench_linear import make_step
from dist_quant.kernels import cast, current

import dist_quant as dq


def host_us(step, n=30):
    step()
    torch.cuda.synchronize()
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
    torch.cuda.synchronize()
    return sorted(times)[n // 2] * 1e6


def kernels_per_step(step):
    from torch.profiler import ProfilerActivity, profile

    step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    # (kernel name, GPU us) in launch order
    return [(e.name, e.device_time) for e in prof.events() if e.device_type.name == "CUDA"]


def print_compact(stats: pstats.Stats, sort: str, top: int, steps: int) -> None:
    """One line per function: us per step (own, cumulative), calls per step, short name."""
    rows = []
    for (path, line, func), (_, ncalls, tottime, cumtime, _) in stats.stats.items():
        short = f"{'/'.join(path.split('/')[-2:])}:{line}({func})"
        rows.append((tottime, cumtime, ncalls, short[-70:]))
    key = 0 if sort == "tottime" else 1
    print(f"{'own us':>8} {'cum us':>8} {'calls':>6}  (per step)")
    for tottime, cumtime, ncalls, name in sorted(rows, key=lambda r: -r[key])[:top]:
        print(
            f"{tottime / steps * 1e6:8.1f} {cumtime / steps * 1e6:8.1f} {ncalls / steps:6.1f}  {name}"
        )


class _NeverStored(dict):
    """A plan table that keeps nothing: every cast takes the full, validated launch path."""

    def __setitem__(self, key, value) -> None:
        pass


def prepared_against_full(step, rounds: int = 5) -> str:
    """Host us per step and Python calls per step of `step` with the casts' prepared launches
    (the default) against the full launch path, alternating in this process (the host's speed
    drifts between runs, not between neighbouring rounds)."""
    tables = ((cast, "_delayed_plans"), (current, "_current_plans"))
    kept = [getattr(module, name) for module, name in tables]

    def use(prepared: bool) -> None:
        for (module, name), plans in zip(tables, kept):
            setattr(module, name, plans if prepared else _NeverStored())

    times = {True: [], False: []}
    calls = {}
    try:
        for _ in range(rounds):
            for prepared in (True, False):
                use(prepared)
                times[prepared].append(host_us(step, n=50))
        for prepared in (True, False):
            use(prepared)
            pr = cProfile.Profile()
            pr.enable()
            for _ in range(10):
                step()
            pr.disable()
            calls[prepared] = sum(v[1] for v in pstats.Stats(pr).stats.values()) / 10
    finally:
        use(True)
    return "; ".join(
        f"{'prepared' if p else 'full path'}: host us/step min {min(times[p]):.0f} median "
        f"{sorted(times[p])[rounds // 2]:.0f}, {calls[p]:.0f} Python calls/step"
        for p in (True, False)
    )


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--shape", default="4096x4096x4096")
    p.add_argument("--top", type=int, default=25)
    p.add_argument("--recipes", default="off,bf16,delayed,current")
    p.add_argument("--graphed", action="store_true", help="dq.make_graphed_callables the Linear")
    p.add_argument("--sort", default="tottime", help="cProfile sort key (tottime, cumulative)")
    p.add_argument("--kernel-times", action="store_true", help="each kernel's GPU time")
    p.add_argument("--no-cprofile", action="store_true", help="skip the cProfile table")
    p.add_argument(
        "--prepared-ab",
        action="store_true",
        help="FP8 recipes: prepared cast launches against the full launch path, same process",
    )
    a = p.parse_args()
    m, k, n = (int(v) for v in a.shape.split("x"))
    torch.manual_seed(0)
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn(m, n, device="cuda", dtype=torch.bfloat16)
    recipes = {
        "off": None,
        "bf16": dq.recipe_from_dict("bf16"),
        "delayed": dq.DelayedScaling(),
        "current": dq.Float8CurrentScaling(),
    }
    summary = []
    for label in a.recipes.split(","):
        recipe = recipes[label]
        lin = dq.Linear(k, n, bias=False, params_dtype=torch.bfloat16, device="cuda")
        if recipe is not None:
            dq.apply_recipe(lin, recipe)
            if a.graphed:
                lin = dq.make_graphed_callables(lin, (x,))
        step = make_step(lin, x, dy, recipe)
        for _ in range(3):
            step()
        torch.cuda.synchronize()
        h = host_us(step)
        ks = kernels_per_step(step)
        gpu = sum(us for _, us in ks)
        summary.append(
            f"{a.shape} {label}: host {h:.0f} us/step, {len(ks)} kernels, {gpu:.0f} us of kernels"
        )
        if a.kernel_times:
            for name, us in ks:
                print(f"  {us:8.1f} us  {name[:90]}")
        print("==", summary[-1])
        if a.prepared_ab and recipe is not None:
            summary.append(f"{a.shape} {label}: {prepared_against_full(step)}")
            print("==", summary[-1])
        if a.no_cprofile:
            continue
        pr = cProfile.Profile()
        pr.enable()
        for _ in range(20):
            step()
        pr.disable()
        torch.cuda.synchronize()
        print_compact(pstats.Stats(pr), a.sort, a.top, steps=20)
    print("\n".join(summary))


if __name__ == "__main__":
    main()
