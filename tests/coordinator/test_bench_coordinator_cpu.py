"""bench/bench_coordinator_cpu.py at a few nodes, so the coordinator benchmark cannot rot: both
modes commit a switch of relayed nodes, and the store mode's rank 0 moves one message per node
per round (Prepare, votes, decision, acks) plus the client's three, summaries or not, and with
--hand-down leaves the Prepare and the decision in every rank's queue; with a silent rank it
aborts at the lease."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench" / "bench_coordinator_cpu.py"


def run_bench(*args: str) -> list[dict]:
    out = subprocess.run(
        [sys.executable, str(BENCH), "--json", "--ranks", "64", "--per-node", "8", *args],
        capture_output=True, text=True, timeout=240, check=True,
    )  # fmt: skip
    return [json.loads(line) for line in out.stdout.splitlines()]


@pytest.mark.parametrize("summaries", [True, False])
def test_the_store_mode_moves_four_messages_per_node_at_rank_0(summaries):
    (row,) = run_bench("--store", *(() if summaries else ("--no-summaries",)))
    assert (row["ranks"], row["nodes"], row["summaries"]) == (64, 8, summaries)
    assert row["rank0_messages"] == 4 * 8 + 3  # request, "accepted", result
    assert 0 < row["decision_ms"] <= row["acked_ms"] and 0 < row["published_ms"] <= row["acked_ms"]
    assert row["coordinator_cpu_ms"] > 0 and row["voters_cpu_ms"] > 0
    threads = row["coordinator_threads_cpu_ms"]
    assert sorted(threads) == ["main", "pump"] and min(threads.values()) > 0
    assert sum(threads.values()) == pytest.approx(row["coordinator_cpu_ms"])
    assert (row["hand_down"], row["handed_down"]) == (False, 0)


def test_scripted_relays_that_hand_down_leave_the_prepare_and_decision_with_every_rank():
    """With --hand-down the scripted relays do a relay's down work too: each rank's own queue
    ends up holding the two messages of its switch (nobody reads them here), and rank 0 moves
    what it moves without it."""
    (row,) = run_bench("--store", "--hand-down")
    assert (row["hand_down"], row["handed_down"]) == (True, 2 * 64)
    assert row["rank0_messages"] == 4 * 8 + 3


def test_the_memory_mode_reports_cpu_per_rank_and_per_node():
    (row,) = run_bench()
    assert row["cpu_us_per_node"] == pytest.approx(row["cpu_us_per_rank"] * 8)
    assert row["cpu_ms"] > 0 and row["summaries"] is True


def test_scripted_relays_in_a_process_of_their_own_do_the_same_work():
    """--voters-apart: the scripted relays' threads run in a spawned process (off the
    coordinator's GIL, as relays run on hosts of their own); the switch, rank 0's messages and
    the relays' down work are those of the in-process run, and their CPU comes back."""
    (row,) = run_bench("--store", "--voters-apart", "--voter-threads", "3", "--hand-down")
    assert (row["voters_apart"], row["voter_threads"]) == (True, 3)
    assert row["rank0_messages"] == 4 * 8 + 3 and row["handed_down"] == 2 * 64
    assert 0 < row["published_ms"] <= row["acked_ms"] and row["voters_cpu_ms"] > 0


def test_a_silent_rank_is_aborted_at_the_lease_and_every_node_gets_the_abort():
    """--silent-rank: rank 13 never votes and its relay never says it is alive; the coordinator
    aborts at the library's lease (counted from the Prepare, which follows the request) naming
    it alone, every node gets the ABORT, and rank 0 moves three messages per node (Prepare,
    votes, decision: an ABORT is not acked), the client's three and the mark it pushes into its
    own inbox and reads back to judge the silence only once every queued message is in."""
    (row,) = run_bench("--store", "--silent-rank", "13")
    assert (row["committed"], row["named_ranks"], row["silent_rank"]) == (False, [13], 13)
    assert row["reasons"] == ["no vote and no sign of life for 1.5 s: dead, stopped or cut off"]
    assert row["decision_ms"] >= 1500 and row["unblocked_ms"] >= 1500
    assert "published_ms" not in row and row["rank0_messages"] == 3 * 8 + 3 + 2
