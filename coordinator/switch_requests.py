"""Requesting a switch, and asking for status, from any process (a rank, a notebook, the CLI).

The client finds the job through `<run_dir>/coordinator.json`, or through `address` plus `token`
(or `$DIST_QUANT_TOKEN`). An aborted switch is a normal result (`committed=False`, with each
rank's reason); problems reaching or using the coordinator raise `SwitchRequestError`, and a
request refused because another switch is open raises `SwitchBusyError` naming that switch.
"""

from __future__ import annotations

import json
import math
import os
import secrets
from collections.abc import Callable
from typing import Any, NoReturn

from dist_quant.coordinator.endpoint import read_endpoint, resolve_run_dir
from dist_quant.coordinator.errors import CancelRefusedError, SwitchBusyError, SwitchRequestError
from dist_quant.coordinator.protocol import (
    CancelRequest,
    Message,
    ProtocolError,
    Reply,
    StatusQuery,
    SwitchRequest,
)
from dist_quant.coordinator.results import CancelResult, SwitchResult
from dist_quant.coordinator.transport import Transport, TransportError
from dist_quant.coordinator.transport_ray import RayTransport
from dist_quant.coordinator.transport_store_client import StoreClientTransport
from dist_quant.coordinator.wire import INBOX, reply_queue, seal, unseal

# How long to wait for the coordinator to accept a request, and how much longer than the switch
# timeout to wait for its result (the decision is due at the deadline; this covers the fsync).
ACCEPT_TIMEOUT_S = 10.0
RESULT_SLACK_S = 10.0
# A coordinator that is alive accepts a connection and answers the store's ping at once; a
# left-over coordinator.json of a job that ended points at a closed port (refused at once).
CONNECT_TIMEOUT_S = 2.0


def request_switch(
    recipe: Any,
    *,
    at_step: int | None = None,
    timeout_s: float = 60.0,
    run_dir: str | os.PathLike[str] | None = None,
    address: str | None = None,
    token: str | None = None,
    transport: Transport | None = None,
) -> SwitchResult:
    """Switch every rank of the job to `recipe` (a Recipe, its `to_dict()`, or a built-in name).

    Returns once the coordinator has decided (and logged) the outcome; with COMMIT every rank
    publishes at the boundary of `result.step`. `at_step` asks for that step; `timeout_s` bounds
    the vote (ranks that have not voted by then count as NO).
    """
    payload = _recipe_payload(recipe)
    if at_step is not None and (not isinstance(at_step, int) or at_step < 0):
        raise SwitchRequestError(f"at_step must be a non-negative int or None, got {at_step!r}")
    if not isinstance(timeout_s, (int, float)) or not (0 < timeout_s < math.inf):
        raise SwitchRequestError(f"timeout_s must be a positive number, got {timeout_s!r}")

    def refused(reply: Reply) -> NoReturn:
        if reply.switch_id is not None:
            raise SwitchBusyError(reply.error, reply.switch_id)
        raise SwitchRequestError(reply.error)

    body = _ask(
        lambda request_id: SwitchRequest(request_id, payload, at_step, float(timeout_s)),
        refused,
        timeout_s,
        (run_dir, address, token, transport),
    )
    return SwitchResult.from_dict(body)


def status(
    *,
    run_dir: str | os.PathLike[str] | None = None,
    address: str | None = None,
    token: str | None = None,
    transport: Transport | None = None,
    timeout_s: float = ACCEPT_TIMEOUT_S,
) -> dict[str, Any]:
    """The coordinator's view: phase, open switch, each rank's recipe key, recent decisions."""
    tx, key, where = _connect(run_dir, address, token, transport)
    try:
        request_id = secrets.token_hex(8)
        tx.push(INBOX, seal(StatusQuery(request_id), key))
        reply = _await(tx, request_id, key, timeout_s, where)
        if reply.status == "refused":
            raise SwitchRequestError(reply.error)
        return reply.body
    except TransportError as e:
        raise SwitchRequestError(f"lost the coordinator at {where}: {e}") from e
    except ProtocolError as e:
        raise SwitchRequestError(f"unreadable status from the coordinator at {where}: {e}") from e
    finally:
        if transport is None:
            tx.close()


def cancel_switch(
    switch_id: int | None = None,
    *,
    timeout_s: float = 10.0,
    run_dir: str | os.PathLike[str] | None = None,
    address: str | None = None,
    token: str | None = None,
    transport: Transport | None = None,
) -> CancelResult:
    """Cancel a switch that committed for a later step, on every rank at once.

    `switch_id` None cancels the open switch. Every rank votes (YES while it has not reached the
    commit step, holding its publish there until it hears the outcome); with every YES the cancel
    is logged and each rank drops the candidate, else the switch publishes as committed.
    `result.cancelled` says which. Raises `SwitchRequestError` if the request is refused (no
    committed switch to cancel: `CancelRefusedError`) or the job cannot be reached.
    """
    if switch_id is not None and (not isinstance(switch_id, int) or switch_id < 1):
        raise SwitchRequestError(f"switch_id must be a positive int or None, got {switch_id!r}")
    if not isinstance(timeout_s, (int, float)) or not (0 < timeout_s < math.inf):
        raise SwitchRequestError(f"timeout_s must be a positive number, got {timeout_s!r}")

    def refused(reply: Reply) -> NoReturn:
        raise CancelRefusedError(reply.error)

    body = _ask(
        lambda request_id: CancelRequest(request_id, switch_id, float(timeout_s)),
        refused,
        timeout_s,
        (run_dir, address, token, transport),
    )
    return CancelResult.from_dict(body)


