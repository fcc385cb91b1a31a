"""A two-node torchrun job on one machine (two network namespaces, see netns.py), default `attach`.

Each node runs `python -m torch.distributed.run --nnodes 2 --nproc-per-node 1 --node-rank R
--master-addr 10.77.0.1` inside its namespace with its own run dir; the CLI switches the job from
each node (`dist-quant switch --run-dir <that node's dir>`, run inside that node's namespace).
"""

import json
import os
import re
import signal
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "coordinator"))  # switch_harness

from netns import ADDRESSES, skip_reason, two_hosts  # noqa: E402
from switch_harness import wait_for  # noqa: E402

pytestmark = pytest.mark.distributed

JOB = Path(__file__).with_name("two_node_job.py")
CLI = [sys.executable, "-m", "dist_quant.launch.cli"]
_SKIP = skip_reason()


@pytest.fixture
def hosts():
    if _SKIP:
        pytest.skip(_SKIP)
    with two_hosts() as h:
        yield h


def start_job(hosts, tmp_path, wait_endpoints=True, nproc=1, **cfg):
    cfg = {"stop_file": str(tmp_path / "stop"), "step_s": 0.02, "max_steps": 100_000, **cfg}
    cfg_path = tmp_path / "cfg.json"
    cfg_path.write_text(json.dumps(cfg))
    run_dirs = [tmp_path / f"node{n}" for n in (0, 1)]
    port = str(29_500 + os.getpid() % 1000)
    for node in (0, 1):
        argv = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2"]
        argv += ["--nproc-per-node", str(nproc), "--node-rank", str(node)]
        argv += ["--master-addr", ADDRESSES[0]]
        argv += ["--master-port", port, str(JOB), str(cfg_path)]
        log = open(tmp_path / f"torchrun{node}.log", "w")  # noqa: SIM115 - closed with the process
        env = hosts.env(node, DIST_QUANT_RUN_DIR=str(run_dirs[node]))
        hosts.popen(node, argv, env, stdout=log, stderr=log)
    for node in (0, 1):
        if wait_endpoints:
            wait_for((run_dirs[node] / "coordinator.json").exists, 60, f"node {node}'s endpoint")
    return cfg, run_dirs


def cli(hosts, node, run_dir, *args, timeout=60):
    return hosts.run(node, [*CLI, *args, "--run-dir", str(run_dir)], hosts.env(node), timeout)


def published(hosts, node, run_dir) -> bool:
    done = cli(hosts, node, run_dir, "status", "--json")
    return done.returncode == 0 and json.loads(done.stdout)["phase"] == "published"


def finish(cfg, run_dirs, tmp_path):
    Path(cfg["stop_file"]).touch()
    for node in (0, 1):
        wait_for((run_dirs[node] / f"rank{node}.json").exists, 60, f"rank {node}'s result")
    return [json.loads((run_dirs[n] / f"rank{n}.json").read_text()) for n in (0, 1)]


def logs(tmp_path) -> str:
    return "\n".join((tmp_path / f"torchrun{n}.log").read_text()[-3000:] for n in (0, 1))


def test_default_attach_on_two_nodes_switches_from_either_node_at_one_step(hosts, tmp_path):
    cfg, run_dirs = start_job(hosts, tmp_path)
    endpoints = [json.loads((d / "coordinator.json").read_text()) for d in run_dirs]
    assert endpoints[0] == endpoints[1]
    assert endpoints[0]["address"].startswith(f"{ADDRESSES[0]}:"), endpoints[0]
    assert all((d / "coordinator.json").stat().st_mode & 0o777 == 0o600 for d in run_dirs)

    steps = []
    for node, recipe in ((0, "current"), (1, "delayed")):
        done = cli(hosts, node, run_dirs[node], "switch", recipe, "--timeout", "20")
        assert done.returncode == 0, done.stdout + done.stderr + logs(tmp_path)
        steps.append(int(re.search(r"from step (\d+)", done.stdout).group(1)))
        wait_for(lambda n=node: published(hosts, n, run_dirs[n]), 30, "the switch's publish")
    results = finish(cfg, run_dirs, tmp_path)

    keys = [r["keys"] for r in results]
    n = min(len(k) for k in keys)
    assert keys[0][:n] == keys[1][:n]  # no step ran with two recipes
    changed = [i for i in range(1, n) if keys[0][i] != keys[0][i - 1]]
    assert changed == steps, (changed, steps)
    assert "Delayed" in keys[0][0] and "Current" in keys[0][steps[0]]
    assert [r["state"] for r in results] == ["idle", "idle"]


