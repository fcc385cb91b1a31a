"""The training script of test_elastic_restart.py, run by `torchrun --max-restarts 1`.

Two ranks train a plain dq.Linear / LayerNormMLP model under DDP (the MHA boundary-role bug of a
freshly built TransformerLayer is another issue's), starting on delayed scaling. Attempt 0: rank 0
checkpoints before step CKPT (job_state included), asks for switch 1 to current scaling at
SWITCH_1 (> CKPT), and once that is published asks for switch 2; rank 1 dies while planning its
vote on switch 2, so torchrun restarts both. Attempt 1 resumes from the checkpoint in the same run
dir (`restore_job_state`, then `attach`), checkpoints before LATE_CKPT while switch 3 is committed
for a later step, and trains to STEPS. Without ELASTIC_CRASH=1 the same schedule runs uninterrupted
(no switch 2). Every step's loss (as float.hex) and recipe key go to
`<run_dir>/steps.a<attempt>.r<rank>.jsonl`, flushed per step so a crash keeps them.
"""

import faulthandler
import json
import os
import threading
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from dist_quant.coordinator import (
    attach,
    fail_at,
    job_state,
    request_switch,
    restore_job_state,
)
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import dist_quant as dq
from dist_quant import checkpoint as ckpt
from dist_quant.runtime import recipe_key_of

WIDTH, STEPS, CKPT, SWITCH_1, LATE_CKPT, SWITCH_3 = 16, 30, 10, 14, 24, 26
# An attempt's ranks live under 10 s on two cores (~50 s with the machine shared four ways). A
# rank stuck past this writes every thread's stack to <run_dir>/stacks.a<attempt>.r<rank>.txt and
# exits, so that torchrun fails the job and the test reports where it stuck, not a blind timeout.
WATCHDOG_S = 150
CURRENT = {"type": "Float8CurrentScaling"}


def build() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(dq.Linear(WIDTH, WIDTH), nn.Tanh(), dq.LayerNormMLP(WIDTH, 2 * WIDTH))


def batch(step: int) -> torch.Tensor:
    return torch.randn(8, WIDTH, generator=torch.Generator().manual_seed(1000 + step))


def main() -> None:
    attempt = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
    run_dir = Path(os.environ["DIST_QUANT_RUN_DIR"])
    # a raw descriptor, not a file object: interpreter shutdown would close that one, and a rank
    # stuck while shutting down would then die without a word
    stacks = os.open(
        run_dir / f"stacks.a{attempt}.r{os.environ['RANK']}.txt", os.O_WRONLY | os.O_CREAT
    )
    faulthandler.dump_traceback_later(WATCHDOG_S, exit=True, file=stacks)
    # torchrun's agent store outlives an attempt; gloo's rendezvous keys of the dead attempt make
    # the restarted ranks' connect flaky, so each attempt rendezvouses under its own prefix.
    store = dist.TCPStore(
        os.environ["MASTER_ADDR"],
        int(os.environ["MASTER_PORT"]),
        is_master=False,
        timeout=timedelta(seconds=30),
    )
    dist.init_process_group(
        "gloo",
        store=dist.PrefixStore(f"dist_quant_test/attempt{attempt}", store),
        rank=int(os.environ["RANK"]),
        world_size=int(os.environ["WORLD_SIZE"]),
        timeout=timedelta(seconds=30),
    )
    rank = dist.get_rank()
    model = build()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    start = 0
    if attempt == 0:
        dq.apply_recipe(model, dq.recipe_from_dict("delayed"))
    else:
        got = ckpt.load(run_dir / f"ckpt{CKPT}.pt", model, opt)
        start = got["extra"]["step"]
        restore_job_state(got["job"], run_dir=run_dir, model=model)
    crash = os.environ.get("ELASTIC_CRASH") == "1"  # else: the uninterrupted run to compare with
    faults = ()
    if crash and attempt == 0:
        faults = (fail_at(rank=1, phase="prepare", action="exit", switch_id=2),)
    participant = attach(model, faults=faults, decision_grace_s=0.5)
    ddp = DDP(model)
    out = open(run_dir / f"steps.a{attempt}.r{rank}.jsonl", "a")  # noqa: SIM115
    for step in range(start, STEPS):
        if rank == 0:
            if step == CKPT or (step == LATE_CKPT and (attempt == 1 or not crash)):
                job = job_state(participant, step=step, run_dir=run_dir)
                ckpt.save(run_dir / f"ckpt{step}.pt", model, opt, job=job, extra={"step": step})
            if attempt == 0 and step == 2:
                request_switch(CURRENT, at_step=SWITCH_1, run_dir=run_dir, timeout_s=20)
            if crash and attempt == 0 and step == SWITCH_1 + 3:  # switch 1 published: ask for 2
                threading.Thread(
                    target=request_switch,
                    args=("delayed",),
                    kwargs={"run_dir": run_dir, "timeout_s": 60},
                    daemon=True,
                ).start()
            if (attempt == 1 or not crash) and step == LATE_CKPT - 2:
                request_switch("delayed", at_step=SWITCH_3, run_dir=run_dir, timeout_s=20)
        participant.step_boundary(step)
        opt.zero_grad(set_to_none=True)
        with dq.autocast():
            loss = ddp(batch(step)).square().mean()
        loss.backward()
        opt.step()
        key = repr(recipe_key_of(model))
        out.write(json.dumps({"step": step, "loss": loss.item().hex(), "recipe": key}) + "\n")
        out.flush()
    out.close()
    if rank == 0:
        ckpt.save(run_dir / "final.pt", model, opt, extra={"step": STEPS})
    participant.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
