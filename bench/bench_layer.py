"""TransformerLayer training step (forward, backward, AdamW) in FP8 vs BF16, one run, one GPU.

Also reports the share of the FP8 step spent in the delayed-scaling amax reduction + scale update
(`dist_quant.amax.reduce_and_update`, timed with CUDA events around each call).

    python bench/bench_layer.py [--hidden 4096] [--seq 4096] [--batch 2] [--layers 1]
"""

from __future__ import annotations

import argparse

import torch
from bench_linear import cuda_median_ms

import dist_quant as dq
import dist_quant.amax as amax_mod


def build(hidden: int, heads: int, layers: int) -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        *[
            dq.TransformerLayer(
                hidden, 4 * hidden, heads, params_dtype=torch.bfloat16, device="cuda", bias=False
            )
            for _ in range(layers)
        ]
    )


def make_step(model, opt, x, recipe):
    def step():
        opt.zero_grad(set_to_none=True)
        with dq.autocast(enabled=recipe is not None, recipe=recipe):
            y = model(x)
        y.float().square().mean().backward()
        opt.step()

    return step


class ReductionTimer:
    """Wraps reduce_and_update with CUDA events to measure its share of the step."""

    def __init__(self) -> None:
        self.events: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []
        self.original = amax_mod.reduce_and_update

    def __enter__(self) -> ReductionTimer:
        def timed(*args, **kwargs):
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record()
            out = self.original(*args, **kwargs)
            e.record()
            self.events.append((s, e))
            return out

        amax_mod.reduce_and_update = timed
        return self

    def __exit__(self, *exc) -> None:
        amax_mod.reduce_and_update = self.original

    def total_ms(self) -> float:
        torch.cuda.synchronize()
        return sum(s.elapsed_time(e) for s, e in self.events)


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--hidden", type=int, default=4096)
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--seq", type=int, default=4096)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--layers", type=int, default=1)
    args = p.parse_args()
    print(f"GPU: {torch.cuda.get_device_name()}  torch {torch.__version__}")
    # (seq, batch, hidden): the layer's sbhd layout
    x = torch.randn(args.seq, args.batch, args.hidden, device="cuda", dtype=torch.bfloat16)
    results = {}
    for label, recipe in (
        ("bf16", None),
        ("fp8 delayed", dq.DelayedScaling()),
        ("fp8 current", dq.Float8CurrentScaling()),
    ):
        model = build(args.hidden, args.heads, args.layers)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=True)
        step = make_step(model, opt, x, recipe)
        results[label] = cuda_median_ms(step, iters=10, warmup=3)
        if label == "fp8 delayed":
            with ReductionTimer() as timer:
                n = 5
                torch.cuda.synchronize()
                start, end = (
                    torch.cuda.Event(enable_timing=True),
                    torch.cuda.Event(enable_timing=True),
                )
                start.record()
                for _ in range(n):
                    step()
                end.record()
                torch.cuda.synchronize()
                share = timer.total_ms() / start.elapsed_time(end)
            print(f"amax reduction + scale update: {100 * share:.2f}% of the delayed-scaling step")
        del model, opt
        torch.cuda.empty_cache()
    base = results["bf16"]
    print(
        f"{'recipe':>12} | {'ms/step':>8} | {'vs bf16':>7}   (hidden {args.hidden}, seq {args.seq}, batch {args.batch}, layers {args.layers})"
    )
    for label, ms in results.items():
        print(f"{label:>12} | {ms:8.2f} | {base / ms:6.2f}x")


if __name__ == "__main__":
    main()
