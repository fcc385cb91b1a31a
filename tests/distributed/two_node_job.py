"""A torchrun training script for the two-node tests (test_two_nodes.py): the README's loop.

`python -m torch.distributed.run ... two_node_job.py CONFIG.json`. A small dq MLP under DDP on
gloo, default `attach(model)` (run dir from $DIST_QUANT_RUN_DIR), one step every `step_s`.
Each rank writes its pid to `<run_dir>/pid.rank<r>` once attached, and at the end
`<run_dir>/rank<r>.json`: the recipe key per step and the participant's final state. Training
stops when `stop_file` exists, from the step written in it on (agreed by an all-reduce, so
both ranks stop at one step). A rank
whose peer died (its collective raised) keeps stepping alone until the stop file, as a survivor
does while the launcher decides what to do, so the test can watch its switch abort.

CONFIG: stop_file, step_s, max_steps, plan_delay_rank (that rank's planning sleeps 60 s, so the
test can kill it while it votes), exit_at (`[rank, phase]`: that rank's process exits there, e.g.
a node leader at "vote" or at "relay"), host (attach's `host=`). An attach that fails writes its
error to `<run_dir>/attach_error.rank<r>`.
"""

import json
import os
import sys
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from dist_quant.coordinator import attach, fail_at
from dist_quant.coordinator.transport import TransportError
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import dist_quant as dq
from dist_quant.runtime import recipe_key_of


def _publish(path: Path, text: str) -> None:
    """Write then rename: the test polls for the file and must never read it half-written."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def _stop_now(stop_file: str, step: int) -> bool:
    """The stop file exists and this step is at or past the step written in it (empty: any)."""
    try:
        text = Path(stop_file).read_text().strip()
    except FileNotFoundError:
        return False
    return step >= int(text or 0)


def main() -> None:
    cfg = json.loads(Path(sys.argv[1]).read_text())
    dist.init_process_group("gloo", timeout=timedelta(seconds=30))
    rank = dist.get_rank()
    run_dir = Path(os.environ["DIST_QUANT_RUN_DIR"])
    run_dir.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(0)
    model = nn.Sequential(dq.Linear(16, 32, name="fc1"), nn.GELU(), dq.Linear(32, 16, name="fc2"))
    dq.apply_recipe(model, dq.recipe_from_dict("delayed"))
    faults = ()
    if cfg.get("plan_delay_rank") is not None:
        faults = (
            fail_at(rank=cfg["plan_delay_rank"], phase="prepare", action="delay", seconds=60),
        )
    if cfg.get("exit_at") is not None:
        who, phase = cfg["exit_at"]
        faults = (*faults, fail_at(rank=who, phase=phase, action="exit"))
    try:
        participant = attach(model, faults=faults, decision_grace_s=0.5, host=cfg.get("host"))
    except TransportError as e:
        (run_dir / f"attach_error.rank{rank}").write_text(f"{type(e).__name__}: {e}")
        raise
    _publish(run_dir / f"pid.rank{rank}", str(os.getpid()))
    ddp, opt = DDP(model), torch.optim.AdamW(model.parameters(), lr=1e-3)
    keys: list[str] = []
    peer_lost_at = None
    for step in range(cfg["max_steps"]):
        participant.step_boundary(step)
        keys.append(repr(recipe_key_of(model)))
        x = torch.randn(8, 16)
        stop = _stop_now(cfg["stop_file"], step)
        if peer_lost_at is None:
            try:
                with dq.autocast():
                    loss = ddp(x).pow(2).mean()
                opt.zero_grad()
                loss.backward()
                opt.step()
                flag = torch.tensor([float(stop)])
                dist.all_reduce(flag, op=dist.ReduceOp.MAX)
                stop = bool(flag.item())
            except RuntimeError:  # the peer is gone (gloo: connection closed)
                peer_lost_at = step
        else:
            with dq.autocast():
                model(x).pow(2).mean().backward()
        if stop:
            break
        time.sleep(cfg["step_s"])
    result = {"keys": keys, "state": participant.state, "peer_lost_at": peer_lost_at}
    _publish(run_dir / f"rank{rank}.json", json.dumps(result))
    participant.close()
    if peer_lost_at is None:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
