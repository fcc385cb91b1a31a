"""The cluster-wide switch over the torchrun (TCPStore) transport, with real rank processes.

Ranks train a fake model (the fake planner stands in for `plan_model`; see switch_harness.py)
and meet in a TP all-reduce and a world all-reduce every step, as a TP x DP job does. This test
process is the client: it requests switches through `<run_dir>/coordinator.json` while the ranks
train, as `dist-quant switch` does. Every rank logs its active recipe per step; the logs must be
identical across ranks (no step ever runs with two recipes) and change only at committed steps.
"""

import json
import sys
import threading
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "coordinator"))  # switch_harness

from dist_quant.coordinator import (  # noqa: E402
    SwitchBusyError,
    SwitchRequestError,
    fail_at,
    request_switch,
    status,
    switch_requests,
)
from harness import RankFailure, run_ranks  # noqa: E402
from switch_harness import (  # noqa: E402
    Background,
    read_endpoint_when_ready,
    train_worker,
    wait_for,
)

pytestmark = pytest.mark.distributed


def config(tmp_path, **overrides):
    cfg = {
        "run_dir": str(tmp_path / "run"),
        "stop_file": str(tmp_path / "stop"),
        "tp_size": 2,
        "step_s": 0.005,
        "max_steps": 100_000,
        "collectives": True,
        "faults": (),
        "decision_grace_s": 0.5,
    }
    cfg.update(overrides)
    return cfg


def stop(cfg):
    Path(cfg["stop_file"]).touch()


def wait_published(run_dir, timeout=20.0):
    wait_for(lambda: status(run_dir=run_dir)["phase"] == "published", timeout, "every rank's ack")


def changes(recipes):
    """[(step, recipe)] where the active recipe changed, starting with step 0."""
    return [(i, r) for i, r in enumerate(recipes) if i == 0 or recipes[i - 1] != r]


def test_four_ranks_tp2_dp2_switch_together_and_every_fault_leaves_the_old_recipe(tmp_path):
    cfg = config(tmp_path)
    run_dir = Path(cfg["run_dir"])
    job = Background(run_ranks, train_worker, 4, cfg, timeout_s=150)
    try:
        read_endpoint_when_ready(run_dir)
        to_b = request_switch({"name": "B"}, run_dir=run_dir, timeout_s=20)
        assert to_b.committed, to_b
        assert sorted(to_b.prepare_s) == [0, 1, 2, 3]
        wait_published(run_dir)

        factory_fails = request_switch({"name": "X", "fail_rank": 3}, run_dir=run_dir, timeout_s=20)
        assert not factory_fails.committed
        assert list(factory_fails.reasons) == [3]
        assert "factory raised for role layers.0.fc1 on rank 3" in factory_fails.reasons[3]

        roles_differ = request_switch(
            {"name": "X", "odd_digest_rank": 2}, run_dir=run_dir, timeout_s=20
        )
        assert not roles_differ.committed
        assert sorted(roles_differ.reasons) == [2, 3]  # a TP group of two has no majority
        assert "TP group [2, 3]" in roles_differ.reasons[2]

        malformed = request_switch("no-such-recipe", run_dir=run_dir, timeout_s=20)
        assert not malformed.committed and sorted(malformed.reasons) == [0, 1, 2, 3]
        assert "malformed recipe 'no-such-recipe'" in malformed.reasons[0]

        late = request_switch(
            {"name": "X", "sleep_rank": 2, "sleep_s": 1.5}, run_dir=run_dir, timeout_s=0.5
        )
        assert not late.committed
        assert late.reasons == {2: "no vote before the deadline (0.5 s)"}

        past = request_switch({"name": "X"}, at_step=0, run_dir=run_dir, timeout_s=20)
        assert not past.committed and sorted(past.reasons) == [0, 1, 2, 3]
        assert "already passed step" in past.reasons[0]

        with pytest.raises(SwitchRequestError, match="wrong token"):
            request_switch({"name": "X"}, address=endpoint_address(run_dir), token="f" * 64)

        # Two clients at once: the slow one (rank 0 plans for 0.5 s) holds the switch open.
        slow: list = []
        t = threading.Thread(
            target=lambda: slow.append(
                request_switch(
                    {"name": "D", "sleep_rank": 0, "sleep_s": 0.5}, run_dir=run_dir, timeout_s=20
                )
            )
        )
        t.start()
        wait_for(lambda: status(run_dir=run_dir)["open_switch"] is not None, 10, "open switch")
        open_id = status(run_dir=run_dir)["open_switch"]
        with pytest.raises(SwitchBusyError) as busy:
            request_switch({"name": "X"}, run_dir=run_dir, timeout_s=20)
        assert busy.value.open_switch_id == open_id
        t.join(30)
        to_d = slow[0]
        assert to_d.committed and to_d.switch_id == open_id
        wait_published(run_dir)

        to_e = request_switch({"name": "E"}, at_step=to_d.step + 150, run_dir=run_dir, timeout_s=20)
        assert to_e.committed and to_e.step == to_d.step + 150
        wait_published(run_dir, timeout=60)
        final = status(run_dir=run_dir)
        assert final["recipe_keys"] == {str(r): "E" for r in range(4)}
    finally:
        stop(cfg)
        results = job.result(timeout=160)

    logs = [r["recipes"] for r in results]
    assert all(log == logs[0] for log in logs), "two recipes ran at the same step"
    assert changes(logs[0]) == [(0, "A"), (to_b.step, "B"), (to_d.step, "D"), (to_e.step, "E")]
    decisions = [
        json.loads(line) for line in (run_dir / "decisions.jsonl").read_text().splitlines()
    ]
    committed = [d["switch_id"] for d in decisions if d["event"] == "decision" and d["commit"]]
    assert committed == [to_b.switch_id, to_d.switch_id, to_e.switch_id]