def _ask(
    make_request: Callable[[str], Message],
    refused: Callable[[Reply], NoReturn],
    timeout_s: float,
    where_to: tuple[Any, Any, Any, Transport | None],
) -> dict[str, Any]:
    """One request to the coordinator: sent, accepted (else `refused(reply)` raises), answered
    within `timeout_s` (plus slack); the result's body. Connection and protocol failures are
    `SwitchRequestError`s naming the coordinator's address."""
    transport = where_to[3]
    tx, key, where = _connect(*where_to)
    try:
        request_id = secrets.token_hex(8)
        tx.push(INBOX, seal(make_request(request_id), key))
        accepted = _await(tx, request_id, key, ACCEPT_TIMEOUT_S, where)
        if accepted.status == "refused":
            refused(accepted)
        result = _await(tx, request_id, key, timeout_s + RESULT_SLACK_S, where, accepted.switch_id)
        return result.body
    except TransportError as e:
        raise SwitchRequestError(f"lost the coordinator at {where}: {e}") from e
    except ProtocolError as e:
        raise SwitchRequestError(f"unreadable result from the coordinator at {where}: {e}") from e
    finally:
        if transport is None:
            tx.close()


def _recipe_payload(recipe: Any) -> dict | str:
    payload = recipe.to_dict() if hasattr(recipe, "to_dict") else recipe
    if not isinstance(payload, (dict, str)):
        raise SwitchRequestError(
            "recipe must be a Recipe, a recipe dict or a built-in name, "
            f"got {type(recipe).__name__}"
        )
    try:
        json.dumps(payload)
    except (TypeError, ValueError) as e:
        raise SwitchRequestError(f"recipe is not JSON-serialisable: {e}") from None
    return payload


def _connect(
    run_dir: str | os.PathLike[str] | None,
    address: str | None,
    token: str | None,
    transport: Transport | None,
) -> tuple[Transport, str, str]:
    """(transport, token, a description of where) for the job the arguments point at."""
    if transport is not None or address is not None:
        key = token or os.environ.get("DIST_QUANT_TOKEN")
        if not key:
            raise SwitchRequestError(
                "a token is needed with address=: pass token= or set DIST_QUANT_TOKEN"
            )
        if transport is not None:
            return transport, key, "the given transport"
        return _open(address, {}, "the given address"), key, address
    directory = resolve_run_dir(run_dir)
    try:
        info = read_endpoint(directory)
    except FileNotFoundError:
        raise SwitchRequestError(
            f"no coordinator found: {directory}/coordinator.json does not exist (is the job "
            "running with attach()? `dist-quant` takes --run-dir DIR, Python run_dir=; or set "
            "DIST_QUANT_RUN_DIR)"
        ) from None
    except (OSError, ValueError) as e:
        raise SwitchRequestError(f"cannot read the coordinator endpoint: {e}") from None
    found = f"{directory}/coordinator.json"
    return _open(info["address"], info, found), token or info["token"], info["address"]


def _open(address: str, info: dict[str, Any], found: str) -> Transport:
    if address.startswith("ray://"):
        try:
            return RayTransport.connect(
                address,
                ray_address=info.get("ray_address"),
                ray_auth_mode=info.get("ray_auth_mode"),
            )
        except (TransportError, ValueError) as e:
            raise SwitchRequestError(str(e)) from e
    try:
        # plain Python, no torch: a client starts in a fraction of a second
        return StoreClientTransport(address, connect_timeout_s=CONNECT_TIMEOUT_S)
    except ValueError as e:
        raise SwitchRequestError(str(e)) from e
    except TransportError as e:
        cause = e.__cause__
        why = "timed out" if isinstance(cause, TimeoutError) else getattr(cause, "strerror", None)
        raise SwitchRequestError(
            f"no coordinator at {address} ({why or e}; taken from {found}): the job has ended "
            "or is not reachable from here"
        ) from None


def _await(
    tx: Transport,
    request_id: str,
    token: str,
    timeout: float,
    where: str,
    switch_id: int | None = None,
) -> Reply:
    data = tx.pop(reply_queue(request_id), timeout)
    if data is None:
        what = "answer" if switch_id is None else f"result for switch {switch_id}"
        raise SwitchRequestError(
            f"no {what} from the coordinator at {where} within {timeout:g} s; is the job alive? "
            "(`dist-quant status` shows the open switch)"
        )
    try:
        reply = unseal(data, token)
    except ProtocolError as e:
        unverified = getattr(e, "unverified", None)
        if isinstance(unverified, Reply) and unverified.status == "refused":
            raise SwitchRequestError(f"{unverified.error} (reply not verifiable)") from None
        raise
    if not isinstance(reply, Reply) or reply.request_id != request_id:
        raise ProtocolError(f"expected the reply to request {request_id}, got {reply.kind}")
    return reply
