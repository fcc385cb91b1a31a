"""Where a step of one `bench_e2e.py` variant spends its GPU time: the CUDA kernels of a few
profiled steps, by total time, after warm-up (torch.profiler). Run it for two variants to see
what one pays that the other does not.

    python bench/profile_e2e.py dq-layer-delayed dq-delayed-eager [--model 8b] [--top 25]
"""

from __future__ import annotations

import argparse

import torch
from bench_e2e import add_dims_arguments, dims_from, variant_step
from e2e_models import VARIANTS


def short(kernel: str) -> str:
    """A kernel's name without the namespaces that hide which functor an elementwise kernel runs."""
    for noise in ("void ", "at::native::", "(anonymous namespace)::", "c10::", "at::cuda::"):
        kernel = kernel.replace(noise, "")
    return kernel[:160]


def profile(name: str, args: argparse.Namespace) -> None:
    step = variant_step(name, dims_from(args), "cuda")
    for _ in range(4):
        step()
    torch.cuda.synchronize()
    activities = [torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=activities) as prof:
        for _ in range(args.steps):
            step()
        torch.cuda.synchronize()
    rows = [e for e in prof.key_averages() if e.self_device_time_total > 0]
    rows.sort(key=lambda e: e.self_device_time_total, reverse=True)
    total = sum(e.self_device_time_total for e in rows) / args.steps / 1e3
    print(f"\n{name}: {total:.2f} ms of kernels per step ({args.steps} steps profiled)")
    for e in rows[: args.top]:
        per_step = e.self_device_time_total / args.steps / 1e3
        print(f"  {per_step:7.3f} ms  x{e.count // args.steps:<4d} {short(e.key)}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("variants", nargs="+", choices=sorted(VARIANTS))
    p.add_argument("--top", type=int, default=25)
    p.add_argument("--steps", type=int, default=3)
    add_dims_arguments(p)
    args = p.parse_args()
    for name in args.variants:
        profile(name, args)


if __name__ == "__main__":
    main()
