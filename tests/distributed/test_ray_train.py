"""dist-quant inside Ray Train: a `TorchTrainer` of 2 CPU workers on a local Ray cluster, `attach`
in `train_loop_per_worker`, checkpoints through `dist_quant.launch.ray_train.report` / `restore`.

Attempt 0 asks for a switch to current scaling at step SWITCH, reports a checkpoint before step
CKPT (< SWITCH, so the switch is pending in it), and loses worker 1 at step CRASH (> SWITCH).
Ray Train's FailureConfig restarts both workers from that checkpoint: the switch must be
re-applied at SWITCH (losses bit-identical to attempt 0's for every step both ran) and the
decision log under the run's storage path must continue with attempt 2 of the same job.
"""

import json
import sys
from pathlib import Path

import pytest

ray = pytest.importorskip("ray")
pytest.importorskip("ray.train.torch", exc_type=ImportError)  # ray[train] is an extra

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from ray_train_job import CKPT, STEPS, SWITCH, train_loop_per_worker  # noqa: E402

# ~1-3 min on 2 busy cores (Ray Train starts its controller and workers twice)
pytestmark = [pytest.mark.ray, pytest.mark.distributed, pytest.mark.slow]


@pytest.fixture(scope="module")
def ray_cluster():
    ray.init(
        num_cpus=3,
        include_dashboard=False,
        log_to_driver=False,
        runtime_env={"env_vars": {"PYTHONPATH": str(HERE)}},  # ray_train_job for the workers
    )
    yield
    ray.shutdown()


def test_a_worker_lost_after_a_switch_restarts_on_the_switched_recipe(ray_cluster, tmp_path):
    from ray.train import FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    trainer = TorchTrainer(
        train_loop_per_worker,
        scaling_config=ScalingConfig(num_workers=2, use_gpu=False),
        run_config=RunConfig(
            name="exp", storage_path=str(tmp_path), failure_config=FailureConfig(max_failures=1)
        ),
    )
    trainer.fit()
    run_dir = tmp_path / "exp" / "dist_quant"

    def steps(attempt, rank):
        lines = (run_dir / f"steps.{attempt}.r{rank}.jsonl").read_text().splitlines()
        return {r["step"]: r for r in map(json.loads, lines)}

    for rank in (0, 1):
        first, resumed = steps("a0", rank), steps("a1", rank)
        assert min(resumed) == CKPT and max(resumed) == STEPS - 1
        assert max(first) >= SWITCH
        for step in set(first) & set(resumed):
            assert first[step] == resumed[step], (rank, step)  # loss bits and recipe
        assert "Delayed" in resumed[SWITCH - 1]["recipe"]
        assert all("Current" in resumed[s]["recipe"] for s in range(SWITCH, STEPS))
    records = [json.loads(x) for x in (run_dir / "decisions.jsonl").read_text().splitlines()]
    attempts = [(r["attempt"], r["resumed"]) for r in records if r["event"] == "attempt"]
    assert attempts == [(1, False), (2, True)]
    assert len({r["job_id"] for r in records if r["event"] == "attempt"}) == 1
    restored = next(r for r in records if r["event"] == "restored")
    assert restored["step"] == CKPT
    assert [(e["switch_id"], e["step"]) for e in restored["reapply"]] == [(1, SWITCH)]
    assert Path(run_dir / "coordinator.json").exists() is False  # removed at close
