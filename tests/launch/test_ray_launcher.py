"""The Ray launcher: ranks as actors in a placement group, and nothing left behind on failure."""

from __future__ import annotations

import os
import sys
import time

import pytest

pytestmark = [pytest.mark.ray, pytest.mark.distributed]


@pytest.fixture(scope="module")
def ray_session():
    """One shared local Ray for this module; the launcher must clean up inside a cluster it does
    not own, which is the harder case (with its own instance it just stops Ray)."""
    import ray
    from ray import cloudpickle

    # The rank functions below live in this test module, which Ray workers cannot import.
    cloudpickle.register_pickle_by_value(sys.modules[__name__])
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, logging_level="WARNING")
    yield ray
    ray.shutdown()


def _report() -> dict:
    import torch
    import torch.distributed as dist

    t = torch.tensor([float(dist.get_rank() + 1)])
    dist.all_reduce(t)  # proves the process group spans every actor
    return {
        "rank": dist.get_rank(),
        "sum": t.item(),
        "backend": dist.get_backend(),
        "env": {
            k: os.environ.get(k)
            for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "DIST_QUANT_RUN_DIR")
        },
        "pid": os.getpid(),
    }


def _fail_on_rank_1(pid_dir: str) -> None:
    import torch
    import torch.distributed as dist

    rank = dist.get_rank()
    with open(os.path.join(pid_dir, f"pid{rank}"), "w") as f:
        f.write(str(os.getpid()))
    if rank == 1:
        time.sleep(0.5)
        raise ValueError("injected failure on rank 1\nsecond line")
    dist.all_reduce(torch.zeros(1))  # rank 0 waits in a collective rank 1 never joins


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:
        return f.read().split()[2] != "Z"


def test_ranks_run_in_order_with_the_process_group_and_env_set(ray_session, tmp_path) -> None:
    from dist_quant.launch.ray import launch

    results = launch(_report, 2, run_dir=tmp_path)
    assert [r["rank"] for r in results] == [0, 1]
    assert all(r["sum"] == 3.0 and r["backend"] == "gloo" for r in results)
    for rank, r in enumerate(results):
        assert r["env"]["RANK"] == str(rank) and r["env"]["WORLD_SIZE"] == "2"
        assert r["env"]["LOCAL_RANK"] == str(rank)  # one node
        assert r["env"]["DIST_QUANT_RUN_DIR"] == str(tmp_path.resolve())
    assert results[0]["env"]["MASTER_ADDR"] == results[1]["env"]["MASTER_ADDR"]
    assert ray_session.is_initialized()  # a cluster the launcher did not start stays up


def test_a_failing_rank_is_named_and_every_actor_and_the_placement_group_go(
    ray_session, tmp_path
) -> None:
    from dist_quant.launch.ray import RankFailedError, RayJob
    from ray.util import placement_group_table

    job = RayJob(2).start(_fail_on_rank_1, str(tmp_path))
    with pytest.raises(RankFailedError) as info:
        job.wait(timeout_s=300)
    # Rank 1 raised first; rank 0 only lost its collective partner afterwards.
    assert info.value.rank == 1
    assert str(info.value) == "rank 1 failed: ValueError: injected failure on rank 1"
    pids = [int((tmp_path / f"pid{r}").read_text()) for r in range(2)]
    deadline = time.monotonic() + 30
    while any(_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not any(_alive(p) for p in pids)
    assert {pg["state"] for pg in placement_group_table().values()} <= {"REMOVED"}
