"""The `train_loop_per_worker` of test_ray_train.py (importable by Ray Train's workers).

Attempt 0 asks for a switch to current scaling at SWITCH, reports a checkpoint before CKPT
(< SWITCH: the switch is pending in it) and loses worker 1 at CRASH (> SWITCH); the attempt
Ray Train restarts resumes from that checkpoint. Each worker writes one line per step (loss bits,
recipe key) to `<run_dir>/steps.a<0|1>.r<rank>.jsonl`.
"""

import json
import os
import time

import torch
from dist_quant.coordinator import attach, request_switch
from dist_quant.launch.ray_train import report, restore, run_dir
from ray import train
from torch import nn

import dist_quant as dq
from dist_quant.runtime import recipe_key_of

STEPS, CKPT, SWITCH, CRASH = 16, 4, 7, 10


def train_loop_per_worker(config):
    rank = train.get_context().get_world_rank()
    torch.manual_seed(0)
    model = nn.Sequential(dq.Linear(16, 16), nn.Tanh(), dq.Linear(16, 8))
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    extra = restore(model, opt)
    start = 0 if extra is None else extra["step"]
    if extra is None:
        dq.apply_recipe(model, dq.recipe_from_dict("delayed"))
    participant = attach(model, run_dir=run_dir())
    attempt = "a0" if extra is None else "a1"
    out = open(run_dir() / f"steps.{attempt}.r{rank}.jsonl", "a")  # noqa: SIM115
    for step in range(start, STEPS):
        if rank == 0 and extra is None and step == 1:
            request_switch("current", at_step=SWITCH, run_dir=run_dir(), timeout_s=30)
        if extra is None and step == CRASH and rank == 1:
            # Ray Train's controller registers a reported checkpoint at its next poll of the
            # workers (every 2 s): die well after that, or the restart finds no checkpoint
            time.sleep(8)
            os._exit(1)  # the worker dies after the switch committed and published
        if step == CKPT:
            report(participant, model, opt, step=step, metrics={"step": step})
        participant.step_boundary(step)
        opt.zero_grad(set_to_none=True)
        x = torch.randn(8, 16, generator=torch.Generator().manual_seed(step))
        with dq.autocast():
            loss = model(x).square().mean()
        loss.backward()
        # both workers see the same batch: averaging identical gradients is exact
        for p in model.parameters():
            torch.distributed.all_reduce(p.grad)
            p.grad /= 2
        opt.step()
        rec = {"step": step, "loss": loss.item().hex(), "recipe": repr(recipe_key_of(model))}
        out.write(json.dumps(rec) + "\n")
        out.flush()
    out.close()
    participant.close()
