"""The switch protocol's messages: every message a client, the coordinator and the ranks send
each other, a frozen dataclass with a `kind` tag and a JSON round trip, and a node leader's
`Bundle` of its ranks' messages.

Everything here is free of threads, clocks and I/O. The rules over these messages live beside
this file: the coordinator's phases in `phases.py`, the decision rules in `decide.py` (and
`decide_cancel.py` for a cancel), the timing rules in `timing.py`, and what a client gets back in
`results.py`. The coordinator (`coordinator.py`) drives the phases; participants (`participant.py`)
send votes and acks; the wire format (`wire.py`) seals these messages with the job's token.

Message flow of one switch (see README.md for the diagram):

    client      -> coordinator : SwitchRequest
    coordinator -> every rank  : Prepare
    every rank  -> coordinator : Vote   (planned and cast off the training thread; while the
                                         plan runs, Alive at FIRST_BEAT_S, then every BEAT_S)
    coordinator -> decision log: Decision (flushed and fsynced first)
    coordinator -> every rank  : Decision
    coordinator -> client      : Reply(result)
    every rank  -> coordinator : Ack    (after publishing at step S)

Cancelling a committed switch before its step (a second vote over the same ranks):

    client      -> coordinator : CancelRequest
    coordinator -> every rank  : CancelPrepare
    every rank  -> coordinator : CancelVote (YES only while it has not reached step S; it then
                                 holds its publish at S until the cancel is decided)
    coordinator -> decision log: CancelDecision (flushed and fsynced first)
    coordinator -> every rank  : CancelDecision (cancelled: drop the candidate; else publish at S)
    coordinator -> client      : Reply(result)
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

from dist_quant.coordinator.schema import (
    ProtocolError,
    decode_fields,
    decode_run,
    fields_of,
    run_of,
)

RecipePayload = dict | str


@dataclass(frozen=True)
class Message:
    """Base of all protocol messages: a frozen dataclass with a `kind` tag and JSON round trip."""

    kind: ClassVar[str] = ""

    def to_dict(self) -> dict[str, Any]:
        return {"kind": self.kind, **fields_of(self)}

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True, separators=(",", ":"))

    @staticmethod
    def from_dict(d: Mapping[str, Any]) -> Message:
        if type(d) is not dict and not isinstance(d, Mapping):  # decoded JSON: no ABC check
            raise ProtocolError(f"message must be a JSON object, got {type(d).__name__}")
        kind = d.get("kind")
        cls = MESSAGE_TYPES.get(kind) if isinstance(kind, str) else None
        if cls is None:
            raise ProtocolError(f"unknown message kind {kind!r}; known: {sorted(MESSAGE_TYPES)}")
        return decode_fields(cls, d, kind)

    @staticmethod
    def from_json(text: str | bytes) -> Message:
        try:
            # the wire's JSON is ASCII (json.dumps escapes the rest): decoded here as UTF-8
            # rather than by json's guess among UTF-8, -16 and -32
            d = json.loads(text.decode() if type(text) is bytes else text)
        except (ValueError, UnicodeDecodeError) as e:
            raise ProtocolError(f"message is not valid JSON: {e}") from None
        return Message.from_dict(d)


@dataclass(frozen=True)
class SwitchRequest(Message):
    """Client -> coordinator: switch every rank to `recipe` (a recipe dict or built-in name)."""

    kind: ClassVar[str] = "request"
    request_id: str
    recipe: RecipePayload
    at_step: int | None
    timeout_s: float


@dataclass(frozen=True)
class StatusQuery(Message):
    """Client -> coordinator: report the open switch, recent decisions and each rank's recipe."""

    kind: ClassVar[str] = "status"
    request_id: str


@dataclass(frozen=True)
class Hello(Message):
    """Rank -> coordinator at attach: the rank is listening; `recipe_key` is what it runs now."""

    kind: ClassVar[str] = "hello"
    rank: int
    recipe_key: str


@dataclass(frozen=True)
class Prepare(Message):
    """Coordinator -> rank: plan and validate `recipe`, then vote."""

    kind: ClassVar[str] = "prepare"
    switch_id: int
    recipe: RecipePayload
    at_step: int | None
    timeout_s: float
    lead_s: float = 0.0  # how long ahead of its vote a rank holds the commit step (`hold_step`)


