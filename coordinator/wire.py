"""Wire format: protocol messages sealed with an HMAC of the job's token.

The stores and actors that carry messages have no authentication, and the token must never be
written into them. So a message travels as `{"m": <message JSON>, "mac": HMAC-SHA256(token, m)}`:
whoever can read the store sees requests and votes but cannot forge one, and a client with the
wrong token is refused by the coordinator. Replayed messages are the protocol's business (request
ids, switch ids and one vote per rank), not the wire's.

Queue names are fixed here so that every transport moves bytes between the same mailboxes.
"""

from __future__ import annotations

import hashlib
import hmac
import json

from dist_quant.coordinator.protocol import Message, ProtocolError

INBOX = "inbox"  # everything addressed to the coordinator
CLOSED = "closed"  # each rank's listener says here that it has stopped reading


def rank_queue(rank: int) -> str:
    """Mailbox of one rank's listener (Prepare, Decision, Stop)."""
    return f"rank/{rank}"


def node_queue(leader: int) -> str:
    """Mailbox of a node leader's relay: its node's ranks' messages for the coordinator."""
    return f"node/{leader}"


def node_down_queue(leader: int) -> str:
    """Mailbox of a node leader's relay: the coordinator's messages for every rank of the node."""
    return f"node/{leader}/down"


def reply_queue(request_id: str) -> str:
    """Mailbox of one client request."""
    return f"reply/{request_id}"


def _mac(token: str, payload: str) -> str:
    return hmac.new(token.encode(), payload.encode(), hashlib.sha256).hexdigest()


def seal(message: Message, token: str) -> bytes:
    payload = message.to_json()
    return json.dumps({"m": payload, "mac": _mac(token, payload)}).encode()


def unseal(data: bytes, token: str) -> Message:
    """Decode and authenticate; raises `ProtocolError` (with `.unverified` set when it parsed)."""
    try:
        outer = json.loads(data)
        payload, mac = outer["m"], outer["mac"]
        if not isinstance(payload, str) or not isinstance(mac, str):
            raise TypeError("fields 'm' and 'mac' must be strings")
    except (ValueError, KeyError, TypeError) as e:
        raise ProtocolError(f"unreadable sealed message: {e}") from None
    message = Message.from_json(payload)
    if not hmac.compare_digest(mac, _mac(token, payload)):
        err = ProtocolError(f"{message.kind} message refused: wrong token")
        err.unverified = message  # lets the coordinator tell a refused client why
        raise err
    return message
