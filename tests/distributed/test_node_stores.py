"""`attach` on real ranks (gloo, the store transport) spread over simulated hosts (each rank tells
attach its host, `switch_harness.fake_host`; all share this machine's loopback): the leader of
the host without rank 0 serves its node's queues from a store of its own, so rank 0's store holds
one connection for that whole node, and a switch still commits on every rank at one step. A rank
that cannot reach its leader's store fails every rank with attach's one message."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "coordinator"))  # switch_harness

from dist_quant.coordinator import request_switch, status  # noqa: E402
from harness import run_ranks  # noqa: E402
from switch_harness import Background, read_endpoint_when_ready, train_worker, wait_for  # noqa: E402

pytestmark = pytest.mark.distributed


def connections(port):
    """Established TCP connections whose local end is `port`: the server's side of each."""
    count = 0
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] == "01" and int(fields[1].rsplit(":", 1)[1], 16) == port:
                count += 1
    return count


# Ranks 0-1 on host a (rank 0's), 2-5 on host b. Rank 0's store: ranks 0 and 1, the relay of
# host a (two connections), rank 2's relay (one), the coordinator's and the server's own; 12 if
# every rank of host b connected there (each, and rank 2's relay with two).
HOSTS = ["a", "a", "b", "b", "b", "b"]
RANK0_CONNECTIONS = 2 + 2 + 1 + 1 + 1


def test_ranks_behind_their_leaders_store_switch_with_one_connection_per_node_at_rank_0(tmp_path):
    run_dir = tmp_path / "run"
    cfg = {"run_dir": str(run_dir), "stop_file": str(tmp_path / "stop"), "tp_size": 2,
           "step_s": 0.01, "max_steps": 100_000, "collectives": True, "hosts": HOSTS,
           "host": "127.0.0.1"}  # fmt: skip
    job = Background(run_ranks, train_worker, len(HOSTS), cfg, timeout_s=120)
    try:
        port = int(read_endpoint_when_ready(run_dir)["address"].rsplit(":", 1)[1])
        wait_for(lambda: status(run_dir=run_dir)["recipe_keys"].keys() == set(map(str, range(6))),
                 60, "every rank's hello, through the relays")  # fmt: skip
        assert connections(port) == RANK0_CONNECTIONS
        result = request_switch({"name": "B"}, run_dir=run_dir, timeout_s=30)
        assert result.committed, result
        wait_for(lambda: status(run_dir=run_dir)["phase"] == "published", 30, "every ack")
        assert connections(port) == RANK0_CONNECTIONS
    finally:
        Path(cfg["stop_file"]).touch()
    results = job.result(120)
    recipes = [r["recipes"] for r in results]
    n = min(map(len, recipes))
    assert all(r[:n] == recipes[0][:n] for r in recipes)  # no step ran with two recipes
    assert recipes[0].index("B") == result.step
    assert [r["state"] for r in results] == ["idle"] * len(HOSTS)


def attach_with_a_node_store_out_of_reach(rank, world, run_dir, bad_rank):
    import importlib

    from dist_quant.coordinator import attach
    from dist_quant.coordinator.transport import TransportError
    from switch_harness import FAKE_HOOKS, FakeModel, fake_host

    fake_host(HOSTS[rank])
    if rank == bad_rank:  # it connects only to its leader's store at attach

        def refuse(endpoint, **kwargs):
            raise TransportError(f"injected: {endpoint['address']} refused")

        importlib.import_module("dist_quant.coordinator.attach").connect_endpoint = refuse
    try:
        participant = attach(
            FakeModel(rank), run_dir=run_dir, transport="store", host="127.0.0.1", **FAKE_HOOKS
        )
    except Exception as e:  # noqa: BLE001 - the outcome is what the test compares
        return type(e).__name__, str(e), Path(run_dir, "coordinator.json").exists()
    participant.close()
    return "attached", "", None


def test_a_rank_that_cannot_reach_its_leaders_store_fails_every_rank_with_one_message(tmp_path):
    results = run_ranks(
        attach_with_a_node_store_out_of_reach, len(HOSTS), str(tmp_path / "run"), 3, timeout_s=90
    )
    assert {kind for kind, _, _ in results} == {"TransportError"}, results
    messages = {message for _, message, _ in results}
    assert len(messages) == 1, results
    (message,) = messages
    assert message.startswith("attach: rank 3 cannot reach its node leader rank 2's store at "), (
        message
    )
    assert "127.0.0.1:" in message and "within 5 s (injected: 127.0.0.1:" in message, message
    assert results[0][2] is False  # rank 0 removed its endpoint before raising