def test_a_node_lost_while_voting_aborts_the_switch_and_the_survivor_keeps_its_recipe(
    hosts, tmp_path
):
    cfg, run_dirs = start_job(hosts, tmp_path, plan_delay_rank=1)
    wait_for((run_dirs[1] / "pid.rank1").exists, 30, "rank 1's pid")
    rank1 = int((run_dirs[1] / "pid.rank1").read_text())
    switch = hosts.popen(
        0,
        [*CLI, "switch", "current", "--timeout", "60", "--run-dir", str(run_dirs[0])],
        hosts.env(0),
        stdout=open(tmp_path / "switch.out", "w"),  # noqa: SIM115
    )
    wait_for(
        lambda: (
            '"event": "open"' in (run_dirs[0] / "decisions.jsonl").read_text()
            if (run_dirs[0] / "decisions.jsonl").exists()
            else False
        ),
        30,
        "the switch to open",
    )
    os.kill(rank1, signal.SIGKILL)  # rank 1 is planning its vote (a 60 s injected delay)
    # found silent by its 1.5 s lease, long before the 60 s vote deadline
    assert switch.wait(50) == 1, (tmp_path / "switch.out").read_text()
    out = (tmp_path / "switch.out").read_text()
    silent = "rank 1: no vote and no sign of life for 1.5 s: dead, stopped or cut off"
    assert "aborted" in out and silent in out, out

    Path(cfg["stop_file"]).touch()
    wait_for((run_dirs[0] / "rank0.json").exists, 60, "the survivor's result")
    survivor = json.loads((run_dirs[0] / "rank0.json").read_text())
    assert survivor["state"] == "idle"
    assert {k for k in survivor["keys"]} == {survivor["keys"][0]}  # never left delayed scaling
    assert "Delayed" in survivor["keys"][0]
    decisions = [json.loads(line) for line in (run_dirs[0] / "decisions.jsonl").open()]
    outcome = [d for d in decisions if d["event"] == "decision"]
    assert [(d["switch_id"], d["commit"]) for d in outcome] == [(1, False)]


def test_a_coordinator_the_other_node_cannot_reach_fails_every_rank_with_the_host_fix(
    hosts, tmp_path
):
    cfg, run_dirs = start_job(hosts, tmp_path, wait_endpoints=False, host="127.0.0.1")
    errors = [run_dirs[n] / f"attach_error.rank{n}" for n in (0, 1)]
    wait_for(lambda: all(e.exists() for e in errors), 60, "both ranks' attach errors")
    texts = [e.read_text() for e in errors]
    assert texts[0] == texts[1], texts  # one diagnosis, on every rank
    line = texts[0]
    assert "\n" not in line
    assert line.startswith("TransportError: attach: rank 1 (at 10.77.0.2) cannot reach the "), line
    assert "coordinator at 127.0.0.1:" in line and "within 5 s" in line, line
    assert "host=" in line, line
    for proc in hosts.procs:
        assert proc.wait(60) != 0
    assert not (run_dirs[0] / "coordinator.json").exists()  # removed when attach failed
    assert not (run_dirs[1] / "coordinator.json").exists()


WILDCARD_CHECK = """
import os, sys
from dist_quant.coordinator.locality import Locality, choose_host
from dist_quant.coordinator.transport_store import StoreServer, StoreTransport
two_hosts = [Locality("here", None), Locality("elsewhere", None)]
bind, advertise, why = choose_host(sys.argv[1] or None, two_hosts)
server = StoreServer(bind, advertise=advertise)
StoreTransport(server.address, connect_timeout_s=5).push("q", b"x")
print(bind, server.address, why)
"""


@pytest.mark.parametrize("host", ["", "0.0.0.0"])
def test_rank_0_of_a_multi_host_job_advertises_master_addr_also_when_binding_a_wildcard(
    hosts, host
):
    env = hosts.env(0, MASTER_ADDR=ADDRESSES[0])
    done = hosts.run(0, [sys.executable, "-c", WILDCARD_CHECK, host], env, timeout=60)
    assert done.returncode == 0, done.stderr
    bind, address, why = done.stdout.split(" ", 2)
    assert bind == (host or ADDRESSES[0])
    assert address.startswith(f"{ADDRESSES[0]}:")
    assert "MASTER_ADDR=10.77.0.1" in why