@dataclass(frozen=True)
class Vote(Message):
    """Rank -> coordinator. YES carries the plan digest (and its parts' digests), the last step
    the rank passed, and its hold step (`timing.hold_step`): the first boundary it will not pass
    undecided; the commit step is the largest over the ranks."""

    kind: ClassVar[str] = "vote"
    switch_id: int
    rank: int
    yes: bool
    digest: str
    last_step: int | None
    reason: str
    prepare_s: float
    hold_step: int | None = None
    part_digests: dict[str, str] = field(default_factory=dict)
    """Digest of each named part of the plan (a policy's rules: `ModelPlan.part_digests`), so a
    TP group whose digests differ is told which rules answer its ranks differently."""


@dataclass(frozen=True)
class Decision(Message):
    """Coordinator -> log, ranks: COMMIT at `step`, or ABORT with per-rank `reasons`."""

    kind: ClassVar[str] = "decision"
    switch_id: int
    commit: bool
    step: int | None
    reasons: dict[int, str] = field(default_factory=dict)
    summary: str = ""


@dataclass(frozen=True)
class Ack(Message):
    """Rank -> coordinator after step S: `ok` if the candidate was published."""

    kind: ClassVar[str] = "ack"
    switch_id: int
    rank: int
    step: int
    ok: bool
    error: str
    recipe_key: str


@dataclass(frozen=True)
class Reply(Message):
    """Coordinator -> client. `status` is "accepted", "refused", "result" or "status"."""

    kind: ClassVar[str] = "reply"
    request_id: str
    status: str
    switch_id: int | None
    error: str
    body: dict


@dataclass(frozen=True)
class Stop(Message):
    """Wakes a blocked reader (listener or coordinator inbox) so it can exit."""

    kind: ClassVar[str] = "stop"
    target: str


@dataclass(frozen=True)
class Alive(Message):
    """Rank -> coordinator, `FIRST_BEAT_S` after the Prepare reached it, then every `BEAT_S`,
    while the rank plans a switch it has not voted on yet:
    the process is alive and its listener reads. A rank heard from neither this nor a vote for
    `lease_s` is dead, stopped or cut off, and the switch aborts without waiting for its deadline."""

    kind: ClassVar[str] = "alive"
    switch_id: int
    rank: int


@dataclass(frozen=True)
class Bundle(Message):
    """Node leader -> coordinator: the messages its node's ranks sent it (votes, acks, `Alive`,
    hellos, cancel votes), each checked against the token by the leader, as one message: rank 0
    reads O(nodes) messages, not O(ranks)."""

    kind: ClassVar[str] = "bundle"
    leader: int
    runs: tuple[dict, ...]
    """The messages in the order the leader got them, each run of consecutive messages of one
    kind as one object: `{"kind": "vote", "count": 8, "each": {"rank": [8, 9, ...], ...},
    "same": {"switch_id": 4, "digest": "...", ...}}` (`bundle_runs`, `run_messages`). A node's
    votes (acks) of a switch come as one run: what its ranks agree on travels once per node."""

    @staticmethod
    def of(leader: int, messages: Sequence[Message]) -> Bundle:
        return Bundle(leader, bundle_runs(messages))


@dataclass(frozen=True)
class VoteSummary(Message):
    """Node leader -> coordinator, in a `Bundle`: ranks `first`..`last` of its node (consecutive)
    each voted YES on `switch_id` with the same digest (and part digests) after the same last
    step, each vote checked against the token by the leader. It carries what the coordinator
    uses of those votes, reduced the way each use needs: the commit step is the largest hold
    step (`hold_step`, the largest of the run's); the client is told the slowest plan
    (`prepare_s`).
    The coordinator takes it in as one item (`Tally.add_range`)."""

    kind: ClassVar[str] = "vote_summary"
    switch_id: int
    leader: int
    first: int
    last: int
    digest: str
    part_digests: dict[str, str]
    last_step: int
    hold_step: int
    prepare_s: float


