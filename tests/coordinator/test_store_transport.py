"""The TCPStore transport and `attach` in one process (world size 1): loopback binding, queues,
the endpoint file, token refusal through a real store."""

import os
import socket
import stat
import threading
from collections import Counter
from datetime import timedelta

import pytest
import torch.distributed as dist
from dist_quant.coordinator import SwitchRequestError, attach, request_switch, status
from dist_quant.coordinator.attach import check_tp_groups
from dist_quant.coordinator.transport import TransportError
from dist_quant.coordinator.transport_store import StoreServer, StoreTransport, parse_address
from dist_quant.coordinator.transport_store_client import StoreClientTransport
from switch_harness import FAKE_HOOKS, FakeModel, wait_for


def outward_ip():
    """An address of this machine other than loopback, if it has one (no packet is sent)."""
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        s.connect(("10.255.255.255", 1))
        ip = s.getsockname()[0]
    except OSError:
        return None
    finally:
        s.close()
    return None if ip.startswith("127.") else ip


def test_server_listens_on_loopback_only():
    server = StoreServer()
    try:
        ip = outward_ip()
        if ip is None:
            pytest.skip("machine has no non-loopback address")
        with pytest.raises(OSError):
            socket.create_connection((ip, server.port), timeout=2).close()
        socket.create_connection(("127.0.0.1", server.port), timeout=2).close()
    finally:
        server.close()


def test_queues_are_fifo_across_connections_and_pop_times_out_with_none():
    server = StoreServer()
    try:
        a, b = StoreTransport(server.address), StoreTransport(server.address)
        for i in range(3):
            a.push("q", f"m{i}".encode())
        assert [b.pop("q", 1.0) for _ in range(3)] == [b"m0", b"m1", b"m2"]
        assert b.pop("q", 0.05) is None
        a.push("q", b"after a timeout")
        assert b.pop("q", 1.0) == b"after a timeout"
        threading.Timer(0.1, lambda: a.clone().push("w", b"late")).start()
        assert b.pop("w") == b"late"  # waits without a timeout
    finally:
        server.close()


def test_lost_server_raises_transport_error():
    server = StoreServer()
    t = StoreTransport(server.address)
    server.close()
    with pytest.raises(TransportError, match="coordinator store"):
        t.pop("q", 1.0)


def test_parse_address_rejects_garbage():
    assert parse_address("[::1]:80") == ("::1", 80)
    with pytest.raises(ValueError, match="host:port"):
        parse_address("localhost")


@pytest.fixture
def single_rank(tmp_path):
    dist.init_process_group(
        "gloo",
        init_method=f"file://{tmp_path / 'pg'}",
        rank=0,
        world_size=1,
        timeout=timedelta(seconds=30),
    )
    yield tmp_path / "run"
    dist.destroy_process_group()


def test_attach_writes_a_private_endpoint_and_switches_through_the_store(single_rank):
    run_dir = single_rank
    model = FakeModel(0)
    p = attach(model, run_dir=run_dir, transport="store", **FAKE_HOOKS)
    try:
        path = run_dir / "coordinator.json"
        assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
        assert p.address.startswith("127.0.0.1:")
        p.step_boundary(0)
        result = request_switch({"name": "B"}, run_dir=run_dir, timeout_s=5)
        assert result.committed and result.step == 1
        p.step_boundary(1)
        assert model.recipe == "B"
        wait_for(lambda: status(run_dir=run_dir)["phase"] == "published", 5, "published")
        assert status(run_dir=run_dir)["recipe_keys"] == {"0": "B"}
        with pytest.raises(SwitchRequestError, match="wrong token"):
            request_switch({"name": "C"}, address=p.address, token="0" * 64)
        assert (run_dir / "decisions.jsonl").exists()
    finally:
        p.close()
    assert not (run_dir / "coordinator.json").exists()
    with pytest.raises(SwitchRequestError, match="no coordinator found"):
        request_switch({"name": "C"}, run_dir=run_dir)


