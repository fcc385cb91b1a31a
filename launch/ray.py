"""Launch N training ranks as Ray actors.

`RayJob(nproc).start(fn, *args)` does, in order:
1. connects to Ray: the cluster given by `address` / `$RAY_ADDRESS`; else a cluster running on
   this machine (`ray start --head`), joined as it is (Ray refuses resource arguments there);
   else a private local instance started for this job, with a CPU per rank even on a machine
   with fewer cores (stopped again by `shutdown()`);
2. reserves one bundle per rank in a placement group (`{"CPU": 1}`, plus `{"GPU": 1}` on GPUs) and
   waits until it is placed, so a job that cannot fit fails at once instead of hanging;
3. starts one actor per rank; rank 0 picks MASTER_ADDR (its node's IP) and a free MASTER_PORT; every
   rank sets RANK / WORLD_SIZE / LOCAL_RANK / MASTER_ADDR / MASTER_PORT / DIST_QUANT_RUN_DIR,
   initialises the default process group (NCCL on GPUs, gloo on CPU) and calls
   `fn(*args, **kwargs)`.

The coordinator: when `fn` calls `dist_quant.coordinator.attach(model)`, rank 0 creates the job's
coordinator as a named Ray actor through the coordinator package's Ray transport (its own
namespace, on rank 0's node) and writes `coordinator.json` into the run directory, so
`dist-quant switch --run-dir DIR` reaches it from any process on that node. That actor is owned by
rank 0's actor, so Ray stops it with rank 0.

`wait()` returns every rank's return value in rank order. If any rank raises or dies, every rank
actor (and with rank 0 the coordinator) and the placement group are torn down at once (ranks
blocked in a collective would otherwise wait forever), and `RankFailedError` names the first
failing rank. `shutdown()` is idempotent and leaves no actor behind; a Ray instance this job
started is stopped too (a cluster it joined keeps running). Ray is imported only here, and only
when a job starts.
"""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

# Environment variables the ranks inherit from the launcher (Ray workers are started by the
# raylet, not by us, so the launcher's environment does not reach them by itself).
_FORWARDED_ENV = ("TRITON_INTERPRET", "DIST_QUANT_TOKEN", "PYTHONPATH", "OMP_NUM_THREADS")

RAY_INSTALL_HINT = (
    'pip install -e ".[ray]" in a dist-quant source checkout (else: pip install "ray[default]")'
)


class RankFailedError(RuntimeError):
    """A rank of a Ray job raised or died; the whole job has been shut down."""

    def __init__(self, rank: int, cause: str) -> None:
        super().__init__(f"rank {rank} failed: {cause}")
        self.rank = rank
        self.cause = cause


def _import_ray() -> Any:
    try:
        import ray
    except ImportError as e:
        raise RuntimeError(f"the Ray launcher needs Ray: {RAY_INSTALL_HINT}") from e
    return ray


def _describe(err: BaseException) -> str:
    """One line for an error: the user's exception rather than Ray's wrapped traceback."""
    cause = getattr(err, "cause", None)
    if isinstance(cause, BaseException):
        err = cause
    text = str(err).strip().splitlines()
    return f"{type(err).__name__}: {text[0] if text else ''}".rstrip(": ")


@dataclass(frozen=True)
class _Failure:
    """What a rank returns instead of raising: when it failed lets the launcher name the rank
    that failed first, not a peer that failed after it (a collective cut off by its exit)."""

    when: float
    summary: str


class _Rank:
    """The body of one rank actor (wrapped with `ray.remote` when a job starts)."""

    def __init__(self, rank: int, world_size: int, env: Mapping[str, str]) -> None:
        self.rank = rank
        self.world_size = world_size
        os.environ.update(env)

    def node_ip(self) -> str:
        import ray

        return ray.util.get_node_ip_address()

    def free_port(self) -> int:
        # Bound and released at once: the port is free now, and the process group binds it within
        # the next second; the same idiom torchrun's standalone mode relies on.
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind(("", 0))
            return s.getsockname()[1]

    def run(
        self,
        master: tuple[str, int],
        local_rank: int,
        backend: str,
        timeout_s: float,
        fn: Callable[..., Any],
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
    ) -> Any:
        import torch
        import torch.distributed as dist

        os.environ.update(
            RANK=str(self.rank),
            WORLD_SIZE=str(self.world_size),
            LOCAL_RANK=str(local_rank),
            MASTER_ADDR=master[0],
            MASTER_PORT=str(master[1]),
        )
        if backend == "nccl":
            # Ray gives each actor its own GPU through CUDA_VISIBLE_DEVICES: it is device 0 here.
            torch.cuda.set_device(0)
        dist.init_process_group(
            backend,
            init_method="env://",
            rank=self.rank,
            world_size=self.world_size,
            timeout=timedelta(seconds=timeout_s),
        )
        try:
            return fn(*args, **kwargs)
        except Exception as e:
            return _Failure(time.time(), _describe(e))
        finally:
            dist.destroy_process_group()


