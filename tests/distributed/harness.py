"""Run a test function on N ranks: torch.multiprocessing + a file rendezvous, gloo on CPU, NCCL for
CUDA tensors when CUDA has at least N GPUs (each rank on its own GPU: `rank_device()`).

`run_ranks(fn, world_size, *args)` starts `world_size` processes, initialises the default process
group in each, calls `fn(rank, world_size, *args)` and returns every rank's return value (in rank
order). A failure on any rank fails the caller with that rank's traceback (and the traceback of every
other rank that also failed). A collective that another rank never joins times out (the process
group's timeout, `timeout_s`) and raises; a rank stuck anywhere else dumps the stacks of all its
threads (at its own deadline, or when the harness gives up on it) and the harness reports them.

Processes come from a forkserver that imported torch and dist_quant once, so a rank starts in well
under a second instead of the ~2-3 s a fresh `spawn` interpreter pays for `import torch`. Nothing
outlives a test: the harness kills every rank that is still running when it returns or raises, each
rank exits by itself at its deadline (faulthandler), and each rank watches the test process and exits
when it is gone (a killed pytest leaves no orphan).
"""

from __future__ import annotations

import datetime
import faulthandler
import os
import pickle
import shutil
import signal
import tempfile
import threading
import time
import traceback
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

_PRELOAD = ["torch", "torch.distributed", "dist_quant"]
_ctx = mp.get_context("forkserver")
_ctx.set_forkserver_preload(_PRELOAD)
_GRACE_S = 3.0  # after one rank fails, how long the others get to report their own failure
_STACK_DUMP_AFTER_S = 6.0  # past the collective timeout, when a stuck rank dumps its stack


class RankFailure(AssertionError):
    """One or more ranks raised, crashed or timed out; the message holds their tracebacks."""


def use_cuda(world_size: int) -> bool:
    return torch.cuda.is_available() and torch.cuda.device_count() >= world_size


def rank_device() -> torch.device:
    """The device a rank should compute on: its own GPU under NCCL, else the CPU."""
    if dist.is_initialized() and "nccl" in dist.get_backend():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _watch_parent(parent_pid: int) -> None:
    # The forkserver, not the test process, is our OS parent; poll the test process itself.
    while True:
        time.sleep(0.5)
        try:
            os.kill(parent_pid, 0)
        except ProcessLookupError:
            os._exit(3)


def _rank_main(
    rank: int,
    world_size: int,
    workdir: str,
    parent_pid: int,
    timeout_s: float,
    fn: Callable[..., Any],
    args: tuple,
) -> None:
    log = open(os.path.join(workdir, f"rank{rank}.log"), "w")  # noqa: SIM115 (lives until exit)
    os.dup2(log.fileno(), 1)
    os.dup2(log.fileno(), 2)
    # A collective times out first (the process group's timeout raises, with a traceback); a rank
    # stuck elsewhere writes every thread's stack to its log a little later and exits.
    faulthandler.dump_traceback_later(timeout_s + _STACK_DUMP_AFTER_S, exit=True, file=log)
    faulthandler.register(signal.SIGUSR1, file=log, all_threads=True)  # the harness asks for it
    threading.Thread(target=_watch_parent, args=(parent_pid,), daemon=True).start()
    torch.set_num_threads(1)  # N ranks share the machine's cores
    # With enough GPUs, CUDA tensors go through NCCL and CPU tensors (the CPU tests) through gloo.
    backend = "cpu:gloo,cuda:nccl" if use_cuda(world_size) else "gloo"
    if use_cuda(world_size):
        torch.cuda.set_device(rank)
    outcome: tuple[str, Any]
    try:
        dist.init_process_group(
            backend,
            init_method="file://" + os.path.join(workdir, "rendezvous"),
            rank=rank,
            world_size=world_size,
            timeout=datetime.timedelta(seconds=timeout_s),
        )
        outcome = ("ok", fn(rank, world_size, *args))
        # Only a clean run tears the group down: after a failure the peers may never join.
        dist.destroy_process_group()
    except BaseException as e:  # noqa: BLE001 (reported to the test process, which re-raises)
        outcome = ("error", f"{type(e).__name__}: {e}\n{traceback.format_exc()}")
    path = os.path.join(workdir, f"rank{rank}.pkl")
    with open(path + ".tmp", "wb") as f:
        pickle.dump(outcome, f)
    os.replace(path + ".tmp", path)  # the test process never reads a half-written result
    log.flush()
    os._exit(0)