def test_idle_boundaries_make_no_store_call(single_rank, monkeypatch):
    """The listener holds one blocking pop; 1000 idle steps add no call from any thread."""
    counts = Counter()

    def counted(op, real):
        def wrapper(self, *a, **k):
            counts[(threading.current_thread().name, op)] += 1
            return real(self, *a, **k)

        return wrapper

    cls = StoreClientTransport  # how every rank connects (job_host.connect_endpoint)
    monkeypatch.setattr(cls, "push", counted("push", cls.push))
    monkeypatch.setattr(cls, "pop", counted("pop", cls.pop))
    p = attach(FakeModel(0), run_dir=single_rank, transport="store", **FAKE_HOOKS)
    try:
        wait_for(lambda: counts[("dist_quant.participant.r0", "pop")] == 1, 5, "listener")
        before = dict(counts)
        for step in range(1000):
            p.step_boundary(step)
        assert dict(counts) == before
    finally:
        p.close()


def test_attach_fails_on_every_rank_when_rank_0_cannot_use_the_run_dir(single_rank):
    blocker = single_rank.parent / "not-a-dir"
    blocker.write_text("x")
    with pytest.raises(RuntimeError, match="rank 0 could not start the coordinator"):
        attach(FakeModel(0), run_dir=blocker / "run", transport="store", **FAKE_HOOKS)


def test_attach_refuses_an_uninitialised_process_group():
    with pytest.raises(ValueError, match="not initialised"):
        attach(FakeModel(0))


@pytest.mark.parametrize("lease_s", [0.9, 0, -1.0, float("nan"), "2", True])
def test_attach_refuses_a_lease_shorter_than_two_beats_before_touching_the_job(
    single_rank, lease_s
):
    """A lease under two beats (a planning rank says it is alive every 0.5 s) would abort
    switches on live ranks: refused, naming the argument, and nothing is started (no
    coordinator.json in the run dir)."""
    run_dir = single_rank.parent / "run"
    with pytest.raises(ValueError, match=r"lease_s=.*must be a number of seconds >= 1 "):
        attach(FakeModel(0), run_dir=run_dir, transport="store", lease_s=lease_s, **FAKE_HOOKS)
    assert not (run_dir / "coordinator.json").exists()


@pytest.mark.parametrize(
    "claims,error",
    [
        ([[0, 1], [0, 1], [2, 3], [2, 3]], None),
        ([[0], [1]], None),
        ([[1], [1]], "rank 0's tp_group \\[1\\] does not contain it"),
        ([[0, 1], [1]], "rank 0 puts rank 1 in tp_group \\[0, 1\\], but rank 1 says"),
        ([[0, 5], [1]], "names rank 5, not in \\[0, 2\\)"),
    ],
)
def test_tp_group_claims_must_agree(claims, error):
    if error is None:
        groups = check_tp_groups(claims)
        assert sorted(r for g in groups for r in g) == list(range(len(claims)))
    else:
        with pytest.raises(ValueError, match=error):
            check_tp_groups(claims)


@pytest.mark.ray  # without Ray the CLI says it needs Ray, before any address
def test_a_client_of_a_ray_job_whose_cluster_is_gone_exits_2_naming_the_cluster(tmp_path):
    """coordinator.json of a Ray job whose cluster ended: the CLI gives up at once (nothing listens
    at the GCS address), exit code 2, instead of ray.init retrying for tens of seconds."""
    import json
    import socket
    import subprocess
    import sys

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        gone = f"127.0.0.1:{s.getsockname()[1]}"  # closed again: nothing listens there
    info = {"transport": "ray", "address": "ray://dist_quant-gone", "token": "t" * 64}
    (tmp_path / "coordinator.json").write_text(json.dumps({**info, "ray_address": gone}))
    cli = [sys.executable, "-m", "dist_quant.launch.cli", "switch", "current"]
    done = subprocess.run(
        [*cli, "--run-dir", str(tmp_path)], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 2, done.stdout + done.stderr
    assert f"the job's Ray cluster at {gone} cannot be reached" in done.stderr