def node_results(run_dirs, ranks, maybe=()):
    """Each surviving rank's result (rank r of 2 x 3 writes into its node's run dir); those of
    `maybe` only if their launcher left them running (torchrun stops a node's other workers once
    one of them exits)."""
    out = {}
    for r in ranks:
        path = run_dirs[r // 3] / f"rank{r}.json"
        wait_for(path.exists, 60, f"rank {r}'s result")
        out[r] = json.loads(path.read_text())
    for r in maybe:
        path = run_dirs[r // 3] / f"rank{r}.json"
        if path.exists():
            out[r] = json.loads(path.read_text())
    return out


@pytest.mark.parametrize(
    "exit_at, committed",
    [("vote", False), ("relay", True)],
    ids=["leader exits before the COMMIT is logged", "leader exits after the COMMIT is logged"],
)
def test_a_node_leader_dying_around_the_commit_leaves_no_rank_half_switched(
    hosts, tmp_path, exit_at, committed
):
    """2 nodes x 3 ranks; ranks 3-5 connect to rank 3's node store and reach the coordinator
    through rank 3's relay. Rank 3 exits while voting (the coordinator then finds node 1 silent
    and aborts) or while handing the logged COMMIT to its node (node 0 publishes at S; ranks 4
    and 5, where torchrun leaves them running, lose rank 3's store and ask the coordinator
    straight: tests/coordinator/test_node_store.py covers that). Every survivor runs one recipe
    per step, all alike."""
    cfg, run_dirs = start_job(hosts, tmp_path, nproc=3, exit_at=[3, exit_at])
    done = cli(hosts, 0, run_dirs[0], "switch", "current", "--timeout", "60")
    assert done.returncode == (0 if committed else 1), done.stdout + done.stderr + logs(tmp_path)
    if not committed:
        # node 1 silent: rank 3 first among the ranks of that line (4 and 5 too, unless they
        # reached the coordinator straight in time)
        (silent,) = [line for line in done.stdout.splitlines() if "no sign of life" in line]
        assert re.match(r"  ranks? 3\b.*: no vote and no sign of life for 1.5 s", silent), silent
    else:
        step = int(re.search(r"from step (\d+)", done.stdout).group(1))
    # the survivors train on alone (their collectives with rank 3 failed) up to a step past S
    Path(cfg["stop_file"]).write_text(str(step + 3 if committed else 0))
    results = node_results(run_dirs, (0, 1, 2), maybe=(4, 5))
    for r, res in results.items():
        keys = res["keys"]
        if committed:
            assert all("Delayed" in k for k in keys[:step]), (r, keys[:step])
            assert all("Current" in k for k in keys[step:]), (r, keys[step:])
            assert len(keys) > step, (r, len(keys), step)
        else:
            assert all("Delayed" in k for k in keys), (r, keys)
    decisions = [json.loads(line) for line in (run_dirs[0] / "decisions.jsonl").open()]
    outcome = [(d["switch_id"], d["commit"]) for d in decisions if d["event"] == "decision"]
    assert outcome == [(1, committed)]


def test_a_hung_rank_behind_its_node_leader_is_named_alone_and_once_resumed_the_next_switch_commits(
    hosts, tmp_path
):
    """2 nodes x 3 ranks; rank 4, behind rank 3's relay and store, is stopped (SIGSTOP) before the
    switch: its listener reads nothing, and its collectives hold every other rank at their next
    step. Rank 3's relay speaks for ranks 3 and 5, so the switch aborts at the lease naming
    rank 4 alone; resumed, rank 4 reads the ABORT, and the next switch commits on all six ranks
    at one step."""
    cfg, run_dirs = start_job(hosts, tmp_path, nproc=3)
    wait_for((run_dirs[1] / "pid.rank4").exists, 30, "rank 4's pid")
    rank4 = int((run_dirs[1] / "pid.rank4").read_text())
    os.kill(rank4, signal.SIGSTOP)
    try:
        first = cli(hosts, 0, run_dirs[0], "switch", "current", "--timeout", "30")
    finally:
        os.kill(rank4, signal.SIGCONT)
    assert first.returncode == 1, first.stdout + first.stderr + logs(tmp_path)
    (silent,) = [line for line in first.stdout.splitlines() if "no sign of life" in line]
    assert (
        silent.strip() == "rank 4: no vote and no sign of life for 1.5 s: dead, stopped or cut off"
    )
    second = cli(hosts, 0, run_dirs[0], "switch", "current", "--timeout", "30")
    assert second.returncode == 0, second.stdout + second.stderr + logs(tmp_path)
    step = int(re.search(r"from step (\d+)", second.stdout).group(1))
    Path(cfg["stop_file"]).write_text(str(step + 3))
    for r, res in node_results(run_dirs, range(6)).items():
        keys = res["keys"]
        assert all("Delayed" in k for k in keys[:step]), (r, keys[:step])
        assert all("Current" in k for k in keys[step:]) and len(keys) > step, (r, keys[step:])
    decisions = [json.loads(line) for line in (run_dirs[0] / "decisions.jsonl").open()]
    outcome = [(d["switch_id"], d["commit"]) for d in decisions if d["event"] == "decision"]
    assert outcome == [(1, False), (2, True)]