def _tail(path: str, limit: int = 4000) -> str:
    try:
        with open(path, errors="replace") as f:
            text = f.read()
    except OSError:
        return ""
    return text[-limit:]


def run_ranks(
    fn: Callable[..., Any], world_size: int, *args: Any, timeout_s: float = 90.0
) -> list[Any]:
    """Run `fn(rank, world_size, *args)` on `world_size` ranks; return their results in rank order.

    `fn` must be importable by name (a module-level function) and its arguments and result
    picklable. Raises `RankFailure` with the traceback of every rank that raised, crashed or timed
    out; every rank process is gone when this returns or raises.
    """
    if world_size < 1:
        raise ValueError(f"run_ranks: world_size must be >= 1, got {world_size}")
    workdir = tempfile.mkdtemp(prefix="dq_ranks_")
    procs = []
    try:
        for rank in range(world_size):
            p = _ctx.Process(
                target=_rank_main,
                args=(rank, world_size, workdir, os.getpid(), timeout_s, fn, args),
                name=f"dq-rank{rank}",
                daemon=True,
            )
            p.start()
            procs.append(p)
        results = _collect(procs, workdir, timeout_s + _STACK_DUMP_AFTER_S + 10.0)
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
        for p in procs:
            p.join(5.0)
        shutil.rmtree(workdir, ignore_errors=True)
    return results


def _collect(procs: list, workdir: str, deadline_s: float) -> list[Any]:
    world_size = len(procs)
    outcomes: dict[int, tuple[str, Any]] = {}
    start = time.monotonic()
    first_failure: float | None = None
    while len(outcomes) < world_size:
        for rank, p in enumerate(procs):
            if rank in outcomes:
                continue
            path = os.path.join(workdir, f"rank{rank}.pkl")
            if os.path.exists(path):
                with open(path, "rb") as f:
                    outcomes[rank] = pickle.load(f)
            elif not p.is_alive():
                log = _tail(os.path.join(workdir, f"rank{rank}.log"))
                outcomes[rank] = ("error", f"exited with code {p.exitcode} and no result\n{log}")
            else:
                continue
            if outcomes[rank][0] == "error" and first_failure is None:
                first_failure = time.monotonic()
        now = time.monotonic()
        if first_failure is not None and now - first_failure > _GRACE_S:
            break  # the others are most likely blocked in a collective the failed rank left
        if now - start > deadline_s:
            break
        time.sleep(0.02)
    failed = {r: o[1] for r, o in outcomes.items() if o[0] == "error"}
    if not failed and len(outcomes) == world_size:
        return [outcomes[r][1] for r in range(world_size)]
    stuck = [rank for rank in range(world_size) if rank not in outcomes]
    for rank in stuck:  # each writes its stack to its log before it is killed
        if procs[rank].is_alive():
            os.kill(procs[rank].pid, signal.SIGUSR1)
    time.sleep(0.3 if stuck else 0.0)
    parts = []
    for rank in range(world_size):  # in rank order, every rank that did not finish cleanly
        if rank in failed:
            parts.append(f"rank {rank} failed:\n{failed[rank]}")
        elif rank in stuck:
            procs[rank].kill()
            procs[rank].join(5.0)
            log = _tail(os.path.join(workdir, f"rank{rank}.log"))
            reason = "was still running" if failed else f"timed out after {deadline_s:.0f}s"
            parts.append(f"rank {rank} {reason}; its stack:\n{log}")
    raise RankFailure("\n\n".join(parts))


def expect_error(fn: Callable[[], Any], exc_type: type[BaseException] = Exception) -> str:
    """Inside a rank: run `fn`, require it to raise `exc_type`, and return the message."""
    try:
        fn()
    except exc_type as e:
        return str(e)
    raise AssertionError(f"expected {exc_type.__name__}, nothing was raised")


__all__ = ["RankFailure", "expect_error", "rank_device", "run_ranks", "use_cuda"]
