"""`attach(model)`: join a job's switch protocol; rank 0 also hosts the coordinator.

Three small all-gathers, at attach time only: each rank's TP peers and location (`locality.py`),
rank 0's endpoint (transport, address, token) with each node leader's store address (store jobs
across hosts, `node_store.py`), and each rank's "could I reach it" (so a coordinator, or a node
store, one rank cannot reach fails every rank at once, with one line naming the address and, for
the coordinator, the `host=` fix). It works however the group was initialised (env://, tcp://, file://, Ray actors): nothing
else is taken from the process group. After attach, no collective is ever issued by the
coordinator code.

- transport "store" (torchrun): rank 0 starts a TCPStore server of its own and the coordinator
  thread beside it, on 127.0.0.1 when every rank runs on its host, else on the address the other
  ranks reach it at (`locality.choose_host`), or on `host`; across hosts, the lowest rank of every
  other host with two ranks or more relays its node's messages and serves its node's queues from
  a store of its own on loopback, which its node's ranks connect to instead of rank 0's;
- transport "ray": rank 0 creates the named actor "dist_quant.coordinator" in a namespace of the
  job's own, on its node;
- "auto": "ray" when this process runs inside an initialised Ray, else "store".

Rank 0 writes `<run_dir>/coordinator.json` (mode 0600: address and token) and the decision log
`<run_dir>/decisions.jsonl`; the lowest rank of every other host writes the same
`coordinator.json` into its own run dir.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Sequence
from typing import Any

import torch.distributed as dist
from dist_quant.coordinator.decision_log import DecisionLog
from dist_quant.coordinator.endpoint import (
    ENDPOINT_FILE,
    LOG_FILE,
    remove_endpoint,
    resolve_run_dir,
    write_endpoint,
)
from dist_quant.coordinator.faults import Fault
from dist_quant.coordinator.guard import PrecisionGuard
from dist_quant.coordinator.guard_runner import GuardRunner, StepMonitor
from dist_quant.coordinator.job_host import JobHost, connect_endpoint
from dist_quant.coordinator.locality import Locality, choose_host, here, local_leaders
from dist_quant.coordinator.node_relay import NodeRelay, relayed_nodes
from dist_quant.coordinator.node_store import NodeStore, Route, node_led_by, route
from dist_quant.coordinator.participant import Participant
from dist_quant.coordinator.switch_requests import request_switch
from dist_quant.coordinator.timing import LEASE_S, check_lease
from dist_quant.coordinator.transport import (
    PairedTransport,
    Transport,
    TransportError,
    TransportKind,
)
from torch import nn

from dist_quant.binding import assign_role_names
from dist_quant.telemetry import Telemetry

TRANSPORTS = ("auto", *(k.value for k in TransportKind))
# A reachable coordinator answers in milliseconds; an unreachable one must fail the job quickly.
CONNECT_TIMEOUT_S = 5.0


def attach(
    model: Any,
    *,
    group: dist.ProcessGroup | None = None,
    tp_group: dist.ProcessGroup | Sequence[int] | None = None,
    transport: str = "auto",
    run_dir: str | os.PathLike[str] | None = None,
    host: str | None = None,
    planner: Callable[[Any, Any], Any] | None = None,
    recipe_loader: Callable[[dict | str], Any] | None = None,
    describe: Callable[[Any], str] | None = None,
    faults: Sequence[Fault] = (),
    decision_grace_s: float = 1.0,
    stats_interval: int = 0,
    guard: PrecisionGuard | None = None,
    lease_s: float = LEASE_S,
) -> Participant:
    """Attach this rank's `model` to the job's coordinator; call on every rank of `group`.

    `tp_group`: this rank's tensor/sequence-parallel group (a process group, or its ranks within
    `group`); ranks of one TP group must plan identical digests to commit. None: the rank alone.
    `planner` / `recipe_loader` / `describe` default to `dist_quant.runtime.plan_model`,
    `dist_quant.recipes.recipe_from_dict` and `dist_quant.runtime.recipe_key_of`.
    `stats_interval` > 0: FP8 telemetry every that many steps, reduced over `group`, written by
    rank 0 to `<run_dir>/fp8_stats.jsonl`. `guard`: a `PrecisionGuard` that rank 0 runs on what
    `participant.observe` reports (see coordinator/guard.py). Both need `participant.observe(step,
    loss=..., grad_norm=...)` after every step's backward, on every rank. `lease_s`: a rank
    that owes its vote on a switch and has not been heard from for this long (no vote, no sign
    of life) is taken for dead, stopped or cut off, and the switch aborts naming it (rank 0's
    value is the job's; at least 1 s). Raise it for a job whose training thread can hold the
    GIL for a second or more (a long C call that does not release it) while a switch is asked.
    """
    check_lease(lease_s)
    if guard is not None and not isinstance(guard, PrecisionGuard):
        raise ValueError(f"attach: guard must be a PrecisionGuard or None, got {guard!r}")
    telemetry = Telemetry(model, stats_interval=stats_interval, group=group, run_dir=run_dir)
    if not (dist.is_available() and dist.is_initialized()):
        raise ValueError(
            "attach: torch.distributed is not initialised; call init_process_group first"
        )
    if transport not in TRANSPORTS:
        raise ValueError(f"attach: transport {transport!r} is not one of {TRANSPORTS}")
    kind = _resolve_transport(transport)
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    if rank < 0:
        raise ValueError(f"attach: global rank {dist.get_rank()} is not a member of `group`")
    tp = _tp_ranks(group, tp_group, rank)
    if isinstance(model, nn.Module):
        assign_role_names(model)  # fixed here, not by the listener thread's first plan

    # Collective 1: everyone's TP peers and location (is the job on one host?).
    claims = _all_gather({"tp": tp, "where": here()}, world, group)
    localities = [c["where"] for c in claims]
    tp_groups = check_tp_groups([c["tp"] for c in claims])
    # Store jobs across hosts: each host's lowest rank relays its node's messages (node_relay.py)
    # and, off rank 0's host, serves its node's queues from a store of its own (node_store.py).
    nodes = relayed_nodes([loc.where for loc in localities]) if kind is TransportKind.STORE else ()
    host_side: JobHost | None = None
    node_store: NodeStore | None = None
    mine: dict[str, Any] = {}
    if rank == 0:
        try:
            bind, advertise, how = (
                ("", "", "") if kind is TransportKind.RAY else choose_host(host, localities)
            )
            host_side = JobHost.start(kind, bind, advertise, how, world, resolve_run_dir(run_dir))
            mine = {**host_side.endpoint, "reapply": host_side.reapply}
        except Exception as e:  # noqa: BLE001 - reported to every rank after the gather
            mine = {"error": f"rank 0 could not start the coordinator: {type(e).__name__}: {e}"}
    elif (led := node_led_by(rank, nodes)) is not None:
        try:
            node_store = NodeStore(rank, led)
            mine = {"node_store": node_store.address}
        except TransportError as e:
            mine = {"error": f"attach: {e}"}
    # Collective 2: rank 0's endpoint, and the address of each node leader's store.
    gathered = _all_gather(mine, world, group)
    errors = [g["error"] for g in gathered if "error" in g]
    if errors:
        for side in (host_side, node_store):
            if side is not None:
                side.close()
        more = f" (and {len(errors) - 1} other rank(s))" if len(errors) > 1 else ""
        raise RuntimeError(errors[0] + more)
    endpoint = gathered[0]
    stores = {r: g["node_store"] for r, g in enumerate(gathered) if "node_store" in g}
    way = route(rank, nodes, endpoint["address"], stores)
    rank_transport, problem, on_close = _join(endpoint, way, rank, localities, run_dir)
    relay_links: tuple[Transport, Transport] | None = None
    if not problem and way.leader == rank:
        relay_links, problem = _open_relay_links(endpoint, way, rank, localities)
    if host_side is not None and not problem:
        problem = host_side.connect_coordinator(
            tp_groups, tuple(faults), decision_grace_s / 2, nodes, lease_s
        )
    # Collective 3: did every rank reach the coordinator (and its node leader's store)? Every
    # rank fails together, or none.
    problems = [p for p in _all_gather(problem, world, group) if p]
    if problems:
        if rank_transport is not None:
            rank_transport.close()
        for link in relay_links or ():
            link.close()
        for fn in on_close:
            fn()
        for side in (host_side, node_store):
            if side is not None:
                side.close()
        more = f" (and {len(problems) - 1} other rank(s))" if len(problems) > 1 else ""
        raise TransportError(problems[0] + more)
    try:
        if host_side is not None:
            host_side.run_coordinator()
            on_close.append(host_side.close)
    except BaseException:
        rank_transport.close()
        if host_side is not None:
            host_side.close()
        raise
    if node_store is not None:  # closed after the relay stopped (Participant.close)
        on_close.append(lambda: node_store.close(token=endpoint["token"]))
    relay = None
    if relay_links is not None:
        relay = NodeRelay(*relay_links, token=endpoint["token"], leader=rank, ranks=way.node,
                          faults=faults)  # fmt: skip
    participant = Participant(
        model,
        rank=rank,
        transport=rank_transport,
        token=endpoint["token"],
        address=endpoint["address"],
        planner=planner,
        recipe_loader=recipe_loader,
        describe=describe,
        faults=faults,
        decision_grace_s=decision_grace_s,
        on_close=on_close,
        monitor=_monitor(telemetry if stats_interval else None, guard, model, run_dir, rank),
        reapply=endpoint.get("reapply", ()),
        upstream=way.upstream,
        relay=relay,
        # a leader's store dies with it: only the others of its node may need rank 0 straight
        coordinator_link=(
            (lambda: connect_endpoint(endpoint, connect_timeout_s=CONNECT_TIMEOUT_S))
            if way.behind_node_store and way.leader != rank
            else None
        ),
    )
    try:
        return participant.start()
    except BaseException:  # a re-applied recipe that no longer plans: the same on every rank
        rank_transport.close()
        if relay is not None:
            relay.stop(0.0)
        for fn in on_close:
            fn()
        raise


def _monitor(
    telemetry: Telemetry | None, guard: PrecisionGuard | None, model: Any, run_dir: Any, rank: int
) -> StepMonitor | None:
    """Telemetry on every rank, the guard on rank 0 (requesting through this job's endpoint like
    any client); None when neither is asked for, so step_boundary stays a lock and a flag."""
    runner = None
    if guard is not None and rank == 0:
        resolved = resolve_run_dir(run_dir)
        runner = GuardRunner(
            guard,
            model,
            log=DecisionLog(resolved / LOG_FILE),
            request=lambda recipe, timeout: request_switch(
                recipe, timeout_s=timeout, run_dir=resolved
            ),
        )
    if telemetry is None and runner is None:
        return None
    return StepMonitor(telemetry, runner)


def check_tp_groups(claims: Sequence[Sequence[int]]) -> tuple[tuple[int, ...], ...]:
    """Each rank's claimed TP peers -> the TP groups; every member must claim the same group."""
    world = len(claims)
    groups: dict[tuple[int, ...], None] = {}
    for r, claim in enumerate(claims):
        members = tuple(sorted(claim))
        if r not in members:
            raise ValueError(f"attach: rank {r}'s tp_group {list(members)} does not contain it")
        for m in members:
            if not 0 <= m < world:
                raise ValueError(f"attach: rank {r}'s tp_group names rank {m}, not in [0, {world})")
            if tuple(sorted(claims[m])) != members:
                raise ValueError(
                    f"attach: rank {r} puts rank {m} in tp_group {list(members)}, but rank {m} "
                    f"says its tp_group is {sorted(claims[m])}"
                )
        groups[members] = None
    return tuple(groups)


def _resolve_transport(transport: str) -> TransportKind:
    if transport != "auto":
        return TransportKind(transport)
    ray = sys.modules.get("ray")
    return TransportKind.RAY if ray is not None and ray.is_initialized() else TransportKind.STORE


def _tp_ranks(
    group: dist.ProcessGroup | None, tp_group: dist.ProcessGroup | Sequence[int] | None, rank: int
) -> tuple[int, ...]:
    if tp_group is None:
        return (rank,)
    if isinstance(tp_group, dist.ProcessGroup):
        global_ranks = dist.get_process_group_ranks(tp_group)
        if group is None:
            return tuple(sorted(global_ranks))
        try:
            return tuple(sorted(dist.get_group_rank(group, g) for g in global_ranks))
        except ValueError as e:
            raise ValueError(f"attach: tp_group has a rank outside `group`: {e}") from None
    return tuple(sorted(int(r) for r in tp_group))


def _all_gather(obj: Any, world: int, group: dist.ProcessGroup | None) -> list[Any]:
    gathered: list[Any] = [None] * world
    dist.all_gather_object(gathered, obj, group=group)
    return gathered


def _open_relay_links(
    endpoint: dict[str, Any], way: Route, rank: int, localities: list[Locality]
) -> tuple[tuple[Transport, Transport] | None, str]:
    """A node leader's relay pops a queue in its node's store and one in rank 0's, and a
    store-client connection has one reader: a connection to each (two to rank 0's store on rank
    0's host), opened inside attach's all-or-none window. Off rank 0's host this is the
    leader's, and its node's, first contact with rank 0. Returns ((local, upstream), problem
    text or "")."""
    try:
        local = _connect(endpoint, way.home)
    except TransportError as e:
        return (
            None,
            f"attach: rank {rank} cannot open its node relay's connection to {way.home}: {e}",
        )
    try:
        upstream = _connect(endpoint, way.job)
    except TransportError as e:
        local.close()
        return None, _unreachable(endpoint, rank, localities, e, "its node relay")
    return (local, upstream), ""


def _join(
    endpoint: dict[str, Any], way: Route, rank: int, localities: list[Locality], run_dir: Any
) -> tuple[Transport | None, str, list[Callable[[], None]]]:
    """Connect to the store holding this rank's queue (rank 0's, or its node leader's); a node's
    lowest rank also writes coordinator.json there. Returns (transport, problem text or "",
    cleanups)."""
    on_close: list[Callable[[], None]] = []
    try:
        first = _connect(endpoint, way.home)
        try:
            transport = PairedTransport(first, first.clone())  # the participant's second
        except BaseException:
            first.close()
            raise
    except TransportError as e:
        if not way.behind_node_store:
            return None, _unreachable(endpoint, rank, localities, e, "it"), on_close
        cause = str(e.__cause__ or e).strip().splitlines()[0]
        return (
            None,
            f"attach: rank {rank} cannot reach its node leader rank {way.leader}'s store at "
            f"{way.home} within {CONNECT_TIMEOUT_S:g} s ({cause})",
            on_close,
        )
    if rank != 0 and rank in local_leaders(localities):
        try:
            where = resolve_run_dir(run_dir)
            write_endpoint(where, {k: v for k, v in endpoint.items() if k != "reapply"})
            on_close.append(lambda: remove_endpoint(where, endpoint["token"]))
        except OSError as e:
            transport.close()
            return (
                None,
                f"attach: rank {rank} cannot write {ENDPOINT_FILE} into its run dir: {e}",
                [],
            )
    return transport, "", on_close


def _connect(endpoint: dict[str, Any], address: str) -> Transport:
    return connect_endpoint({**endpoint, "address": address}, connect_timeout_s=CONNECT_TIMEOUT_S)


def _unreachable(
    endpoint: dict[str, Any], rank: int, localities: list[Locality], e: TransportError, who: str
) -> str:
    """Attach's one message for a rank (`who`: it, or its node relay) that cannot reach rank 0:
    where the rank is, why rank 0 advertised that address, and the `host=` fix."""
    cause = str(e.__cause__ or e).strip().splitlines()[0]
    me = localities[rank].reach or localities[rank].where
    subject = f"rank {rank} (at {me})" if who == "it" else f"rank {rank}'s {who} (at {me})"
    return (
        f"attach: {subject} cannot reach the coordinator at {endpoint['address']} "
        f"within {CONNECT_TIMEOUT_S:g} s ({cause}); rank 0 advertised it because "
        f"{endpoint.get('chosen_by', '?')}. Pass attach(..., host=<an address of rank 0's host "
        "that every rank reaches>), e.g. the MASTER_ADDR every rank rendezvoused at"
    )