class RayJob:
    """N ranks as Ray actors; see the module docstring."""

    def __init__(
        self,
        nproc: int,
        *,
        use_gpu: bool | None = None,
        run_dir: str | Path | None = None,
        address: str | None = None,
        env: Mapping[str, str] | None = None,
        collective_timeout_s: float = 300.0,
        placement_timeout_s: float = 60.0,
        failure_grace_s: float = 2.0,
    ) -> None:
        if isinstance(nproc, bool) or not isinstance(nproc, int) or nproc < 1:
            raise ValueError(f"--nproc must be an integer >= 1, got {nproc!r}")
        self.nproc = nproc
        self.use_gpu = use_gpu
        self.run_dir = None if run_dir is None else Path(run_dir).resolve()
        self.address = address
        self._env = {k: os.environ[k] for k in _FORWARDED_ENV if k in os.environ}
        self._env.setdefault("OMP_NUM_THREADS", "1")
        if self.run_dir is not None:
            self._env["DIST_QUANT_RUN_DIR"] = str(self.run_dir)
        self._env.update(env or {})
        self._collective_timeout_s = collective_timeout_s
        self._failure_grace_s = failure_grace_s
        self._placement_timeout_s = placement_timeout_s
        self._ray: Any = None
        self._owns_ray = False
        self.joined: str | None = None
        """The cluster address joined ("auto": the one running on this machine), or None when
        this job started its own local instance."""
        self._pg: Any = None
        self._actors: list[Any] = []
        self._futures: list[Any] = []
        self._results: dict[int, Any] = {}

    # ---- start -------------------------------------------------------------------------------
    def start(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> RayJob:
        if self._futures:
            raise RuntimeError("this Ray job was already started")
        ray = self._ray = _import_ray()
        try:
            self._start(ray, fn, args, kwargs)
        except BaseException:
            self.shutdown()
            raise
        return self

    def _start(self, ray: Any, fn: Callable[..., Any], args: tuple, kwargs: dict) -> None:
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        if not ray.is_initialized():
            self._connect(ray)
            self._owns_ray = True
        use_gpu = self.use_gpu
        if use_gpu is None:
            use_gpu = ray.cluster_resources().get("GPU", 0) >= self.nproc
        backend = "nccl" if use_gpu else "gloo"
        bundle = {"CPU": 1, "GPU": 1} if use_gpu else {"CPU": 1}
        self._pg = placement_group([dict(bundle)] * self.nproc, strategy="PACK")
        ready, _ = ray.wait([self._pg.ready()], timeout=self._placement_timeout_s)
        if not ready:
            raise RuntimeError(
                f"Ray could not place {self.nproc} ranks of {bundle} within "
                f"{self._placement_timeout_s:.0f}s; cluster resources: {ray.cluster_resources()}"
            )
        actor_cls = ray.remote(_Rank)
        for rank in range(self.nproc):
            strategy = PlacementGroupSchedulingStrategy(
                placement_group=self._pg, placement_group_bundle_index=rank
            )
            self._actors.append(
                actor_cls.options(
                    num_cpus=1,
                    num_gpus=1 if use_gpu else 0,
                    scheduling_strategy=strategy,
                ).remote(rank, self.nproc, self._env)
            )
        ips = ray.get([a.node_ip.remote() for a in self._actors])
        master = (ips[0], ray.get(self._actors[0].free_port.remote()))
        local_ranks = [ips[:r].count(ip) for r, ip in enumerate(ips)]
        self._futures = [
            a.run.remote(
                master, local_ranks[r], backend, self._collective_timeout_s, fn, args, kwargs
            )
            for r, a in enumerate(self._actors)
        ]

    def _connect(self, ray: Any) -> None:
        common: dict[str, Any] = dict(
            log_to_driver=False,
            logging_level="WARNING",
            runtime_env={"env_vars": dict(self._env)},
        )
        address = self.address or os.environ.get("RAY_ADDRESS")
        if address:
            ray.init(address=address, **common)
            self.joined = address
            return
        try:
            # Ray's own rule picks the cluster: the one `ray start` runs on this machine, else a
            # private local instance. For the latter, every rank gets a CPU bundle even on a
            # machine with fewer cores (the demo's 2 ranks + coordinator on 2 cores).
            ray.init(
                include_dashboard=False, num_cpus=max(os.cpu_count() or 1, self.nproc), **common
            )
        except ValueError as e:
            if "existing cluster" not in str(e):
                raise
            # Ray found a running cluster, which refuses resource arguments: join it as it is.
            ray.init(**common)
            self.joined = "auto"

    # ---- supervise ---------------------------------------------------------------------------
    def poll(self) -> bool:
        """True once every rank has returned; raises `RankFailedError` (after shutting the job
        down) as soon as any rank fails."""
        if not self._futures:
            raise RuntimeError("this Ray job was never started")
        pending = [f for r, f in enumerate(self._futures) if r not in self._results]
        if pending:
            done, _ = self._ray.wait(pending, num_returns=len(pending), timeout=0)
            self._collect(done)
        return len(self._results) == self.nproc

    def wait(self, timeout_s: float | None = None) -> list[Any]:
        """Every rank's return value, in rank order. Raises `RankFailedError` on the first
        failure and `TimeoutError` (job shut down) after `timeout_s`."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while not self.poll():
            if deadline is not None and time.monotonic() > deadline:
                self.shutdown()
                raise TimeoutError(f"the Ray job did not finish within {timeout_s:.0f}s")
            pending = [f for r, f in enumerate(self._futures) if r not in self._results]
            self._ray.wait(pending, num_returns=1, timeout=1.0)
        return [self._results[r] for r in range(self.nproc)]

    def _collect(self, done: list[Any]) -> None:
        failures: dict[int, _Failure] = {}
        self._gather(done, failures)
        if not failures:
            return
        # Peers of the failed rank fail moments later (their collective loses its partner); give
        # them a moment so the report names the rank that failed first.
        deadline = time.monotonic() + self._failure_grace_s
        while len(self._results) + len(failures) < self.nproc and time.monotonic() < deadline:
            pending = [
                f
                for r, f in enumerate(self._futures)
                if r not in self._results and r not in failures
            ]
            ready, _ = self._ray.wait(pending, num_returns=1, timeout=0.1)
            self._gather(ready, failures)
        rank, first = min(failures.items(), key=lambda kv: kv[1].when)
        self.shutdown()
        raise RankFailedError(rank, first.summary)

    def _gather(self, done: list[Any], failures: dict[int, _Failure]) -> None:
        for ref in done:
            rank = self._futures.index(ref)
            try:
                value = self._ray.get(ref)
            except Exception as e:  # RayActorError: the actor process died
                value = _Failure(time.time(), f"its actor died: {_describe(e)}")
            if isinstance(value, _Failure):
                failures[rank] = value
            else:
                self._results[rank] = value

    # ---- stop --------------------------------------------------------------------------------
    def shutdown(self) -> None:
        """Kill every rank actor (the coordinator actor dies with rank 0's), remove the placement group, and stop Ray if
        this job started it. Safe to call more than once."""
        ray = self._ray
        if ray is None or not ray.is_initialized():
            return
        for actor in self._actors:
            try:
                ray.kill(actor, no_restart=True)
            except Exception:  # already dead: nothing left to stop
                pass
        self._actors = []
        if self._pg is not None:
            from ray.util.placement_group import remove_placement_group

            try:
                remove_placement_group(self._pg)
            except Exception:  # already removed
                pass
            self._pg = None
        if self._owns_ray:
            ray.shutdown()
            self._owns_ray = False


def launch(
    fn: Callable[..., Any],
    nproc: int,
    *,
    args: tuple[Any, ...] = (),
    kwargs: Mapping[str, Any] | None = None,
    **job_options: Any,
) -> list[Any]:
    """Run `fn(*args, **kwargs)` on `nproc` Ray ranks; every rank's result, in rank order.

    `job_options` go to `RayJob` (use_gpu, run_dir, address, env, timeouts).
    """
    job = RayJob(nproc, **job_options).start(fn, *args, **dict(kwargs or {}))
    try:
        return job.wait()
    finally:
        job.shutdown()
