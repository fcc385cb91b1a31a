"""dist_quant.Linear forward+backward under each recipe vs torch.nn.Linear in BF16, one run, one GPU.

Prints, per shape, the median time of a training micro-step (forward, backward w.r.t. input and
weight) and the speed-up over BF16 measured in the same process, plus a profile of where the FP8 time
goes (quantize kernels vs GEMMs vs other) for the largest shape.

    python bench/bench_linear.py [--shapes 4096x4096x4096,8192x8192x8192] [--profile]
"""

from __future__ import annotations

import argparse
from collections import defaultdict

import torch

import dist_quant as dq

SHAPES = [(4096, 4096, 4096), (8192, 8192, 8192), (16384, 4096, 14336)]  # (M tokens, K in, N out)


def cuda_median_ms(fn, iters: int = 30, warmup: int = 8) -> float:
    """Median GPU time of one call, measured back to back as a training loop runs: events around
    each call, no host sync in between, so host work overlaps the previous call's GPU work; a call
    whose host side is slower than its GPU side still shows the GPU's idle time."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    events = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        events.append((start, end))
    torch.cuda.synchronize()
    times = sorted(s.elapsed_time(e) for s, e in events)
    return times[len(times) // 2]


def make_step(module, x, dy, recipe=None, *, backward_on_caller=False):
    """One fwd+bwd step; `backward_on_caller` runs the backward on the calling thread
    (`torch.autograd.set_multithreading_enabled(False)`), not the engine's CUDA device thread."""

    def step():
        x.grad = None
        module.weight.grad = None
        if recipe is None:
            y = module(x)
        else:
            with dq.autocast(recipe=recipe):
                y = module(x)
        with torch.autograd.set_multithreading_enabled(not backward_on_caller):
            y.backward(dy)

    return step


def assert_no_host_sync(recipes: dict) -> None:
    """One warmed-up FP8 step per recipe with torch's sync debug mode set to error: any
    synchronising call inside the step raises (the mode does not see every kind of sync)."""
    x = torch.randn(256, 256, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn(256, 256, device="cuda", dtype=torch.bfloat16)
    for label, recipe in recipes.items():
        lin = dq.Linear(256, 256, params_dtype=torch.bfloat16, device="cuda")
        step = make_step(lin, x, dy, recipe)
        step()
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            step()
        finally:
            torch.cuda.set_sync_debug_mode("default")
        print(f"{label}: no host sync inside the step")


def bench_shape(m: int, k: int, n: int, recipes: dict) -> dict[str, float]:
    torch.manual_seed(0)
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn(m, n, device="cuda", dtype=torch.bfloat16)
    ref = torch.nn.Linear(k, n, bias=False, device="cuda", dtype=torch.bfloat16)
    out = {"bf16 nn.Linear": cuda_median_ms(make_step(ref, x, dy))}
    for label, recipe in recipes.items():
        lin = dq.Linear(k, n, bias=False, params_dtype=torch.bfloat16, device="cuda")
        with torch.no_grad():
            lin.weight.copy_(ref.weight)
        out[label] = cuda_median_ms(make_step(lin, x, dy, recipe))
    return out


def cuda_profile(step, *, warmup: int, iters: int) -> torch.profiler.profile:
    """`iters` calls of `step` under the CUDA profiler, after `warmup` calls outside it."""
    for _ in range(warmup):
        step()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            step()
        torch.cuda.synchronize()
    return prof


def profile_shape(m: int, k: int, n: int, recipe) -> None:
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn(m, n, device="cuda", dtype=torch.bfloat16)
    lin = dq.Linear(k, n, bias=False, params_dtype=torch.bfloat16, device="cuda")
    prof = cuda_profile(make_step(lin, x, dy, recipe), warmup=5, iters=10)
    buckets: dict[str, float] = defaultdict(float)
    kernels: list[tuple[float, str]] = []
    for evt in prof.key_averages():
        t = evt.device_time_total / 10 / 1000  # ms per step
        if t <= 0:
            continue
        name = evt.key.lower()
        kernels.append((t, evt.key[:90]))
        if any(k in name for k in ("gemm", "scaled_mm", "cutlass", "sm90", "nvjet")):
            buckets["GEMM"] += t
        elif "kernel" in name and "at::native" not in name:
            buckets["quantize / update (triton)"] += t
        else:
            buckets["other"] += t
    print(f"\nwhere the time goes, {m}x{k}x{n}, {type(recipe).__name__} (ms/step):")
    for label, v in sorted(buckets.items(), key=lambda kv: -kv[1]):
        print(f"  {v:8.3f}  {label}")
    print("top kernels (ms/step):")
    for t, name in sorted(kernels, reverse=True)[:14]:
        print(f"  {t:8.3f}  {name}")


def cpu_profile(m: int, k: int, n: int, recipe) -> None:
    """Host-side cost of one FP8 step (Python + launches), where the GPU would otherwise idle."""
    import cProfile
    import pstats

    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn(m, n, device="cuda", dtype=torch.bfloat16)
    lin = dq.Linear(k, n, bias=False, params_dtype=torch.bfloat16, device="cuda")
    step = make_step(lin, x, dy, recipe)
    for _ in range(5):
        step()
    torch.cuda.synchronize()
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(20):
        step()
    prof.disable()
    torch.cuda.synchronize()
    print(f"\nhost profile, 20 steps, {m}x{k}x{n}, {type(recipe).__name__}:")
    pstats.Stats(prof).sort_stats("tottime").print_stats(22)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--shapes", default=",".join("x".join(map(str, s)) for s in SHAPES))
    parser.add_argument("--profile", action="store_true")
    parser.add_argument("--cpu-profile", action="store_true", help="cProfile the host side")
    args = parser.parse_args()
    recipes = {
        "fp8 delayed": dq.DelayedScaling(),
        "fp8 current": dq.Float8CurrentScaling(),
    }
    print(f"GPU: {torch.cuda.get_device_name()}  torch {torch.__version__}")
    assert_no_host_sync(recipes)
    print(f"{'shape MxKxN':>20} | {'recipe':>16} | {'ms':>8} | {'vs bf16':>7}")
    shapes = [tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",")]
    for m, k, n in shapes:
        res = bench_shape(m, k, n, recipes)
        base = res["bf16 nn.Linear"]
        for label, ms in res.items():
            print(f"{f'{m}x{k}x{n}':>20} | {label:>16} | {ms:8.3f} | {base / ms:6.2f}x")
    if args.profile:
        profile_shape(*shapes[-1], recipes["fp8 delayed"])
        profile_shape(*shapes[0], recipes["fp8 current"])
    if args.cpu_profile:
        cpu_profile(*shapes[0], recipes["fp8 delayed"])


if __name__ == "__main__":
    main()
