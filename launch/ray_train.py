"""dist-quant under Ray Train: `attach` inside a `TorchTrainer`'s `train_loop_per_worker`, and its
checkpoints through `ray.train.report` / `ray.train.get_checkpoint`.

    def train_loop_per_worker(config):
        model, opt = build(), torch.optim.AdamW(...)
        start = restore(model, opt)                 # 0, or the step of Ray Train's checkpoint
        if start == 0:
            dq.apply_recipe(model, initial_recipe)
        participant = attach(model, run_dir=run_dir())
        for step in range(start, steps):
            participant.step_boundary(step)
            ...
            if step % 10 == 0:
                report(participant, model, opt, step=step, metrics={"loss": loss.item()})
        participant.close()

Ray Train initialises the process group; `attach` then uses the Ray transport (the coordinator is
a named actor on rank 0's node). `run_dir()` is `<RunConfig storage path>/<experiment name>/
dist_quant` (the same for every restart of the run, so a restarted attempt appends to the same
decision log), or `$DIST_QUANT_RUN_DIR` when set. `report` saves the model, optimizer and job
state (`coordinator.job_state`, which never refuses over a pending switch) on rank 0 and reports
them with the metrics; `restore` loads the latest checkpoint into a freshly built model and
reconciles the decision log (`coordinator.restore_job_state`), so switches committed after that
checkpoint are re-applied at their steps.
"""

from __future__ import annotations

import os
import tempfile
import threading
from pathlib import Path
from typing import Any

from dist_quant.coordinator import job_state, restore_job_state
from dist_quant.launch.demo_runners import adopt_run_dir
from dist_quant.launch.demo_train import train_rank
from dist_quant.launch.errors import CliError
from torch import nn
from torch.optim import Optimizer

from dist_quant import checkpoint as ckpt

CHECKPOINT_FILE = "dist_quant.pt"


def _train():
    try:
        import ray.train
    except ImportError as e:
        raise RuntimeError(
            "dist-quant's Ray Train support needs Ray: pip install 'ray[train]'"
        ) from e
    return ray.train


def run_dir() -> Path:
    """The run directory of this Ray Train run (see the module docstring)."""
    if os.environ.get("DIST_QUANT_RUN_DIR"):
        return Path(os.environ["DIST_QUANT_RUN_DIR"])
    storage = _train().get_context().get_storage()
    where = Path(storage.experiment_fs_path)
    if not where.is_absolute():
        raise RuntimeError(
            f"the Ray Train run's storage {where} is not a local path; pass "
            "attach(..., run_dir=<a local directory on rank 0's node>)"
        )
    return where / "dist_quant"


def report(
    participant: Any,
    model: nn.Module,
    optimizer: Optimizer | None,
    *,
    step: int,
    metrics: dict[str, Any],
    extra: dict[str, Any] | None = None,
) -> None:
    """Checkpoint before `step` (the step a resumed run starts with) and report it with
    `metrics`; call on every rank (rank 0 writes the checkpoint)."""
    train = _train()
    rank = train.get_context().get_world_rank()
    with tempfile.TemporaryDirectory() as tmp:
        checkpoint = None
        if rank == 0:
            job = job_state(participant, step=step, run_dir=run_dir())
            ckpt.save(
                Path(tmp) / CHECKPOINT_FILE,
                model,
                optimizer,
                job=job,
                extra={**(extra or {}), "step": step},
            )
            checkpoint = train.Checkpoint.from_directory(tmp)
        train.report(metrics, checkpoint=checkpoint)


def restore(model: nn.Module, optimizer: Optimizer | None = None) -> dict[str, Any] | None:
    """Load Ray Train's latest checkpoint into a freshly built `model` (no recipe applied yet)
    and `optimizer`, and reconcile the decision log; returns the checkpoint's `extra` (with
    "step"), or None when the run starts fresh. Call before `attach`, on every rank."""
    checkpoint = _train().get_checkpoint()
    if checkpoint is None:
        return None
    with checkpoint.as_directory() as d:
        got = ckpt.load(Path(d) / CHECKPOINT_FILE, model, optimizer)
    if got["job"] is not None:
        restore_job_state(got["job"], run_dir=run_dir(), model=model)
    return got["extra"]


def _demo_worker(cfg: dict[str, Any]) -> None:
    train_rank(cfg)


class DemoRunner:
    """`dist-quant demo --launcher ray-train`: the demo's ranks as a `TorchTrainer`'s workers on
    a local Ray (or `$RAY_ADDRESS`), fitted in a background thread; `finished` / `stop` as the
    demo's other runners."""

    def __init__(self, cfg: dict[str, Any], out: Path) -> None:
        import ray
        from ray.train import RunConfig, ScalingConfig
        from ray.train.torch import TorchTrainer

        if not ray.is_initialized():
            ray.init(address=os.environ.get("RAY_ADDRESS"), log_to_driver=False)
        self._error: BaseException | None = None
        self._done = threading.Event()
        trainer = TorchTrainer(
            _demo_worker,
            train_loop_config=cfg,
            scaling_config=ScalingConfig(num_workers=cfg["nproc"], use_gpu=cfg["device"] == "cuda"),
            run_config=RunConfig(name="dist_quant_demo", storage_path=str(out / "ray_train")),
        )

        def fit() -> None:
            try:
                trainer.fit()
            except BaseException as e:  # noqa: BLE001 - reported by finished()
                self._error = e
            finally:
                self._done.set()

        self.out, self.cfg = out, cfg
        threading.Thread(target=fit, name="dist_quant.ray_train.fit", daemon=True).start()

    def started(self) -> None:
        adopt_run_dir(self.out, self.cfg)

    def finished(self) -> bool:

        if not self._done.is_set():
            return False
        if self._error is not None:
            first = str(self._error).strip().splitlines()[:3]
            raise CliError(f"demo job failed under Ray Train: {' '.join(first)}", 1)
        return True

    def stop(self) -> None:
        import ray

        if ray.is_initialized():
            ray.shutdown()
