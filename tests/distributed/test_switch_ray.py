"""The cluster-wide switch with the Ray transport: ranks are Ray actors (gloo over tcp://), the
coordinator is the named actor "dist_quant.coordinator" that rank 0 creates, and this test (the Ray
driver) is the client. Happy path, then the coordinator actor killed after the votes and before
its decision: every rank keeps the old recipe and trains on."""

import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

ray = pytest.importorskip("ray")

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "coordinator"))  # switch_harness

from dist_quant.coordinator import SwitchRequestError, fail_at, request_switch, status  # noqa: E402
from dist_quant.coordinator.transport_ray import ACTOR_NAME  # noqa: E402
from switch_harness import RayRank, read_endpoint_when_ready, wait_for  # noqa: E402

pytestmark = [pytest.mark.ray, pytest.mark.distributed]


@pytest.fixture(scope="module")
def ray_cluster():
    ray.init(
        num_cpus=4,
        include_dashboard=False,
        log_to_driver=False,
        runtime_env={"env_vars": {"PYTHONPATH": str(HERE.parent / "coordinator")}},
    )
    yield
    ray.shutdown()


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_ray_actors_switch_together_and_survive_a_killed_coordinator(ray_cluster, tmp_path):
    cfg = {
        "run_dir": str(tmp_path / "run"),
        "stop_file": str(tmp_path / "stop"),
        "tp_size": 2,
        "step_s": 0.005,
        "max_steps": 100_000,
        "transport": "auto",  # resolves to "ray" inside an initialised Ray worker
        "faults": (fail_at(phase="decide", action="delay", seconds=5.0, switch_id=2),),
        "decision_grace_s": 0.5,
    }
    actor_cls = ray.remote(num_cpus=1)(RayRank)
    ranks = [actor_cls.remote() for _ in range(2)]
    init = f"tcp://127.0.0.1:{free_port()}"
    futures = [a.run.remote(r, 2, init, cfg) for r, a in enumerate(ranks)]
    try:
        endpoint = read_endpoint_when_ready(Path(cfg["run_dir"]), timeout=120)
        assert endpoint["transport"] == "ray" and endpoint["address"].startswith("ray://")
        to_b = request_switch({"name": "B"}, run_dir=cfg["run_dir"], timeout_s=20)
        assert to_b.committed
        wait_for(lambda: status(run_dir=cfg["run_dir"])["phase"] == "published", 20, "acks")
        # the CLI in a shell without Ray's auth settings (this cluster has token auth on, Ray's
        # default) joins with the job's mode from coordinator.json
        assert endpoint.get("ray_auth_mode") == os.environ.get("RAY_AUTH_MODE")
        env = {k: v for k, v in os.environ.items() if k != "RAY_AUTH_MODE"}
        cli = [sys.executable, "-m", "dist_quant.launch.cli", "status", "--run-dir", cfg["run_dir"]]
        shown = subprocess.run(cli, env=env, capture_output=True, text=True, timeout=120)
        assert shown.returncode == 0, shown.stdout + shown.stderr
        assert "switch 1: published at step" in shown.stdout, shown.stdout

        errors = []

        def doomed():
            try:
                request_switch({"name": "C"}, run_dir=cfg["run_dir"], timeout_s=1.0)
            except SwitchRequestError as e:
                errors.append(e)

        t = threading.Thread(target=doomed)
        t.start()
        time.sleep(1.0)  # votes are in; the coordinator sits in its 5 s "decide" delay
        namespace = endpoint["address"].removeprefix("ray://")
        ray.kill(ray.get_actor(ACTOR_NAME, namespace=namespace))
        t.join(30)
        assert errors and "lost the coordinator" in str(errors[0])
        time.sleep(2.0)  # past every rank's give-up time (timeout 1 s + grace 0.5 s)
    finally:
        Path(cfg["stop_file"]).touch()
        results = ray.get(futures, timeout=120)
    logs = [r["recipes"] for r in results]
    assert logs[0] == logs[1]
    first_b = logs[0].index("B")
    assert first_b == to_b.step and set(logs[0][first_b:]) == {"B"}  # C never published
    assert [r["state"] for r in results] == ["gave_up", "gave_up"]
