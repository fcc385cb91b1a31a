"""Liveness of the cluster-wide switch with real rank processes: a rank that stops answering is
found silent within the lease (1.5 s) however long the vote deadline, and a rank whose plan never
ends is freed by the ABORT; either way the next switch commits without a restart.

The vote deadlines here (30 s, 3 s) are far from the lease, so the abort's reason tells which rule
fired without timing anything.
"""

from __future__ import annotations

import os
import signal

import pytest
from dist_quant.coordinator import fail_at
from test_switch_faults import CURRENT, Job, check_survivors

pytestmark = pytest.mark.distributed

SILENT = "no vote and no sign of life for {} s: dead, stopped or cut off"


@pytest.mark.parametrize(
    ("lease", "named"),
    [({}, "1.5"), ({"lease_s": 3.0}, "3")],
    ids=["the default lease", "attach(lease_s=3)"],
)
def test_a_stopped_rank_aborts_the_switch_at_its_lease_and_once_resumed_the_next_commits(
    tmp_path, lease, named
):
    job = Job(tmp_path, 3, **lease)
    pid = int((job.run_dir / "ready1").read_text())
    first = second = None
    try:
        os.kill(pid, signal.SIGSTOP)
        try:
            first = job.request("current", timeout_s=30.0)
        finally:
            os.kill(pid, signal.SIGCONT)
        second = job.request("current", timeout_s=30.0)
    finally:
        failure = job.stop(after_step=second.step + 2 if second and second.committed else 0)
    assert failure is None, failure
    assert not first.committed and first.reasons == {1: SILENT.format(named)}, first
    # the lease counts from the Prepare, which follows "open"
    assert first.timings["votes_s"] >= float(named)
    assert second.committed, second
    check_survivors(job.records(), [0, 1, 2], [(second.step, CURRENT)])


def test_a_plan_that_never_ends_aborts_at_the_deadline_and_frees_the_rank_for_the_next_switch(
    tmp_path,
):
    """Rank 1's planning of switch 1 hangs (60 s); its listener still says it is alive, so the
    switch runs to its deadline, not the lease. The ABORT frees rank 1 while the plan still
    runs, and switch 2 commits on every rank."""
    hang = fail_at(rank=1, phase="prepare", action="delay", seconds=60.0, switch_id=1)
    job = Job(tmp_path, 3, faults=(hang,))
    first = second = None
    try:
        first = job.request("current", timeout_s=3.0)
        second = job.request("current", timeout_s=30.0)
    finally:
        failure = job.stop(after_step=second.step + 2 if second and second.committed else 0)
    assert failure is None, failure
    assert not first.committed and first.reasons == {1: "no vote before the deadline (3 s)"}
    assert second.committed, second
    check_survivors(job.records(), [0, 1, 2], [(second.step, CURRENT)])
