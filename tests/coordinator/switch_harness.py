"""Test helpers for the switch protocol: a fake planner/model, a call-counting transport, and a
multi-process runner that cleans up and reports the failing rank's traceback.

The fake planner stands in for `dist_quant.runtime.plan_model` so the protocol is tested without
the runtime: a recipe is a dict `{"name": ...}` plus optional fault knobs, read per rank:
`fail_rank` (planning raises there), `odd_digest_rank` (that rank's digest differs),
`sleep_rank` + `sleep_s` (that rank plans slowly).
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import threading
import time
import traceback
from collections import Counter
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any


class FakeModel:
    """Holds the active recipe name and when it changed."""

    def __init__(self, rank: int, recipe: str = "A") -> None:
        self.rank = rank
        self.recipe = recipe
        self.publishes: list[str] = []


class FakePlan:
    def __init__(self, model: FakeModel, recipe: str, digest: str) -> None:
        self.model, self.recipe, self.digest = model, recipe, digest

    def publish(self) -> str:
        self.model.recipe = self.recipe
        self.model.publishes.append(self.recipe)
        return self.recipe


def fake_loader(payload: Any) -> dict:
    if not isinstance(payload, dict) or not isinstance(payload.get("name"), str):
        raise ValueError(f"malformed recipe {payload!r}: expected a dict with a 'name'")
    return payload


def fake_planner(model: FakeModel, recipe: dict) -> FakePlan:
    if recipe.get("fail_rank") == model.rank:
        raise ValueError(f"factory raised for role layers.0.fc1 on rank {model.rank}")
    if recipe.get("sleep_rank") == model.rank:
        time.sleep(recipe["sleep_s"])
    digest = recipe["name"] + ("-odd-roles" if recipe.get("odd_digest_rank") == model.rank else "")
    return FakePlan(model, recipe["name"], digest)


def describe(model: FakeModel) -> str:
    return model.recipe


FAKE_HOOKS = {"planner": fake_planner, "recipe_loader": fake_loader, "describe": describe}


class CountingTransport:
    """Wraps a transport and counts calls per (thread name, operation)."""

    def __init__(self, inner: Any, counts: Counter | None = None) -> None:
        self.inner = inner
        self.counts: Counter = counts if counts is not None else Counter()
        self._lock = threading.Lock()

    def _count(self, op: str) -> None:
        with self._lock:
            self.counts[(threading.current_thread().name, op)] += 1

    def push(self, queue: str, data: bytes) -> None:
        self._count("push")
        self.inner.push(queue, data)

    def pop(self, queue: str, timeout: float | None = None) -> bytes | None:
        self._count("pop")
        return self.inner.pop(queue, timeout)

    def clone(self) -> CountingTransport:
        return CountingTransport(self.inner.clone(), self.counts)

    def close(self) -> None:
        self.inner.close()


class Script:
    """Plays one side of the protocol by hand on a transport (a rank, a client, a coordinator)."""

    def __init__(self, transport: Any, token: str) -> None:
        self.tx, self.token = transport, token

    def send(self, msg: Any, queue: str = "inbox") -> None:
        from dist_quant.coordinator.wire import seal

        self.tx.push(queue, seal(msg, self.token))

    def recv(self, queue: str = "inbox", timeout: float = 5.0) -> Any:
        from dist_quant.coordinator.wire import unseal

        data = self.tx.pop(queue, timeout)
        if data is None:
            raise TimeoutError(f"nothing arrived on {queue} within {timeout} s")
        return unseal(data, self.token)

    def silent(self, queue: str = "inbox", wait: float = 0.1) -> bool:
        """True if nothing arrives on `queue` within `wait` seconds."""
        return self.tx.pop(queue, wait) is None


def wait_for(predicate: Callable[[], bool], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(0.005)


# -- multi-process runner --------------------------------------------------------------------------


def _entry(fn: Callable, rank: int, world: int, init_file: str, out_dir: str, kwargs: dict) -> None:
    import torch.distributed as dist

    out = Path(out_dir)
    try:
        dist.init_process_group(
            "gloo",
            init_method=f"file://{init_file}",
            rank=rank,
            world_size=world,
            timeout=timedelta(seconds=60),
        )
        result = fn(rank, world, **kwargs)
        (out / f"rank{rank}.json").write_text(json.dumps(result))
    except BaseException:
        (out / f"rank{rank}.err").write_text(traceback.format_exc())
        os._exit(1)
    # No destroy_process_group: a peer may be dead on purpose, and tearing down would wait for it.
    os._exit(0)


class RankJob:
    """`world` spawned processes running `fn(rank, world, **kwargs)` over gloo (file:// init)."""

    def __init__(self, fn: Callable, world: int, tmp: Path, **kwargs: Any) -> None:
        self.out = tmp / "ranks"
        self.out.mkdir(parents=True, exist_ok=True)
        ctx = mp.get_context("spawn")
        init_file = str(tmp / "pg_init")
        self.procs = [
            ctx.Process(target=_entry, args=(fn, r, world, init_file, str(self.out), kwargs))
            for r in range(world)
        ]
        for p in self.procs:
            p.start()

    def join(self, timeout: float, expect_exit: dict[int, int] | None = None) -> list[Any]:
        """Wait for every rank; results per rank (None for a rank expected to die).

        Raises AssertionError with the failing rank's traceback if a rank fails or the job
        overruns; every process is killed before returning or raising.
        """
        expect = {r: 0 for r in range(len(self.procs))} | (expect_exit or {})
        deadline = time.monotonic() + timeout
        try:
            while any(p.is_alive() for p in self.procs):
                failed = [
                    r
                    for r, p in enumerate(self.procs)
                    if p.exitcode is not None and p.exitcode != expect[r]
                ]
                if failed or time.monotonic() > deadline:
                    raise AssertionError(self._report(failed, time.monotonic() > deadline))
                time.sleep(0.05)
            failed = [r for r, p in enumerate(self.procs) if p.exitcode != expect[r]]
            if failed:
                raise AssertionError(self._report(failed, False))
        finally:
            self.kill()
        return [
            json.loads((self.out / f"rank{r}.json").read_text()) if expect[r] == 0 else None
            for r in range(len(self.procs))
        ]

    def _report(self, failed: list[int], overran: bool) -> str:
        lines = ["job overran its timeout" if overran else f"ranks {failed} failed"]
        for r, p in enumerate(self.procs):
            err = self.out / f"rank{r}.err"
            detail = err.read_text() if err.exists() else ""
            lines.append(f"--- rank {r}: exitcode {p.exitcode}\n{detail}")
        return "\n".join(lines)

    def kill(self) -> None:
        for p in self.procs:
            if p.is_alive():
                p.kill()
        for p in self.procs:
            p.join(5)


def read_endpoint_when_ready(run_dir: Path, timeout: float = 60.0) -> dict:
    path = run_dir / "coordinator.json"
    wait_for(path.exists, timeout, f"{path}")
    return json.loads(path.read_text())


# -- the training loop each rank runs ------------------------------------------------------------


def train_worker(
    rank: int,
    world: int,
    *,
    run_dir: str,
    tp_size: int,
    stop_file: str,
    step_s: float,
    max_steps: int,
    collectives: bool = True,
    faults: tuple = (),
    decision_grace_s: float = 0.5,
) -> dict:
    """Train a FakeModel: step_boundary, record the active recipe, then (with `collectives`) an
    all-reduce in the TP group and a world all-reduce that also agrees on when to stop."""
    import torch
    import torch.distributed as dist
    from dist_quant.coordinator import attach

    groups = [list(range(g, g + tp_size)) for g in range(0, world, tp_size)]
    tp_pgs = [dist.new_group(g) for g in groups]  # every rank creates every group, in order
    tp_pg = tp_pgs[rank // tp_size]
    model = FakeModel(rank)
    participant = attach(
        model,
        tp_group=tp_pg,
        run_dir=run_dir,
        transport="store",
        faults=faults,
        decision_grace_s=decision_grace_s,
        **FAKE_HOOKS,
    )
    recipes: list[str] = []
    step = 0
    while step < max_steps:
        participant.step_boundary(step)
        recipes.append(model.recipe)
        stop = float(os.path.exists(stop_file))
        if collectives:
            x = torch.ones(1)
            dist.all_reduce(x, group=tp_pg)  # stands in for the TP matmul's partial sums
            flag = torch.tensor([stop])
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)  # every rank stops at the same step
            stop = flag.item()
        if stop:
            break
        time.sleep(step_s)
        step += 1
    return {"recipes": recipes, "address": participant.address, "state": participant.state}
