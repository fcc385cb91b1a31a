"""Test helpers for the switch protocol: a fake planner/model, a call-counting transport, and a
multi-process runner that cleans up and reports the failing rank's traceback.

The fake planner stands in for `dist_quant.runtime.plan_model` so the protocol is tested without
the runtime: a recipe is a dict `{"name": ...}` plus optional fault knobs, read per rank:
`fail_rank` (planning raises there), `odd_digest_rank` (that rank's digest differs),
`sleep_rank` + `sleep_s` (that rank plans slowly).
"""

from __future__ import annotations

import json
import os
import threading
import time
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
        self.part_digests: dict[str, str] = {}

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

    def push_many(self, pushes: list[tuple[str, bytes]]) -> None:
        for _ in pushes:
            self._count("push")
        self.inner.push_many(pushes)

    def pop(self, queue: str, timeout: float | None = None) -> bytes | None:
        self._count("pop")
        return self.inner.pop(queue, timeout)

    def pop_many(self, queue: str, most: int, timeout: float | None = None) -> list[bytes]:
        self._count("pop")
        return self.inner.pop_many(queue, most, timeout)

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


def read_endpoint_when_ready(run_dir: Path, timeout: float = 60.0) -> dict:
    path = run_dir / "coordinator.json"
    wait_for(path.exists, timeout, f"{path}")
    return json.loads(path.read_text())


class Background:
    """Runs `tests/distributed/harness.run_ranks` in a thread, so the test can act as a client
    (request switches, read status) while the ranks train."""

    def __init__(self, run_ranks: Callable, fn: Callable, world: int, *args: Any, timeout_s: float):
        self._out: list[Any] = []

        def go() -> None:
            try:
                self._out.append(("ok", run_ranks(fn, world, *args, timeout_s=timeout_s)))
            except BaseException as e:  # noqa: BLE001 - re-raised in result()
                self._out.append(("error", e))

        self._thread = threading.Thread(target=go, daemon=True)
        self._thread.start()

    def result(self, timeout: float) -> list[Any]:
        self._thread.join(timeout)
        if not self._out:
            raise TimeoutError(f"ranks still running after {timeout} s")
        kind, value = self._out[0]
        if kind == "error":
            raise value
        return value


def fake_host(name: str) -> None:
    """This process's rank tells attach it runs on host `name`: several simulated hosts on this
    machine, whose loopback they all share (attach then needs `host=`, e.g. 127.0.0.1)."""
    import importlib

    from dist_quant.coordinator.locality import Locality

    importlib.import_module("dist_quant.coordinator.attach").here = lambda: Locality(name, None)


# -- the training loop each rank runs ------------------------------------------------------------


def train_worker(rank: int, world: int, cfg: dict) -> dict:
    """Train a FakeModel: step_boundary, record the active recipe, then (with cfg["collectives"])
    an all-reduce in the TP group and a world all-reduce that also agrees on when to stop.

    cfg: run_dir, tp_size, stop_file, step_s, max_steps, collectives, faults, decision_grace_s,
    transport, hosts (each rank's simulated host, `fake_host`) and host (attach's `host=`).
    The result also goes to `<run_dir>/rank<r>.json`, readable when a peer was killed on purpose
    (the harness then raises instead of returning results)."""
    import torch
    import torch.distributed as dist
    from dist_quant.coordinator import attach

    tp_size = cfg["tp_size"]
    groups = [list(range(g, g + tp_size)) for g in range(0, world, tp_size)]
    tp_pgs = [dist.new_group(g) for g in groups]  # every rank creates every group, in order
    tp_pg = tp_pgs[rank // tp_size]
    model = FakeModel(rank)
    if cfg.get("hosts"):
        fake_host(cfg["hosts"][rank])
    participant = attach(
        model,
        tp_group=tp_pg,
        run_dir=cfg["run_dir"],
        transport=cfg.get("transport", "store"),
        faults=cfg.get("faults", ()),
        decision_grace_s=cfg.get("decision_grace_s", 0.5),
        host=cfg.get("host"),
        **FAKE_HOOKS,
    )
    recipes: list[str] = []
    states: list[str] = []
    step = 0
    while step < cfg["max_steps"]:
        participant.step_boundary(step)
        recipes.append(model.recipe)
        states.append(participant.state)
        stop = float(os.path.exists(cfg["stop_file"]))
        if cfg.get("collectives", True):
            x = torch.ones(1)
            dist.all_reduce(x, group=tp_pg)  # stands in for the TP matmul's partial sums
            flag = torch.tensor([stop])
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)  # every rank stops at the same step
            stop = flag.item()
        if stop:
            break
        time.sleep(cfg["step_s"])
        step += 1
    result = {"recipes": recipes, "states": states, "state": participant.state}
    (Path(cfg["run_dir"]) / f"rank{rank}.json").write_text(json.dumps(result))
    participant.close()
    return result


class RayRank:
    """A training rank as a Ray actor (wrapped with `ray.remote` by the test)."""

    def run(self, rank: int, world: int, init_method: str, cfg: dict) -> dict:
        import torch.distributed as dist

        dist.init_process_group(
            "gloo",
            init_method=init_method,
            rank=rank,
            world_size=world,
            timeout=timedelta(seconds=60),
        )
        try:
            return train_worker(rank, world, cfg)
        finally:
            dist.destroy_process_group()
