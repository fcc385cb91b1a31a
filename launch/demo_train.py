"""One rank of the demo job: the training loop a user would write, plus a per-step log line.

Run by the torchrun launcher as `python -m dist_quant.launch.demo_train CONFIG.json` on every rank,
or by the Ray launcher as `train_rank(config)` inside each rank actor (the process group is then
already initialised). Ranks form `tp`-sized tensor-parallel groups of consecutive ranks; the rest
is data parallel. Each step:

    participant.step_boundary(step)       # publishes a committed switch at its step, else a flag check
    with autocast(amax_reduction_group=world):
        logits = model(tokens)
    loss.backward(); (data-parallel gradient all-reduce); optimizer.step()

and appends `{"step", "loss", "recipe", "t", "dt"}` (t: when the step ended, dt: how long it
took) to `<run_dir>/ranks/rank<r>.jsonl`.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from dist_quant.coordinator import attach
from dist_quant.launch.demo_data import MarkovTask
from dist_quant.launch.demo_guard import ActivationSpike, attach_options
from dist_quant.launch.demo_model import TinyGPT, parse_gpt_spec
from dist_quant.launch.demo_report import rank_log_path, short_key

from dist_quant import apply_recipe, autocast, current_recipe
from dist_quant.recipes import recipe_from_dict


def _groups(world: int, tp: int) -> tuple[Any, Any]:
    """(this rank's TP group, its DP group). Every rank creates every group, in the same order,
    as `new_group` requires."""
    rank = dist.get_rank()
    tp_group = dp_group = None
    for start in range(0, world, tp):
        g = dist.new_group(list(range(start, start + tp)))
        if start <= rank < start + tp:
            tp_group = g
    for offset in range(tp):
        g = dist.new_group(list(range(offset, world, tp)))
        if rank % tp == offset:
            dp_group = g
    return tp_group, dp_group


def train_rank(cfg: dict[str, Any]) -> dict[str, Any]:
    """Train on this rank; returns `{"rank", "recipe", "steps"}`. Needs an initialised default
    process group. `cfg` is the JSON written by `demo.py` (see `DemoOptions.rank_config`)."""
    rank, world, tp = dist.get_rank(), dist.get_world_size(), cfg["tp"]
    if world % tp:
        raise ValueError(f"demo: world size {world} is not a multiple of tp={tp}")
    device = torch.device(cfg["device"])
    if device.type == "cuda":
        device = torch.device("cuda", torch.cuda.current_device())
    tp_group, dp_group = _groups(world, tp)
    dp = world // tp
    spec = parse_gpt_spec(cfg["model"])
    task = MarkovTask(vocab=spec.vocab, seed=cfg["seed"])

    # The same seed on every rank: replicated weights (embeddings, norms, head) start equal, and
    # stay equal because every TP rank sees the same batch and the same full activations.
    torch.manual_seed(cfg["seed"])
    model = TinyGPT(spec, tp_group=tp_group if tp > 1 else None).to(device)
    apply_recipe(model, recipe_from_dict(cfg["first_recipe"]))
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg["lr"], betas=(0.9, 0.95))
    # Delayed-scaling amaxes are reduced over the whole job (TP x DP), so every rank quantizes
    # with the same scales and the DP replicas stay identical.
    participant = attach(
        model, tp_group=tp_group if tp > 1 else None, run_dir=cfg["run_dir"], **attach_options(cfg)
    )
    spike = ActivationSpike(model, cfg.get("spike_at"), spec.layers)

    log_path = rank_log_path(cfg["run_dir"], rank)
    log_path.parent.mkdir(parents=True, exist_ok=True)
    last_recipe, key = None, ""
    try:
        with open(log_path, "w", buffering=1) as log:
            for step in range(cfg["steps"]):
                started = time.time()
                participant.step_boundary(step)
                spike.step = step
                recipe = current_recipe(model)
                if recipe is not last_recipe:  # hash the key only when the recipe object changes
                    last_recipe, key = recipe, short_key(recipe)
                tokens, targets = task.batch(
                    step, batch_size=cfg["batch_size"], seq_len=spec.seq, data_rank=rank // tp
                )
                tokens, targets = tokens.to(device), targets.to(device)
                with autocast(amax_reduction_group=dist.group.WORLD):
                    logits = model(tokens)  # (batch, seq, vocab), full on every TP rank
                loss = F.cross_entropy(logits.float().reshape(-1, spec.vocab), targets.reshape(-1))
                optimizer.zero_grad(set_to_none=True)
                # on this thread, not the engine's CUDA worker (docs/performance.md)
                with torch.autograd.set_multithreading_enabled(False):
                    loss.backward()
                reported = loss.detach()
                if dp > 1:
                    for p in model.parameters():
                        if p.grad is not None:
                            dist.all_reduce(p.grad, group=dp_group)  # summed over replicas
                            p.grad /= dp  # -> the mean gradient
                    dist.all_reduce(reported, group=dp_group)
                    reported /= dp
                optimizer.step()
                participant.observe(step, loss=reported)  # telemetry and guard, when asked for
                loss_value = reported.item()  # waits for the step's kernels on a GPU
                ended = time.time()
                record = {
                    "step": step,
                    "loss": loss_value,
                    "recipe": key,
                    "t": ended,
                    "dt": ended - started,
                }
                log.write(json.dumps(record) + "\n")
                if cfg["step_delay"] > 0:
                    time.sleep(cfg["step_delay"])
        # Nobody stops the coordinator (rank 0) while a peer is still inside its last steps.
        dist.barrier()
    finally:
        participant.close()
    return {"rank": rank, "recipe": short_key(current_recipe(model)), "steps": cfg["steps"]}


def main(argv: list[str] | None = None) -> int:
    """torchrun entry: initialise the process group from torchrun's environment and train."""
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print("usage: python -m dist_quant.launch.demo_train CONFIG.json", file=sys.stderr)
        return 2
    cfg = json.loads(Path(args[0]).read_text())
    if cfg["device"] == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        backend = "nccl"
    else:
        backend = "gloo"
    dist.init_process_group(backend)
    try:
        train_rank(cfg)
    finally:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
