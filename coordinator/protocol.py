"""The switch protocol: phases, messages, the pure `decide()` and the rules that settle it.

Everything here is free of threads, clocks and I/O, so it can be tested as tables. The coordinator
(`coordinator.py`) drives the phases; participants (`participant.py`) send votes and acks; the
wire format (`wire.py`) seals these messages with the job's token.

Message flow of one switch (see README.md for the diagram):

    client      -> coordinator : SwitchRequest
    coordinator -> every rank  : Prepare
    every rank  -> coordinator : Vote   (planned and cast off the training thread; while the
                                         plan runs, Alive every BEAT_S)
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

import itertools
import json
import math
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from enum import Enum
from typing import Any, ClassVar

from dist_quant.coordinator.schema import (
    ProtocolError,
    decode_fields,
    decode_run,
    fields_of,
    run_of,
)
from dist_quant.coordinator.tally import Tally


class Phase(Enum):
    """Phases of the coordinator; the current switch's phase, or IDLE before the first switch."""

    IDLE = "idle"
    PREPARING = "preparing"  # Prepare sent; collecting votes until all voted or the deadline
    DECIDING = "deciding"  # outcome known; being written to the decision log
    COMMITTED = "committed"  # COMMIT logged and sent; ranks publish at step S and ack
    PUBLISHED = "published"  # every rank acked the publish
    ABORTED = "aborted"  # ABORT sent (or logging failed); every rank dropped its candidate
    CANCELLING = "cancelling"  # COMMITTED, and a cancel is being voted on before step S
    CANCELLED = "cancelled"  # the cancel was logged and sent; every rank dropped its candidate

    @property
    def terminal(self) -> bool:
        """A terminal phase closes its switch: a new request may open the next one."""
        return self in (Phase.PUBLISHED, Phase.ABORTED, Phase.CANCELLED)

    @property
    def open(self) -> bool:
        return self in (Phase.PREPARING, Phase.DECIDING, Phase.COMMITTED, Phase.CANCELLING)

    def describe(self, switch_id: int | None, step: int | None) -> str:
        """The phase in words, for `dist-quant status` and refusals."""
        at = "" if step is None else f" at step {step}"
        return {
            Phase.IDLE: "idle: no switch requested yet",
            Phase.PREPARING: f"switch {switch_id}: ranks are voting",
            Phase.DECIDING: f"switch {switch_id}: the decision is being logged",
            Phase.COMMITTED: f"switch {switch_id}: committed, ranks publish{at}",
            Phase.PUBLISHED: f"switch {switch_id}: published{at} on every rank",
            Phase.ABORTED: f"switch {switch_id}: aborted, every rank kept its recipe",
            Phase.CANCELLING: f"switch {switch_id}: committed{at}, a cancel is being voted",
            Phase.CANCELLED: f"switch {switch_id}: cancelled before step {step}",
        }[self]


