"""The demo's model trained under a recipe schedule file against a baseline (all-BF16 unless
`--baseline` names another schedule file), in one process.

Same weights, same data (the demo's Markov language), same optimizer; the schedules' phases are
applied with `apply_recipe` at their start steps (what the coordinator does cluster-wide, without
the processes). Prints, per seed, the mean loss of the last `--tail` steps of each run and their
difference, held against its noise: both runs see the same batches, so the difference is taken
step by step over the tail, and a difference within noise is within twice its standard error
(the spread of the per-step differences over sqrt(tail)). With several `--seeds` (each its own
Markov task and initialization), the mean difference too.

    python bench/bench_schedule_loss.py [--schedule examples/schedules/nvfp4_bf16_tail.yaml]
        [--baseline FILE] [--model gpt:layers=4] [--steps 200] [--seeds 0,1,2] [--device cpu|cuda]
    python bench/bench_schedule_loss.py --schedule examples/schedules/fp8_attention.yaml \
        --baseline examples/schedules/fp8_linears.yaml --seeds 0,1,2     # FP8 vs BF16 attention
"""

from __future__ import annotations

import argparse
import math
import statistics
import time

import torch
import torch.nn.functional as F
from dist_quant.launch.demo import DemoOptions
from dist_quant.launch.demo_data import MarkovTask
from dist_quant.launch.demo_model import TinyGPT, parse_gpt_spec
from dist_quant.launch.demo_schedule import load_schedule_file, resolve_schedule

import dist_quant as dq


def train(spec, phases, steps: int, batch: int, lr: float, device: str, seed: int) -> list:
    task = MarkovTask(vocab=spec.vocab, seed=seed)
    torch.manual_seed(seed)
    model = TinyGPT(spec).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.95))
    starts = {p.start: dq.recipe_from_dict(p.recipe) for p in phases}
    losses = []
    for step in range(steps):
        if step in starts:
            dq.apply_recipe(model, starts[step])
        tokens, targets = (
            t.to(device) for t in task.batch(step, batch_size=batch, seq_len=spec.seq)
        )
        with dq.autocast():
            logits = model(tokens)
        loss = F.cross_entropy(logits.float().reshape(-1, spec.vocab), targets.reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--schedule", default="examples/schedules/nvfp4_bf16_tail.yaml")
    p.add_argument("--baseline", default=None, help="a schedule file (default: all BF16)")
    p.add_argument("--model", default="gpt:layers=4")
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--tail", type=int, default=20)
    p.add_argument("--device", default="cpu")
    p.add_argument("--seeds", default="0", help="comma-separated; each runs both schedules")
    args = p.parse_args()
    seeds = [int(s) for s in args.seeds.split(",")]
    defaults = DemoOptions()
    spec = parse_gpt_spec(args.model)
    schedule = resolve_schedule(load_schedule_file(args.schedule), args.steps)
    baseline = resolve_schedule(
        load_schedule_file(args.baseline) if args.baseline else [{"step": 0, "recipe": "bf16"}],
        args.steps,
    )
    print(f"torch {torch.__version__}, device {args.device}, model {args.model}, {args.steps} "
          f"steps, batch {defaults.batch_size}, lr {defaults.lr}, seeds {seeds}")  # fmt: skip
    tails: dict[str, list[float]] = {"baseline": [], "schedule": []}
    tail_losses: dict[str, list[float]] = {}
    for seed in seeds:
        for name, sched in (("baseline", baseline), ("schedule", schedule)):
            t0 = time.perf_counter()
            losses = train(
                spec, sched.phases, args.steps, defaults.batch_size, defaults.lr, args.device,
                seed,
            )  # fmt: skip
            tail_losses[name] = losses[-args.tail :]
            tails[name].append(statistics.mean(tail_losses[name]))
            phases = ", ".join(f"{ph.label}@{ph.start}" for ph in sched.phases)
            print(f"seed {seed} {name:>9}: last-{args.tail} mean loss {tails[name][-1]:.4f}  "
                  f"({time.perf_counter() - t0:.0f} s; {phases})")  # fmt: skip
        steps = [
            s - b for s, b in zip(tail_losses["schedule"], tail_losses["baseline"], strict=True)
        ]
        diff, error = statistics.mean(steps), statistics.stdev(steps) / math.sqrt(len(steps))
        verdict = "within" if abs(diff) <= 2 * error else "outside"
        print(f"seed {seed} schedule - baseline: {diff:+.4f} ({verdict} noise: standard error "
              f"{error:.4f} of the per-step differences)")  # fmt: skip
    if len(seeds) > 1:
        diffs = [s - b for s, b in zip(tails["schedule"], tails["baseline"], strict=True)]
        print(f"mean schedule - baseline over {len(seeds)} seeds: {statistics.mean(diffs):+.4f} "
              f"(per seed {', '.join(f'{d:+.4f}' for d in diffs)})")  # fmt: skip


if __name__ == "__main__":
    main()
