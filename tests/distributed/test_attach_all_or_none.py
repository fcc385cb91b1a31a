"""attach on real ranks (gloo, the store transport) where one rank's second connection to the
coordinator fails: every rank raises attach's same one-line error, together, and no rank is left
in a collective (no raw TransportError on one rank, no gloo "Connection closed by peer" on the
others)."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "coordinator"))  # switch_harness

from harness import run_ranks  # noqa: E402

pytestmark = pytest.mark.distributed


def attach_with_a_refused_clone(rank: int, world: int, run_dir: str, bad_rank: int):
    import importlib

    from dist_quant.coordinator import attach
    from dist_quant.coordinator.transport import TransportError
    from switch_harness import FAKE_HOOKS, FakeModel

    attach_module = importlib.import_module("dist_quant.coordinator.attach")
    if rank == bad_rank:
        real = attach_module.connect_endpoint

        def connect(endpoint, **kwargs):
            transport = real(endpoint, **kwargs)

            def refuse():
                raise TransportError("injected: the second connection was refused")

            transport.clone = refuse
            return transport

        attach_module.connect_endpoint = connect
    try:
        participant = attach(FakeModel(rank), run_dir=run_dir, transport="store", **FAKE_HOOKS)
    except Exception as e:  # noqa: BLE001 - the outcome is what the test compares
        return type(e).__name__, str(e), Path(run_dir, "coordinator.json").exists()
    participant.close()
    return "attached", "", None


@pytest.mark.parametrize("bad_rank", [0, 2])
def test_a_failed_second_connection_on_one_rank_fails_every_rank_with_one_message(
    tmp_path, bad_rank
):
    world = 3
    results = run_ranks(
        attach_with_a_refused_clone, world, str(tmp_path / "run"), bad_rank, timeout_s=90
    )
    kinds = {kind for kind, _, _ in results}
    messages = {message for _, message, _ in results}
    assert kinds == {"TransportError"}, results
    assert len(messages) == 1, results
    (message,) = messages
    assert message.startswith(f"attach: rank {bad_rank} (at ")
    assert "cannot reach the coordinator at 127.0.0.1:" in message
    assert "(injected: the second connection was refused)" in message
    assert results[0][2] is False  # rank 0 removed its endpoint before raising
