"""Cost of FP8 telemetry (`dist_quant.telemetry`): stats every step (N=1), every 100 steps, off.

For a Linear and a TransformerLayer training step (forward, backward, optimizer) under delayed
and current scaling, runs the same steps with `stats_interval` 0, 1 and 100 side by side and
prints ms/step (wall time over a run of steps, synchronised once at the end, so host work and the
stats steps' device-to-host copy are included), the ratio to `off`, and the host time per step
(Python issuing the step, without waiting for the GPU). A one-rank process group is initialised
(NCCL) so the stats step's all-gather runs as in a job; `--no-dist` skips it.

    python bench/bench_stats.py [--steps 200] [--hidden 4096] [--tokens 8192] [--no-dist]
"""

from __future__ import annotations

import argparse
import os
import time

import torch
import torch.distributed as dist

import dist_quant as dq
from dist_quant.telemetry import Telemetry

INTERVALS = (0, 1, 100)


def linear(hidden: int) -> torch.nn.Module:
    return dq.Linear(hidden, hidden, params_dtype=torch.bfloat16, device="cuda", name="fc")


def layer(hidden: int) -> torch.nn.Module:
    return dq.TransformerLayer(
        hidden, 4 * hidden, hidden // 128, params_dtype=torch.bfloat16, device="cuda", bias=False
    )


def run(model, x, recipe, interval: int, steps: int, run_dir: str) -> tuple[float, float]:
    """(wall ms/step, host ms/step) over `steps` steps after a warm-up."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    telemetry = Telemetry(model, stats_interval=interval, run_dir=run_dir)

    def step(i: int) -> None:
        telemetry.begin_step(i)
        opt.zero_grad(set_to_none=True)
        with dq.autocast(recipe=recipe):
            y = model(x)
        y.float().square().mean().backward()
        opt.step()
        telemetry.end_step()

    for i in range(10):
        step(i)
    torch.cuda.synchronize()
    host = 0.0
    start = time.perf_counter()
    for i in range(steps):
        t0 = time.perf_counter()
        step(i)
        host += time.perf_counter() - t0
    torch.cuda.synchronize()
    wall = time.perf_counter() - start
    telemetry.close()
    return 1e3 * wall / steps, 1e3 * host / steps


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--hidden", type=int, default=4096)
    p.add_argument("--tokens", type=int, default=8192)
    p.add_argument("--no-dist", action="store_true")
    p.add_argument("--run-dir", default="/tmp/dist_quant_bench_stats")
    args = p.parse_args()
    if not args.no_dist and not dist.is_initialized():
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", "29517")
        dist.init_process_group("nccl", rank=0, world_size=1)
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, {args.steps} steps")
    print(f"{'model':<18} {'recipe':<8} {'stats':>6} {'ms/step':>9} {'vs off':>7} {'host ms':>8}")
    for model_name, build, x_shape in (
        ("Linear", linear, (args.tokens, args.hidden)),
        ("TransformerLayer", layer, (args.tokens // 2, 2, args.hidden)),  # (seq, batch, hidden)
    ):
        for recipe_name, recipe in (
            ("delayed", dq.DelayedScaling()),
            ("current", dq.Float8CurrentScaling()),
        ):
            torch.manual_seed(0)
            model = build(args.hidden)
            x = torch.randn(*x_shape, device="cuda", dtype=torch.bfloat16, requires_grad=True)
            base = None
            for interval in INTERVALS:
                ms, host = run(model, x, recipe, interval, args.steps, args.run_dir)
                base = ms if base is None else base
                label = "off" if interval == 0 else f"N={interval}"
                print(
                    f"{model_name:<18} {recipe_name:<8} {label:>6} {ms:>9.3f} "
                    f"{ms / base:>6.3f}x {host:>8.3f}"
                )
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