@dataclass(frozen=True)
class AckSummary(Message):
    """Node leader -> coordinator, in a `Bundle`: ranks `first`..`last` of its node (consecutive)
    each published `switch_id` at `step` (ok, no error) and now run `recipe_key`."""

    kind: ClassVar[str] = "ack_summary"
    switch_id: int
    leader: int
    first: int
    last: int
    step: int
    recipe_key: str


@dataclass(frozen=True)
class AliveSummary(Message):
    """Node leader -> coordinator, in a `Bundle`: ranks `first`..`last` of its node (consecutive)
    each said they are alive while planning `switch_id` (`Alive`) since the leader's last
    bundle: while a node plans, its signs of life cost rank 0 one message per beat, not one per
    rank."""

    kind: ClassVar[str] = "alive_summary"
    switch_id: int
    leader: int
    first: int
    last: int


@dataclass(frozen=True)
class DecisionQuery(Message):
    """Rank -> coordinator, straight (not through its node leader): the rank reached its hold
    step without the decision of `switch_id`; the coordinator sends it again if it is logged."""

    kind: ClassVar[str] = "decision_query"
    switch_id: int
    rank: int


@dataclass(frozen=True)
class Mark(Message):
    """Coordinator -> its own inbox: once it comes back out, every message pushed before it has
    been read, so votes still missing at a deadline are really missing, not queued."""

    kind: ClassVar[str] = "mark"
    nonce: int


@dataclass(frozen=True)
class CancelRequest(Message):
    """Client -> coordinator: cancel the committed switch `switch_id` (None: the open one)."""

    kind: ClassVar[str] = "cancel_request"
    request_id: str
    switch_id: int | None
    timeout_s: float


@dataclass(frozen=True)
class CancelPrepare(Message):
    """Coordinator -> rank: may switch `switch_id`, committed for `step`, still be cancelled?"""

    kind: ClassVar[str] = "cancel_prepare"
    switch_id: int
    step: int
    timeout_s: float


@dataclass(frozen=True)
class CancelVote(Message):
    """Rank -> coordinator. YES: the rank has not reached `step` and holds its publish there."""

    kind: ClassVar[str] = "cancel_vote"
    switch_id: int
    rank: int
    yes: bool
    last_step: int | None
    reason: str


@dataclass(frozen=True)
class CancelDecision(Message):
    """Coordinator -> log, ranks: `cancelled` (every rank drops the candidate) or not (every
    rank publishes at `step` as committed), with per-rank `reasons`."""

    kind: ClassVar[str] = "cancel_decision"
    switch_id: int
    cancelled: bool
    step: int
    reasons: dict[int, str] = field(default_factory=dict)
    summary: str = ""


# Every message class by its `kind`, read off the classes themselves (each declares its own tag), so
# a new message needs no second registration.
MESSAGE_TYPES: dict[str, type[Message]] = {cls.kind: cls for cls in Message.__subclasses__()}
if len(MESSAGE_TYPES) != len(Message.__subclasses__()) or "" in MESSAGE_TYPES:
    raise TypeError("coordinator.protocol: every Message subclass needs its own non-empty kind")


def bundle_runs(messages: Sequence[Message]) -> tuple[dict, ...]:
    """`messages` as a `Bundle`'s runs: each run of consecutive messages of one kind as one."""
    runs: list[dict] = []
    start = 0
    for i in range(1, len(messages) + 1):
        if i == len(messages) or messages[i].kind != messages[start].kind:
            runs.append({"kind": messages[start].kind, **run_of(messages[start:i])})
            start = i
    return tuple(runs)


def run_messages(run: Mapping[str, Any]) -> list[Message]:
    """The messages of one run of a `Bundle`, each checked as `Message.from_dict` checks one;
    raises `ProtocolError` naming the kind, the field and the position of what is malformed."""
    if type(run) is not dict and not isinstance(run, Mapping):  # decoded JSON: no ABC check
        raise ProtocolError(f"a bundle's run must be a JSON object, got {type(run).__name__}")
    kind = run.get("kind")
    cls = MESSAGE_TYPES.get(kind) if isinstance(kind, str) else None
    if cls is None:
        raise ProtocolError(f"unknown message kind {kind!r}; known: {sorted(MESSAGE_TYPES)}")
    return decode_run(cls, run, kind)