# Allowed transitions; anything else is a bug in the coordinator and raises.
TRANSITIONS: dict[Phase, frozenset[Phase]] = {
    Phase.IDLE: frozenset({Phase.PREPARING}),
    Phase.PREPARING: frozenset({Phase.DECIDING}),
    Phase.DECIDING: frozenset({Phase.COMMITTED, Phase.ABORTED}),
    Phase.COMMITTED: frozenset({Phase.PUBLISHED, Phase.CANCELLING}),
    Phase.CANCELLING: frozenset({Phase.CANCELLED, Phase.COMMITTED}),
    Phase.PUBLISHED: frozenset({Phase.PREPARING}),
    Phase.ABORTED: frozenset({Phase.PREPARING}),
    Phase.CANCELLED: frozenset({Phase.PREPARING}),
}

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
        if not isinstance(d, Mapping):
            raise ProtocolError(f"message must be a JSON object, got {type(d).__name__}")
        kind = d.get("kind")
        cls = MESSAGE_TYPES.get(kind) if isinstance(kind, str) else None
        if cls is None:
            raise ProtocolError(f"unknown message kind {kind!r}; known: {sorted(MESSAGE_TYPES)}")
        return decode_fields(cls, d, kind)

    @staticmethod
    def from_json(text: str | bytes) -> Message:
        try:
            d = json.loads(text)
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
    the rank passed and its measured seconds per step (0: not known yet)."""

    kind: ClassVar[str] = "vote"
    switch_id: int
    rank: int
    yes: bool
    digest: str
    last_step: int | None
    reason: str
    prepare_s: float
    step_s: float = 0.0
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
    """Rank -> coordinator, every `BEAT_S` while the rank plans a switch it has not voted on yet:
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
    step, which for one last step comes from the shortest step time measured (`step_s`: the
    smallest positive one, 0 if none was); the client is told the slowest plan (`prepare_s`).
    The coordinator takes it in as one item (`Tally.add_range`)."""

    kind: ClassVar[str] = "vote_summary"
    switch_id: int
    leader: int
    first: int
    last: int
    digest: str
    part_digests: dict[str, str]
    last_step: int
    step_s: float
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
    if not isinstance(run, Mapping):
        raise ProtocolError(f"a bundle's run must be a JSON object, got {type(run).__name__}")
    kind = run.get("kind")
    cls = MESSAGE_TYPES.get(kind) if isinstance(kind, str) else None
    if cls is None:
        raise ProtocolError(f"unknown message kind {kind!r}; known: {sorted(MESSAGE_TYPES)}")
    return decode_run(cls, run, kind)


def decide(
    prepare: Prepare,
    votes: Tally[Vote],
    tp_groups: Sequence[Sequence[int]],
    deadline_passed: bool,
) -> Decision | None:
    """The outcome of one switch from the votes so far (every rank of the tally's world is
    expected); None while it is still open.

    The switch stays open until every expected rank voted or the deadline passed. It commits only
    if every expected rank voted YES, digests agree within each tensor-parallel group, and (with a
    requested `at_step`) no rank has already passed that step. The commit step is the requested
    one, else the largest `hold_step` of the votes (each rank's last step, plus the steps that fit
    in `prepare.lead_s` at its rate): no rank passes its hold step undecided, so every rank can
    still reach the commit step. A node's `VoteSummary` stands for its ranks' YES votes: its
    last step and shortest step time give the largest hold step of those ranks exactly. A commit
    costs O(votes taken in one by one + summaries); ranks are listed one by one only to abort.
    """
    missing = votes.missing()
    if missing and not deadline_passed:
        return None
    reasons: dict[int, str] = {
        r: f"no vote before the deadline ({prepare.timeout_s:g} s)" for r in missing
    }
    for r, vote in votes.by_rank.items():
        if not vote.yes:
            reasons[r] = vote.reason or "voted no"
    summaries: list[VoteSummary] = [s for _, _, s in votes.ranges]
    yes = {r: v for r, v in votes.by_rank.items() if r not in reasons}
    if len({v.digest for v in yes.values()} | {s.digest for s in summaries}) > 1:
        # digests differ somewhere: each TP group is looked at, rank by rank
        digest_of: dict[int, Vote | VoteSummary] = dict(yes)
        for s in summaries:
            digest_of.update(dict.fromkeys(range(s.first, s.last + 1), s))
        for group in tp_groups:
            reasons.update(_digest_mismatches(group, digest_of, reasons))
    if prepare.at_step is not None:
        passed_at = [(r, v.last_step) for r, v in yes.items()]
        for s in summaries:
            if s.last_step >= prepare.at_step:
                passed_at += [(r, s.last_step) for r in range(s.first, s.last + 1)]
        for r, last in passed_at:
            if r not in reasons and last is not None and last >= prepare.at_step:
                reasons[r] = (
                    f"already passed step {last}, at or after the requested step {prepare.at_step}"
                )
    if reasons:
        summary = "; ".join(f"rank {r}: {reasons[r]}" for r in sorted(reasons))
        return Decision(prepare.switch_id, False, None, dict(sorted(reasons.items())), summary)
    if prepare.at_step is not None:
        step = prepare.at_step
    else:
        step = max(
            hold_step(v.last_step, v.step_s, prepare.lead_s, None)
            for v in itertools.chain(yes.values(), summaries)
        )
    return Decision(prepare.switch_id, True, step, {}, f"commit at step {step}")


BEAT_S = 0.5  # a rank planning a switch says it is alive this often (`Alive`)
LEASE_S = 2.0  # a rank silent this long while a vote is due is dead, stopped or cut off


def silent_ranks(
    owing: Sequence[int], heard: Mapping[int, float], *, since: float, drained_to: float,
    lease_s: float,
) -> list[int]:  # fmt: skip
    """The ranks of `owing` (those that owe a vote) heard from (vote, `Alive`; else since the Prepare went out
    at `since`) no later than `lease_s` before `drained_to`, the time up to which every message
    pushed to the coordinator has been read: so a message waiting in the queue never makes a live
    rank look silent."""
    cutoff = drained_to - lease_s
    if since > cutoff:
        return []
    return [r for r in owing if heard.get(r, since) <= cutoff]


MIN_LEAD_S = 0.05  # the commit step is booked at least this far ahead of the votes
LEAD_PER_RANK_S = 100e-6  # before a first measurement: the coordinator's cost per rank
MAX_LEAD_S = 10.0
MAX_LEAD_STEPS = 10_000  # however short a step: a rank is never held further ahead than this


def lead_time(world_size: int, last_latency_s: float | None) -> float:
    """How long ahead of the votes the commit step is booked (`Prepare.lead_s`): twice the
    request -> decision-sent time of the job's last committed switch, or before one, an estimate
    from the number of ranks; clamped to [MIN_LEAD_S, MAX_LEAD_S]."""
    if last_latency_s is None:
        lead = MIN_LEAD_S + world_size * LEAD_PER_RANK_S
    else:
        lead = 2.0 * last_latency_s
    return min(max(lead, MIN_LEAD_S), MAX_LEAD_S)


def hold_step(last_step: int, step_s: float, lead_s: float, at_step: int | None) -> int:
    """The first boundary a rank that voted YES after passing `last_step` may not pass without
    the decision: the requested `at_step`, else one past `last_step` plus as many whole steps (of
    `step_s` seconds, the rank's own rate) as fit in `lead_s`. The commit step is the largest of
    these over every rank, so no rank can have passed it undecided, and a rank waits only if it
    reaches its hold step before the decision arrives: a decision within `lead_s` of the vote
    keeps it waiting less than one step. Whole steps, not rounded up: a switch that is decided
    within a step still commits at the next boundary, as it would without a lead."""
    if at_step is not None:
        return at_step
    ahead = math.floor(lead_s / step_s) if step_s > 0 and lead_s > 0 else 0
    return last_step + 1 + min(ahead, MAX_LEAD_STEPS)


def _digest_mismatches(
    group: Sequence[int], votes: Mapping[int, Vote | VoteSummary], reasons: Mapping[int, str]
) -> dict[int, str]:
    """Ranks of a TP group whose YES digest differs from the group's strict majority, each with
    the plan parts (policy rules) that answer it differently."""
    if len({votes[r].digest for r in group if r in votes and r not in reasons}) <= 1:
        return {}  # the common case, checked without building the group's votes
    yes = {r: votes[r] for r in group if r in votes and r not in reasons}
    top, count = Counter(v.digest for v in yes.values()).most_common(1)[0]
    members = sorted(group)
    if count * 2 > len(yes):
        majority = next(v for v in yes.values() if v.digest == top)
        return {
            r: f"plan digest {v.digest[:12]} differs from TP group {members} majority {top[:12]}"
            + _differing_parts([v, majority])
            for r, v in yes.items()
            if v.digest != top
        }
    return {
        r: f"plan digests disagree within TP group {members} with no majority (this rank: "
        f"{v.digest[:12]})" + _differing_parts(list(yes.values()))
        for r, v in yes.items()
    }


def _differing_parts(votes: Sequence[Vote | VoteSummary]) -> str:
    """The named parts (policy rules) whose digests are not the same in all of `votes`."""
    names = sorted({name for v in votes for name in v.part_digests})
    differ = [n for n in names if len({v.part_digests.get(n) for v in votes}) > 1]
    if not differ:
        return ""
    return f"; the rules answering differently: {', '.join(map(repr, differ))}"


def decide_cancel(
    prepare: CancelPrepare,
    votes: Mapping[int, CancelVote],
    expected_ranks: Sequence[int],
    deadline_passed: bool,
) -> CancelDecision | None:
    """The outcome of cancelling a committed switch; None while votes are still due.

    Cancelled only if every expected rank voted YES before the deadline with a last step before
    the commit step (so none has published, and each holds its publish at that step until it
    hears the outcome). Otherwise the switch stays committed and every rank publishes as planned.
    """
    missing = [r for r in expected_ranks if r not in votes]
    if missing and not deadline_passed:
        return None
    reasons: dict[int, str] = {
        r: f"no cancel vote before the deadline ({prepare.timeout_s:g} s)" for r in missing
    }
    for r in expected_ranks:
        vote = votes.get(r)
        if vote is None:
            continue
        if not vote.yes:
            reasons[r] = vote.reason or "voted no"
        elif vote.last_step is not None and vote.last_step >= prepare.step:
            reasons[r] = f"already passed step {vote.last_step}, at or after step {prepare.step}"
    if reasons:
        summary = "not cancelled: " + "; ".join(f"rank {r}: {reasons[r]}" for r in sorted(reasons))
        return CancelDecision(
            prepare.switch_id, False, prepare.step, dict(sorted(reasons.items())), summary
        )
    return CancelDecision(
        prepare.switch_id, True, prepare.step, {}, f"cancelled before step {prepare.step}"
    )


def settle_decision(
    decision: Decision, *, log_error: str | None, logged_late_s: float, commit_window_s: float
) -> Decision:
    """The decision the ranks and the client hear, given how logging `decision` went.

    Two rules turn it into ABORT: the log could not record it (`log_error`; no rank may publish
    without a recorded decision), or a COMMIT was recorded `logged_late_s` after the vote deadline,
    more than `commit_window_s` (a rank may already have stopped waiting and kept its recipe).
    Returns `decision` itself when neither applies.
    """
    if log_error is not None:
        return Decision(decision.switch_id, False, None, dict(decision.reasons), log_error)
    if decision.commit and logged_late_s > commit_window_s:
        summary = (
            f"COMMIT was logged {logged_late_s:.2f} s after the vote deadline; aborted instead"
        )
        return Decision(decision.switch_id, False, None, {}, summary)
    return decision


def settle_cancel(
    outcome: CancelDecision,
    *,
    log_error: str | None,
    logged_late_s: float,
    commit_window_s: float,
) -> CancelDecision:
    """The cancel outcome the ranks and the client hear, given how logging `outcome` went: the
    same two rules as `settle_decision` keep the switch committed (a rank may already have stopped
    holding its publish at the commit step). Returns `outcome` itself when neither applies."""
    if log_error is not None:
        summary = f"not cancelled: {log_error}"
        return CancelDecision(outcome.switch_id, False, outcome.step, {}, summary)
    if outcome.cancelled and logged_late_s > commit_window_s:
        summary = f"not cancelled: the cancel was logged {logged_late_s:.2f} s after its deadline"
        return CancelDecision(outcome.switch_id, False, outcome.step, {}, summary)
    return outcome


@dataclass(frozen=True)
class CancelResult:
    """What `cancel_switch` returns: whether the switch was cancelled on every rank."""

    switch_id: int
    cancelled: bool
    step: int  # the commit step it was booked for
    reasons: dict[int, str]  # rank -> why it could not cancel (empty when cancelled)
    summary: str

    def to_dict(self) -> dict[str, Any]:
        return fields_of(self)

    @staticmethod
    def from_dict(d: Mapping[str, Any]) -> CancelResult:
        return decode_fields(CancelResult, d, "cancel result", strict=False)


@dataclass(frozen=True)
class SwitchResult:
    """What `request_switch` returns. An aborted switch is a result too (`committed=False`)."""

    switch_id: int
    committed: bool
    step: int | None  # the step at whose boundary every rank publishes (None if aborted)
    reasons: dict[int, str]  # rank -> why it could not switch (empty on commit)
    timings: dict[str, float]  # "votes_s" (open -> decided), "log_s" (fsync), "total_s"
    prepare_s: dict[int, float] = field(default_factory=dict)  # rank -> its plan + validate time
    summary: str = ""  # one line: "commit at step 12", or why it aborted
    # "first-last" -> the slowest plan + validate time of those ranks, for the ranks whose node's
    # relay summarized their votes (`VoteSummary`); the others are in `prepare_s`
    prepare_s_ranges: dict[str, float] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return fields_of(self)

    @staticmethod
    def from_dict(d: Mapping[str, Any]) -> SwitchResult:
        return decode_fields(SwitchResult, d, "switch result", strict=False)
