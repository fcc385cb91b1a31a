"""The demo's model trained under a recipe schedule file against all-BF16, in one process.

Same weights, same data (the demo's Markov language), same optimizer; the schedule's phases are
applied with `apply_recipe` at their start steps (what the coordinator does cluster-wide, without
the processes). Prints the mean loss of the last `--tail` steps of each run and their difference.

    python bench/bench_nvfp4_schedule.py [--schedule examples/schedules/nvfp4_bf16_tail.yaml]
        [--model gpt:layers=4] [--steps 200] [--device cpu|cuda]
"""

from __future__ import annotations

import argparse
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
    p.add_argument("--model", default="gpt:layers=4")
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--tail", type=int, default=20)
    p.add_argument("--device", default="cpu")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    defaults = DemoOptions()
    spec = parse_gpt_spec(args.model)
    schedule = resolve_schedule(load_schedule_file(args.schedule), args.steps)
    bf16 = resolve_schedule([{"step": 0, "recipe": "bf16"}], args.steps)
    print(f"torch {torch.__version__}, device {args.device}, model {args.model}, {args.steps} "
          f"steps, batch {defaults.batch_size}, lr {defaults.lr}")  # fmt: skip
    results = {}
    for name, sched in (("all bf16", bf16), ("schedule", schedule)):
        t0 = time.perf_counter()
        losses = train(
            spec, sched.phases, args.steps, defaults.batch_size, defaults.lr, args.device,
            args.seed,
        )  # fmt: skip
        tail = sum(losses[-args.tail :]) / args.tail
        results[name] = tail
        phases = ", ".join(f"{ph.label}@{ph.start}" for ph in sched.phases)
        print(f"{name:>9}: last-{args.tail} mean loss {tail:.4f}  "
              f"({time.perf_counter() - t0:.0f} s; {phases})")  # fmt: skip
    print(f"schedule - bf16: {results['schedule'] - results['all bf16']:+.4f}")


if __name__ == "__main__":
    main()
