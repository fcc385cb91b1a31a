"""Host (Python) time per training step of tiny dist-quant modules, where compute is negligible.

Times one step (`autocast` region, forward, backward) of a `Linear` and of a `TransformerLayer` with
shapes so small that the time is the runtime's Python work: autocast off, the identity recipe
(`bf16`), delayed and current scaling, each measured in the same process, side by side. The
identity recipe should cost what autocast off costs (no per-forward planning); the FP8 rows show
what one quantized step costs the host beyond the casts themselves.

    python bench/bench_host.py [--steps 300] [--repeats 5] [--device cpu] [--profile current]
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import time
from collections.abc import Callable

import torch
from torch import nn

import dist_quant as dq

RECIPES: dict[str, Callable[[], dq.Recipe | None]] = {
    "off": lambda: None,
    "bf16": lambda: dq.recipe_from_dict("bf16"),
    "delayed": lambda: dq.DelayedScaling(amax_history_len=16),
    "current": lambda: dq.Float8CurrentScaling(),
}


def build(kind: str, device: str) -> tuple[nn.Module, torch.Tensor]:
    """A module and an input of 16 tokens (32 hidden), small enough that kernels cost ~nothing."""
    if kind == "linear":
        return dq.Linear(32, 32, device=device), torch.randn(16, 32, device=device)
    layer = dq.TransformerLayer(32, 64, 2, device=device)
    return layer, torch.randn(8, 2, 32, device=device)  # (seq, batch, hidden)


def make_step(module: nn.Module, x: torch.Tensor, recipe: dq.Recipe | None) -> Callable[[], None]:
    enabled = recipe is not None
    if enabled:
        dq.apply_recipe(module, recipe)
    params = list(module.parameters())

    def step() -> None:
        for p in params:
            p.grad = None
        with dq.autocast(enabled=enabled):
            y = module(x)
        y.sum().backward()

    return step


def host_us_per_step(step: Callable[[], None], steps: int, repeats: int, device: str) -> float:
    """The fastest of `repeats` runs of `steps` back-to-back steps, as microseconds per step. CPU:
    this process's CPU time (on a shared machine, wall time mostly measures the neighbours; the
    fastest run is the one they disturbed least); CUDA: wall time up to a final synchronize."""
    for _ in range(20):
        step()
    if device == "cuda":
        torch.cuda.synchronize()
    clock = time.perf_counter if device == "cuda" else time.process_time
    times = []
    for _ in range(repeats):
        start = clock()
        for _ in range(steps):
            step()
        if device == "cuda":
            torch.cuda.synchronize()
        times.append((clock() - start) / steps * 1e6)
    return min(times)


def calls_per_step(step: Callable[[], None], steps: int) -> tuple[float, float]:
    """(all Python-level calls, calls into dist_quant's own files outside kernels/) per step, from
    cProfile: a count, so unlike times it does not move with the machine's load."""
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(steps):
        step()
    profiler.disable()
    total = ours = 0
    for (filename, _, _), (_, ncalls, *_rest) in pstats.Stats(profiler).stats.items():
        total += ncalls
        if "/dist_quant/" in filename and "/kernels/" not in filename:
            ours += ncalls
    return total / steps, ours / steps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--modules", default="linear,layer")
    parser.add_argument(
        "--profile", default=None, choices=list(RECIPES), help="cProfile this recipe's steps"
    )
    args = parser.parse_args()
    torch.manual_seed(0)
    torch.set_num_threads(1)  # tiny shapes: intra-op threads only add CPU time
    print(f"host time per step (us), {args.device}, best of {args.repeats} x {args.steps} steps")
    print(f"{'module':<8}" + "".join(f"{name:>10}" for name in RECIPES) + f"{'bf16/off':>10}")
    counts = {}
    for kind in args.modules.split(","):
        row = {}
        for name, make_recipe in RECIPES.items():
            module, x = build(kind, args.device)
            step = make_step(module, x, make_recipe())
            row[name] = host_us_per_step(step, args.steps, args.repeats, args.device)
            counts[kind, name] = calls_per_step(step, 20)
            if args.profile == name:
                profiler = cProfile.Profile()
                profiler.enable()
                for _ in range(args.steps):
                    step()
                profiler.disable()
                print(f"--- cProfile: {kind}, {name}, {args.steps} steps")
                pstats.Stats(profiler).sort_stats("tottime").print_stats(25)
        ratio = row["bf16"] / row["off"]
        print(f"{kind:<8}" + "".join(f"{row[n]:>10.1f}" for n in RECIPES) + f"{ratio:>10.3f}")
    print("Python calls per step: all / in dist_quant outside kernels/ (a count, load-independent)")
    for kind in args.modules.split(","):
        cells = "".join(f"{f'{t:.0f}/{o:.0f}':>12}" for t, o in (counts[kind, n] for n in RECIPES))
        print(f"{kind:<8}{cells}")


if __name__ == "__main__":
    main()
