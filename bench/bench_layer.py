"""TransformerLayer training step (forward, backward, AdamW) in FP8 vs BF16, one run, one GPU.

Every recipe (BF16 without autocast, dist-quant delayed and current scaling) runs in each variant
of the training loop:

- `eager`: the blocks called one after another;
- `ac`: every block under activation checkpointing (`torch.utils.checkpoint` for BF16,
  `dist_quant.activation_checkpoint` for FP8, non-reentrant);
- `compiled`: every block `torch.compile`'d (per block, as torchtitan does);
- `ac+compiled`: both (checkpointing compiled around dist-quant's checkpoint);
- `+caller` after any of them (`eager+caller`, `ac+compiled+caller`): the backward run by the
  calling thread (`torch.autograd.set_multithreading_enabled(False)`) instead of the autograd
  engine's CUDA device thread, for every recipe alike.

It prints the median GPU time of a step, the host time to issue one, and the ratio over BF16 run
in the same variant and over BF16 eager. The eager delayed step also reports the share spent in the
amax reduction + scale update (`dist_quant.amax.reduce_and_update`, CUDA events around each call).

    python bench/bench_layer.py [--hidden 4096] [--seq 4096] [--batch 2] [--layers 1]
        [--variants eager,ac,compiled,ac+compiled] [--recipes bf16,mxfp8,nvfp4,...]
"""

from __future__ import annotations

import argparse
import time

import torch
from bench_linear import cuda_median_ms
from torch.utils.checkpoint import checkpoint

import dist_quant as dq
import dist_quant.amax as amax_mod

VARIANTS = ("eager", "ac", "compiled", "ac+compiled")
CALLER = "+caller"
RECIPES = {
    "bf16": None,
    "fp8 delayed": dq.DelayedScaling(),
    "fp8 current": dq.Float8CurrentScaling(),
    "mxfp8": dq.MXFP8BlockScaling(),
    # emulated on Hopper: no FP4 tensor cores before Blackwell (docs/nvfp4.md)
    "nvfp4": dq.NVFP4BlockScaling(),
    "nvfp4 hp-fwd": dq.NVFP4BlockScaling(forward_override="high_precision"),
}
DEFAULT_RECIPES = "bf16,fp8 delayed,fp8 current"


class Blocks(torch.nn.Module):
    """`layers` TransformerLayers, each optionally compiled and/or checkpointed."""

    def __init__(self, hidden: int, heads: int, layers: int, variant: str, fp8: bool) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layers = torch.nn.ModuleList(
            dq.TransformerLayer(
                hidden, 4 * hidden, heads, params_dtype=torch.bfloat16, device="cuda", bias=False
            )
            for _ in range(layers)
        )
        self.blocks = [torch.compile(b) if "compiled" in variant else b for b in self.layers]
        self.recompute = "ac" in variant
        self.fp8 = fp8

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            if not self.recompute:
                x = block(x)
            elif self.fp8:
                x = dq.activation_checkpoint(block, x)
            else:
                x = checkpoint(block, x, use_reentrant=False)
        return x


def make_step(model, opt, x, recipe, *, backward_on_caller: bool):
    def step():
        opt.zero_grad(set_to_none=True)
        with dq.autocast(enabled=recipe is not None, recipe=recipe):
            y = model(x)
        with torch.autograd.set_multithreading_enabled(not backward_on_caller):
            y.float().square().mean().backward()
        opt.step()

    return step


def host_ms(step, steps: int = 10) -> float:
    """Median host time to issue one step (no sync between steps: the GPU runs behind)."""
    torch.cuda.synchronize()
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
    torch.cuda.synchronize()
    return sorted(times)[steps // 2] * 1e3


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


def reduction_share(step) -> float:
    with ReductionTimer() as timer:
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(5):
            step()
        end.record()
        torch.cuda.synchronize()
        return timer.total_ms() / start.elapsed_time(end)


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--hidden", type=int, default=4096)
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--seq", type=int, default=4096)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--layers", type=int, default=1)
    p.add_argument(
        "--variants",
        default="eager",
        help=f"comma list of {', '.join(VARIANTS)}, each optionally followed by {CALLER}",
    )
    p.add_argument(
        "--recipes",
        default=DEFAULT_RECIPES,
        help=f"comma list of {', '.join(RECIPES)} (bf16 is always run first, the baseline)",
    )
    args = p.parse_args()
    chosen = ["bf16"] + [r for r in args.recipes.split(",") if r != "bf16"]
    if any(r not in RECIPES for r in chosen):
        p.error(f"--recipes takes {', '.join(RECIPES)}")
    variants = args.variants.split(",")
    if any(v.removesuffix(CALLER) not in VARIANTS for v in variants):
        p.error(f"--variants takes {', '.join(VARIANTS)}, each optionally followed by {CALLER}")
    print(f"GPU: {torch.cuda.get_device_name()}  torch {torch.__version__}")
    print(f"hidden {args.hidden}, seq {args.seq}, batch {args.batch}, layers {args.layers}")
    print(f"{'variant':>12} | {'recipe':>12} | {'ms/step':>8} | {'host ms':>8} | "
          f"{'vs bf16':>7} | {'vs eager bf16':>13}")  # fmt: skip
    # (seq, batch, hidden): the layer's sbhd layout
    x = torch.randn(args.seq, args.batch, args.hidden, device="cuda", dtype=torch.bfloat16)
    eager_bf16 = None
    for variant in variants:
        torch._dynamo.reset()
        base = None
        for label in chosen:
            recipe = RECIPES[label]
            kind = variant.removesuffix(CALLER)
            model = Blocks(args.hidden, args.heads, args.layers, kind, recipe is not None)
            if recipe is not None:
                dq.apply_recipe(model, recipe)  # pinned: a compiled block needs no planning
            opt = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=True)
            step = make_step(model, opt, x, recipe, backward_on_caller=variant.endswith(CALLER))
            try:
                ms = cuda_median_ms(step, iters=10, warmup=3)
            except (
                Exception
            ) as e:  # a refused combination (RecomputeError), possibly wrapped by dynamo
                print(f"{variant:>12} | {label:>12} | {type(e).__name__}: {str(e)[:100]}")
                continue
            host = host_ms(step)
            if label == "bf16":
                base = ms
                eager_bf16 = ms if variant == "eager" else eager_bf16
            vs_eager = f"{eager_bf16 / ms:12.2f}x" if eager_bf16 else f"{'-':>13}"
            print(f"{variant:>12} | {label:>12} | {ms:8.2f} | {host:8.2f} | {base / ms:6.2f}x | "
                  f"{vs_eager}")  # fmt: skip
            if label == "fp8 delayed" and variant == "eager":
                share = reduction_share(step)
                print(f"{'':>12}   amax reduction + scale update: {100 * share:.2f}% of the step")
            del model, opt, step
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
