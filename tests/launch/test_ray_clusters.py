"""The Ray launcher with and without a running cluster: it joins one that `ray start` runs on
this machine (without the resource arguments Ray refuses there) and leaves it running, and starts
(and stops) a private instance when there is none.

Each test gives Ray a private temp dir (`RAY_TMPDIR`, short: Ray's socket paths must fit in 107
bytes), so a cluster of another process on this machine is neither joined nor disturbed. The
cluster started here runs in its own session and is killed by its process group in `finally`.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

pytestmark = [pytest.mark.ray, pytest.mark.distributed]

_JOB = """
import json, sys
from dist_quant.launch.ray import RayJob


def rank_and_world():
    import torch
    import torch.distributed as dist

    t = torch.ones(1)
    dist.all_reduce(t)
    return [dist.get_rank(), int(t.item())]


job = RayJob(2).start(rank_and_world)
try:
    print(json.dumps({"results": job.wait(timeout_s=120), "joined": job.joined}))
finally:
    job.shutdown()
"""


@pytest.fixture
def ray_env():
    pytest.importorskip("ray")
    tmp = tempfile.mkdtemp(prefix="dqray", dir="/tmp")
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env.update(RAY_TMPDIR=tmp, RAY_USAGE_STATS_ENABLED="0")
    yield env, Path(tmp)
    shutil.rmtree(tmp, ignore_errors=True)


def _run_job(env: dict, tmp: Path) -> dict:
    script = tmp / "job.py"
    script.write_text(_JOB)
    proc = subprocess.run(
        [sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=240
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_without_a_cluster_the_launcher_starts_its_own_ray(ray_env) -> None:
    env, tmp = ray_env
    out = _run_job(env, tmp)
    assert out == {"results": [[0, 2], [1, 2]], "joined": None}


def test_a_cluster_started_with_ray_start_is_joined_and_left_running(ray_env) -> None:
    env, tmp = ray_env
    ray_bin = Path(sys.executable).with_name("ray")
    head = subprocess.Popen(
        [
            str(ray_bin),
            "start",
            "--head",
            "--block",
            "--port",
            str(_free_port()),
            "--num-cpus",
            "2",
            "--include-dashboard",
            "false",
            "--disable-usage-stats",
        ],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,  # the cluster's processes share this group: killed together
    )
    try:
        address_file = tmp / "ray" / "ray_current_cluster"
        deadline = time.monotonic() + 90
        while not address_file.exists():
            assert head.poll() is None, "ray start exited"
            assert time.monotonic() < deadline, "ray start did not come up"
            time.sleep(0.2)
        out = _run_job(env, tmp)
        assert out == {"results": [[0, 2], [1, 2]], "joined": "auto"}
        assert head.poll() is None  # the job disconnected from the cluster, not stopped it
    finally:
        try:
            os.killpg(head.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        head.wait(30)
