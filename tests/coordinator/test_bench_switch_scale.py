"""bench/bench_switch_scale.py at a few dozen ranks, so the scale bench cannot rot: it runs the
real coordinator, transport and participants end to end and reports what it promises."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench" / "bench_switch_scale.py"
KEYS = {"ranks", "decision_ms", "published_ms", "max_stall_ms", "coordinator_cpu_ms",
        "rank0_messages", "rank0_connections", "max_step_ms"}  # fmt: skip


def run_bench(*args: str) -> list[dict]:
    out = subprocess.run(
        [sys.executable, str(BENCH), "--json", "--timeout", "120", *args],
        capture_output=True, text=True, timeout=240, check=True,
    )  # fmt: skip
    return [json.loads(line) for line in out.stdout.splitlines()]


@pytest.mark.parametrize("transport", ["store", "ray"])
def test_bench_switches_every_simulated_rank_and_counts_four_messages_per_rank(transport):
    ranks = 24
    (row,) = run_bench("--ranks", str(ranks), "--ranks-per-node", "4", "--transport", transport,
                       "--ranks-per-process", "12", "--step-ms", "50", "--at-step-ahead", "60")  # fmt: skip
    assert "error" not in row, row
    assert KEYS <= row.keys()
    assert row["ranks"] == ranks and row["attach_failures"] == 0
    assert row["commit_step"] == row["at_step"]
    # (the client may hear the result after the ranks published: no order between the two)
    assert row["decision_ms"] > 0 and row["published_ms"] > 0
    assert row["coordinator_cpu_ms"] > 0 and 0 <= row["max_stall_ms"] <= row["max_step_ms"]
    assert_stall_split(row)
    # at_step is every rank's hold step: none can wait on the protocol before it
    assert (row["ranks_waited_ahead"], row["protocol_wait_ahead_ms"]) == (0, 0.0)
    assert all(int(step) >= row["commit_step"] for step in row["protocol_waits_by_step"])
    # prepare, vote, decision and ack per rank; the request, "accepted" and the result; then
    # the bench's status polls, a query and its reply each
    extra = row["rank0_messages"] - 4 * ranks - 3
    assert extra >= 2 and extra % 2 == 0, row
    if transport == "store":
        # one per rank (its clone shares it), the coordinator's, the client's, and the one the
        # TCPStore server opens to itself
        assert row["rank0_connections"] == ranks + 3
    else:  # every rank's listener holds one actor thread in a pop
        assert row["rank0_connections"] >= ranks


def assert_stall_split(row):
    """The longest boundary's wall time is its protocol wait, own CPU and time not running (the
    rest, clamped at 0: a thread's CPU clock can read a little past the wall clock over one call,
    and then the parts add up to more than the wall time)."""
    split = row["max_stall_split_ms"]
    assert set(split) == {"protocol", "cpu", "not_running"} and min(split.values()) >= 0
    if split["not_running"] > 0:
        assert sum(split.values()) == pytest.approx(row["max_stall_ms"], abs=0.01)
    else:
        assert split["protocol"] + split["cpu"] >= row["max_stall_ms"] - 0.01
    for part, most in (("protocol", "max_protocol_wait_ms"), ("cpu", "max_boundary_cpu_ms"),
                       ("not_running", "max_not_running_ms")):  # fmt: skip
        assert split[part] <= row[most] + 1e-3
    assert row["max_commit_boundary_cpu_ms"] <= row["max_boundary_cpu_ms"]


def test_bench_runs_each_switch_as_a_row_of_its_own():
    rows = run_bench("--ranks", "24", "--ranks-per-node", "4", "--relays", "--ranks-per-process",
                     "12", "--step-ms", "50", "--switches", "2")  # fmt: skip
    assert [r.get("error") for r in rows] == [None, None], rows
    assert [r["switch"] for r in rows] == [1, 2]
    first, second = rows
    # the second starts after the first published: its ranks are further on
    assert second["request_step"] > first["commit_step"] >= first["request_step"]
    assert second["commit_step"] >= second["request_step"]
    for row in rows:
        assert KEYS <= row.keys() and row["published_ms"] > 0
        assert_stall_split(row)
        # prepare, vote, decision and ack per node (its relay's bundle or summary), at least
        assert row["rank0_messages"] >= 4 * (24 // 4)


def test_bench_plan_time_holds_the_decision_until_the_slowest_rank_planned():
    (row,) = run_bench("--ranks", "24", "--ranks-per-node", "4", "--relays", "--ranks-per-process",
                       "12", "--step-ms", "50", "--plan-ms", "400")  # fmt: skip
    assert row.get("error") is None and row["plan_ms"] == 400.0, row
    # each rank sleeps its own share of 400 ms (the bench's hash of the rank, worked here again)
    slowest = max(r * 2654435761 % 4096 for r in range(24)) / 4096
    assert slowest > 0.9 and row["decision_ms"] >= 400 * slowest
    assert row["commit_step"] > row["request_step"]


def test_bench_with_a_stopped_rank_aborts_at_the_lease_naming_it_then_the_next_switch_commits():
    rows = run_bench("--ranks", "24", "--ranks-per-node", "4", "--relays", "--ranks-per-process",
                     "12", "--step-ms", "50", "--switches", "2", "--stop-rank", "5",
                     "--lease-s", "1.5")  # fmt: skip
    assert [r.get("error") for r in rows] == [None, None], rows
    stopped, after = rows
    assert stopped["committed"] is False and stopped["commit_step"] is None
    assert stopped["named_ranks"] == [5]
    assert stopped["reasons"] == ["no vote and no sign of life for 1.5 s: dead, stopped or cut off"]
    # the lease runs from the Prepare, which goes out after the request
    assert stopped["decision_ms"] >= 1500 and stopped["unblocked_ms"] >= stopped["decision_ms"]
    assert "published_ms" not in stopped
    # the other ranks voted YES and held at their hold step until the abort came
    assert stopped["max_protocol_wait_ms"] > 0
    assert after["committed"] is True and after["published_ms"] > 0
    assert after["commit_step"] >= after["request_step"] > stopped["request_step"]


def test_bench_with_relays_puts_one_connection_per_other_node_on_rank_0s_store():
    ranks, per_node = 24, 4
    (row,) = run_bench("--ranks", str(ranks), "--ranks-per-node", str(per_node), "--relays",
                       "--ranks-per-process", "12", "--step-ms", "50", "--at-step-ahead", "60")  # fmt: skip
    assert "error" not in row, row
    assert row["published_ms"] > 0 and row["commit_step"] == row["at_step"]
    nodes = ranks // per_node
    # rank 0's node: its 4 ranks and its relay's 2; one relay per other node; the coordinator's,
    # the client's and the server's own. Each leader's store: its 4 ranks, its relay's, its own.
    assert row["rank0_connections"] == per_node + 2 + (nodes - 1) + 3
    assert row["leader_connections"] == per_node + 1 + 1


def test_bench_reports_a_timeout_as_an_error_row_not_a_hang():
    (row,) = run_bench("--ranks", "8", "--transport", "ray", "--timeout", "0.001")
    assert row["ranks"] == 8 and "TimeoutError" in row["error"]


def test_the_rank_profile_splits_a_switchs_cpu_by_kind_of_thread():
    profile = BENCH.with_name("profile_switch_ranks.py")
    out = subprocess.run(
        [sys.executable, str(profile), "--ranks", "16", "--switches", "1", "--idle-s", "0.2"],
        capture_output=True, text=True, timeout=120, check=True,
    )  # fmt: skip
    (switch,) = [line for line in out.stdout.splitlines() if line.startswith("switch 1:")]
    # two nodes of 8: every rank listens and plans, both leaders relay, the trainer publishes
    for kind in ("listener", "planner", "relay.up", "relay.down", "trainer"):
        assert f" {kind} " in switch, (kind, switch)
    assert "us/rank" in switch and "'push'" in switch


def test_bench_with_scripted_nodes_switches_the_real_ranks_and_names_a_stopped_one():
    """--real-ranks 8 of 32: the first six nodes are scripted relays and the last two run real
    participants; both switches reach all 32 ranks (the scripted ones publish at the commit
    step too), then with rank 29 stopped the switch aborts at the lease naming it alone and
    the next commits."""
    common = ("--ranks", "32", "--ranks-per-node", "4", "--relays", "--real-ranks", "8",
              "--ranks-per-process", "4", "--step-ms", "50", "--switches", "2")  # fmt: skip
    rows = run_bench(*common)
    assert [r.get("error") for r in rows] == [None, None], rows
    for row in rows:
        assert row["real_ranks"] == 8 and row["committed"] and row["published_ms"] > 0
        # one message per node and round, the client's three and the bench's status polls
        assert row["rank0_messages"] >= 4 * 8 + 3
    stopped, after = run_bench(*common, "--stop-rank", "29", "--lease-s", "1.5")
    assert (stopped["committed"], stopped["named_ranks"]) == (False, [29]), stopped
    assert stopped["decision_ms"] >= 1500 and after["committed"] and after.get("error") is None