def endpoint_address(run_dir):
    return json.loads((Path(run_dir) / "coordinator.json").read_text())["address"]


def test_coordinator_killed_after_prepare_leaves_every_rank_on_the_old_recipe(
    tmp_path, monkeypatch
):
    cfg = config(tmp_path, faults=(fail_at(phase="decide", action="stop"),))
    monkeypatch.setattr(switch_requests, "RESULT_SLACK_S", 1.0)
    job = Background(run_ranks, train_worker, 2, cfg, timeout_s=60)
    try:
        read_endpoint_when_ready(Path(cfg["run_dir"]))
        with pytest.raises(SwitchRequestError, match="no result for switch 1"):
            request_switch({"name": "B"}, run_dir=cfg["run_dir"], timeout_s=0.5)
        time.sleep(0.5)  # ranks gave up 0.5 s ago (timeout 0.5 s + grace 0.5 s): train on
    finally:
        stop(cfg)
        results = job.result(timeout=70)
    for r in results:
        assert set(r["recipes"]) == {"A"}  # nobody published
        assert r["states"].count("gave_up") >= 3  # steps trained after giving up
        assert r["state"] == "gave_up"


def test_rank_killed_during_prepare_aborts_and_the_survivor_trains_on(tmp_path):
    cfg = config(
        tmp_path, collectives=False, faults=(fail_at(rank=1, phase="prepare", action="exit"),)
    )
    job = Background(run_ranks, train_worker, 2, cfg, timeout_s=60)
    try:
        read_endpoint_when_ready(Path(cfg["run_dir"]))
        result = request_switch({"name": "B"}, run_dir=cfg["run_dir"], timeout_s=0.5)
        assert not result.committed
        assert result.reasons == {1: "no vote before the deadline (0.5 s)"}
    finally:
        stop(cfg)
        with pytest.raises(RankFailure) as failure:
            job.result(timeout=70)
    assert "rank 1 failed" in str(failure.value) and "exited with code 17" in str(failure.value)
    assert "rank 0 failed" not in str(failure.value)
    # Written once rank 0 finished training (its close() may still be draining when the harness
    # gives up on the job because rank 1 died).
    survivor = json.loads((Path(cfg["run_dir"]) / "rank0.json").read_text())
    assert set(survivor["recipes"]) == {"A"} and survivor["state"] == "idle"


def test_rank_killed_at_the_commit_barrier_never_acks_and_the_switch_stays_open(tmp_path):
    """Rank 1 dies at step S before publishing. Rank 0 published (it cannot know); the switch
    stays open (no ack from rank 1), so no further switch starts; torchrun would now restart the
    job. No step runs with two recipes: rank 1 runs no step at all after S."""
    cfg = config(
        tmp_path, collectives=False, faults=(fail_at(rank=1, phase="commit", action="exit"),)
    )
    job = Background(run_ranks, train_worker, 2, cfg, timeout_s=60)
    try:
        read_endpoint_when_ready(Path(cfg["run_dir"]))
        result = request_switch({"name": "B"}, run_dir=cfg["run_dir"], timeout_s=10)
        assert result.committed
        # Rank 0's ack (it reports its new recipe) arrives once it published at S.
        wait_for(
            lambda: status(run_dir=cfg["run_dir"])["recipe_keys"].get("0") == "B", 30, "rank 0"
        )
        state = status(run_dir=cfg["run_dir"])
        assert state["phase"] == "committed" and state["open_switch"] == result.switch_id
        with pytest.raises(SwitchBusyError):
            request_switch({"name": "C"}, run_dir=cfg["run_dir"], timeout_s=10)
    finally:
        stop(cfg)
        with pytest.raises(RankFailure) as failure:
            job.result(timeout=70)
    assert "rank 1 failed" in str(failure.value) and "exited with code 17" in str(failure.value)
    survivor = json.loads((Path(cfg["run_dir"]) / "rank0.json").read_text())
    assert changes(survivor["recipes"]) == [(0, "A"), (result.step, "B")]
