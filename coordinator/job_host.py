"""What rank 0 hosts for a job: the transport's server side (a store server or the Ray actor) and
the coordinator, started inside attach's all-or-none window (`attach.py`); and `connect_endpoint`,
how every rank and the coordinator connect to that endpoint."""

from __future__ import annotations

import os
import secrets
from pathlib import Path
from typing import Any

from dist_quant.coordinator.coordinator import Coordinator
from dist_quant.coordinator.decision_log import DecisionLog, resume_schedule
from dist_quant.coordinator.endpoint import LOG_FILE, remove_endpoint, write_endpoint
from dist_quant.coordinator.faults import Fault
from dist_quant.coordinator.node_store import drain
from dist_quant.coordinator.timing import LEASE_S
from dist_quant.coordinator.transport import Transport, TransportError, TransportKind
from dist_quant.coordinator.transport_ray import (
    RayTransport,
    create_coordinator_actor,
    start_coordinator_in_actor,
    stop_coordinator_actor,
)
from dist_quant.coordinator.transport_store import StoreServer
from dist_quant.coordinator.transport_store_client import StoreClientTransport
from dist_quant.coordinator.wire import node_down_queue, node_queue, rank_queue


def connect_endpoint(endpoint: dict[str, Any], connect_timeout_s: float = 30.0) -> Transport:
    """How every rank (and rank 0's coordinator) connects to the job's endpoint. The store's
    plain-Python client does no reverse-DNS lookup and its clones share one connection
    (transport_store_client.py)."""
    if endpoint["transport"] == TransportKind.RAY:
        return RayTransport.connect(endpoint["address"])
    return StoreClientTransport(endpoint["address"], connect_timeout_s=connect_timeout_s)


class JobHost:
    """What rank 0 runs for the job: the transport's server side and the coordinator.

    Everything that can fail for local reasons (port, run_dir, endpoint file) happens in `start`,
    before the gather, so that every rank learns of it; a client that finds the endpoint before
    the coordinator thread runs just waits in the inbox queue."""

    def __init__(
        self, kind: TransportKind, endpoint: dict[str, Any], server: Any, run_dir: Path
    ) -> None:
        self.kind = kind
        self.endpoint = endpoint
        self._server = server
        self._run_dir = run_dir
        self._coordinator: Coordinator | None = None
        self._world = 0
        # the readers of this store that the drain stops: at first every rank's listener
        self._readers: tuple[str, ...] = ()
        self._readers_once_run: tuple[str, ...] = ()
        # switches a resumed job publishes again (the log's `restored` record), for every rank
        self.reapply = resume_schedule(DecisionLog(run_dir / LOG_FILE).records())

    @classmethod
    def start(
        cls,
        kind: TransportKind,
        bind: str,
        advertise: str,
        chosen_by: str,
        world: int,
        run_dir: Path,
    ) -> JobHost:
        token = secrets.token_hex(32)
        if kind is TransportKind.RAY:
            server, address = create_coordinator_actor(world)
        else:
            server = StoreServer(bind, advertise=advertise)
            address = server.address
        info = {
            "transport": kind.value,
            "address": address,
            "token": token,
            "chosen_by": chosen_by,
            "world_size": world,
            "log": str(run_dir / LOG_FILE),  # on rank 0's host
        }
        self = cls(kind, info, server, run_dir)
        self._world = world
        self._readers = tuple(rank_queue(r) for r in range(world))
        try:
            run_dir.mkdir(parents=True, exist_ok=True)
            if kind is TransportKind.RAY:
                import ray

                # clients join this cluster, not whichever `ray.init(address="auto")` finds first
                info["ray_address"] = ray.get_runtime_context().gcs_address
                # a client outside the cluster must use the same authentication (Ray >= 2.5x
                # turns token auth on by default and exports the mode to its workers)
                if os.environ.get("RAY_AUTH_MODE"):
                    info["ray_auth_mode"] = os.environ["RAY_AUTH_MODE"]
            write_endpoint(run_dir, info)
        except BaseException:
            self.close()
            raise
        return self

    def _drain_listeners(self) -> None:
        """Stop every listener and relay thread reading this store and wait (bounded) until each
        said so, so that closing the server leaves no peer blocked on it."""
        tx = connect_endpoint(self.endpoint)
        try:
            drain(tx, self.endpoint["token"], self._readers, expected=len(self._readers))
        finally:
            tx.close()

    def connect_coordinator(
        self,
        tp_groups: tuple[tuple[int, ...], ...],
        faults: tuple[Fault, ...],
        commit_window_s: float,
        relayed: tuple[tuple[int, ...], ...] = (),
        lease_s: float = LEASE_S,
    ) -> str:
        """Make the coordinator and open its connections (not yet started), inside attach's
        all-or-none window; returns the problem text, or ""."""
        world = sum(len(g) for g in tp_groups)  # the groups partition the ranks
        log_path = self._run_dir / LOG_FILE
        # once running, this store's readers: the listeners of the ranks whose queue it holds,
        # every relay's down thread, and the up thread of the relay on rank 0's host
        elsewhere = {r for node in relayed if 0 not in node for r in node}
        self._readers_once_run = (
            *(rank_queue(r) for r in range(world) if r not in elsewhere),
            *(node_down_queue(min(node)) for node in relayed),
            *(node_queue(0) for node in relayed if 0 in node),
        )
        self._start_args = (self.endpoint["token"], world, tp_groups, str(log_path), faults,
                            commit_window_s, lease_s)  # fmt: skip
        if self.kind is TransportKind.RAY:
            return ""  # the coordinator lives in the actor, beside its queues
        try:
            self._coordinator = Coordinator(
                connect_endpoint(self.endpoint),
                token=self.endpoint["token"],
                world_size=world,
                tp_groups=tp_groups,
                log=DecisionLog(log_path),
                faults=faults,
                commit_window_s=commit_window_s,
                relayed_nodes=relayed,
                lease_s=lease_s,
            )
        except TransportError as e:
            return (
                f"attach: rank 0 cannot connect its coordinator to the job's store at "
                f"{self.endpoint['address']}: {e}"
            )
        return ""

    def run_coordinator(self) -> None:
        if self.kind is TransportKind.RAY:
            start_coordinator_in_actor(self._server, *self._start_args)
        else:
            self._coordinator.start()
            self._readers = self._readers_once_run

    def close(self) -> None:
        remove_endpoint(self._run_dir, self.endpoint["token"])
        if self._coordinator is not None:
            self._coordinator.stop()
        try:
            self._drain_listeners()
        except TransportError:
            pass  # the server is gone already: nobody left to wait for
        try:
            if self.kind is TransportKind.RAY:
                stop_coordinator_actor(self._server)
            else:
                self._server.close()
        except TransportError:
            pass  # already gone
