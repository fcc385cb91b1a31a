"""Where a step of one `bench_e2e.py` variant spends its GPU time: the CUDA kernels of a few
profiled steps, by total time, after warm-up (torch.profiler). Run it for two variants to see
what one pays that the other does not.

    python bench/profile_e2e.py dq-layer-delayed dq-delayed-eager [--model 8b] [--top 25]
"""

from __future__ import annotations

import argparse

import torch
from bench_e2e import dims_from
from e2e_models import MODELS, VARIANTS, build


def short(kernel: str) -> str:
    """A kernel's name without the namespaces that hide which functor an elementwise kernel runs."""
    for noise in ("void ", "at::native::", "(anonymous namespace)::", "c10::", "at::cuda::"):
        kernel = kernel.replace(noise, "")
    return kernel[:160]


def profile(name: str, args: argparse.Namespace) -> None:
    d = dims_from(args)
    built = build(name, d, "cuda")
    g = torch.Generator(device="cpu").manual_seed(1)
    shape = (d.seq, d.batch, d.dim) if built.sbhd else (d.batch, d.seq, d.dim)
    x = torch.randn(shape, generator=g).to("cuda", torch.bfloat16).requires_grad_(True)
    dy = torch.randn(shape, generator=g).to("cuda", torch.bfloat16)
    caller = not VARIANTS[name].compiled

    def step() -> None:
        x.grad = None
        for p in built.model.parameters():
            p.grad = None
        with built.context():
            y = built.model(x)
        with torch.autograd.set_multithreading_enabled(not caller):
            y.backward(dy)

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
    p.add_argument("--model", choices=sorted(MODELS), default="8b")
    p.add_argument("--top", type=int, default=25)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--tiny", action="store_true")
    p.add_argument("--dims")
    p.add_argument("--layers", type=int)
    p.add_argument("--seq", type=int)
    p.add_argument("--batch", type=int)
    args = p.parse_args()
    for name in args.variants:
        profile(name, args)


if __name__ == "__main__":
    main()
