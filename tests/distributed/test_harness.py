"""The multi-rank harness itself: a failing rank fails the test with its traceback, a hung rank is
stopped at the deadline with its stack, and no rank process outlives `run_ranks`.

What it catches: a harness that reports only "process exited with code 1" (no traceback), that waits
forever for a rank blocked in a collective its failed peer never joins, or that leaves rank
processes behind to eat the CI machine's two cores.
"""

from __future__ import annotations

import os
import time

import pytest
import torch
import torch.distributed as dist
from harness import RankFailure, run_ranks

pytestmark = pytest.mark.distributed


def _record_pid(workdir: str, rank: int) -> None:
    with open(os.path.join(workdir, f"pid{rank}"), "w") as f:
        f.write(str(os.getpid()))


def _one_rank_raises(rank: int, world: int, workdir: str) -> None:
    _record_pid(workdir, rank)
    if rank == 1:
        raise ValueError("rank one cannot go on")
    dist.all_reduce(torch.ones(1))  # rank 1 never joins: this blocks until the harness acts


def _one_rank_hangs(rank: int, world: int, workdir: str) -> None:
    _record_pid(workdir, rank)
    if rank == 0:
        time.sleep(3600)  # stuck outside any collective: only the deadline can stop it
    dist.all_reduce(torch.ones(1))


def _gone(pid: int, wait_s: float = 5.0) -> bool:
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        time.sleep(0.05)
    return False


def _pids(workdir: str, world: int) -> list[int]:
    """The pids the ranks recorded. A rank the harness stopped before its function ran (rank 0,
    still joining the process group when rank 1 fails) records none: it is gone by then."""
    paths = [os.path.join(workdir, f"pid{r}") for r in range(world)]
    pids = [int(open(p).read()) for p in paths if os.path.exists(p)]
    if not pids:
        raise AssertionError(f"no rank recorded its pid in {workdir}")
    return pids


def test_failing_rank_fails_the_test_with_its_traceback_and_no_rank_survives(tmp_path):
    with pytest.raises(RankFailure) as info:
        run_ranks(_one_rank_raises, 2, str(tmp_path), timeout_s=30)
    text = str(info.value)
    assert "rank 1 failed:\nValueError: rank one cannot go on" in text
    assert "_one_rank_raises" in text  # the traceback, not just an exit code
    assert all(_gone(pid) for pid in _pids(str(tmp_path), 2))


def test_hung_rank_is_stopped_at_the_deadline_with_its_stack(tmp_path):
    start = time.monotonic()
    with pytest.raises(RankFailure) as info:
        run_ranks(_one_rank_hangs, 2, str(tmp_path), timeout_s=2)
    assert time.monotonic() - start < 30
    text = str(info.value)
    assert "rank 1 failed:\nRuntimeError" in text  # its collective timed out, with a traceback
    # rank 0 never raised: its stack (dumped at its own deadline, or on the harness's request
    # when the harness gives up first) names the line it was stuck on
    rank0 = text[text.index("rank 0 ") : text.index("rank 1 failed")]
    assert "in _one_rank_hangs" in rank0
    assert all(_gone(pid) for pid in _pids(str(tmp_path), 2))
