"""The coordinator: one explicit state machine over the switch phases of `protocol.Phase`.

One thread runs `run()`. A pump thread is the only reader of the transport's inbox and hands each
message to a local queue, so the state machine can wait for "the next message or the vote
deadline" without store timeouts. `_on_message` records votes, acks and requests; `_advance`
dispatches on the current phase and moves the switch on; `_transition` is the only place the phase
changes. The decision is appended to the durable log before any rank or client can read it.
"""

from __future__ import annotations

import queue
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from dist_quant.coordinator.faults import CoordinatorKilled, Fault, inject
from dist_quant.coordinator.log import DecisionLog, DecisionLogError, begin_attempt
from dist_quant.coordinator.logfmt import SwitchLog
from dist_quant.coordinator.protocol import (
    TRANSITIONS,
    Ack,
    CancelDecision,
    CancelPrepare,
    CancelRequest,
    CancelVote,
    Decision,
    Hello,
    Message,
    Phase,
    Prepare,
    ProtocolError,
    Reply,
    StatusQuery,
    Stop,
    SwitchRequest,
    SwitchResult,
    Vote,
    decide,
    decide_cancel,
    settle_cancel,
    settle_decision,
)
from dist_quant.coordinator.transport import Transport, TransportError
from dist_quant.coordinator.wire import INBOX, rank_queue, reply_queue, seal, unseal

_HISTORY = 16  # decisions kept for `status`


@dataclass
class _Switch:
    """Book-keeping of the open (or last) switch; only the coordinator thread touches it."""

    prepare: Prepare
    request_id: str
    opened_at: float
    deadline: float
    votes: dict[int, Vote] = field(default_factory=dict)
    acks: dict[int, Ack] = field(default_factory=dict)
    decision: Decision | None = None
    decided_at: float | None = None
    log_s: float = 0.0
    cancel: _Cancel | None = None


@dataclass
class _Cancel:
    """A cancel of the committed switch being voted on (phase CANCELLING)."""

    prepare: CancelPrepare
    request_id: str
    deadline: float
    votes: dict[int, CancelVote] = field(default_factory=dict)


class Coordinator:
    """Runs the switch protocol for `world_size` ranks whose TP groups are `tp_groups`."""

    def __init__(
        self,
        transport: Transport,
        *,
        token: str,
        world_size: int,
        tp_groups: Sequence[Sequence[int]],
        log: DecisionLog,
        faults: Sequence[Fault] = (),
        commit_window_s: float = 0.5,
    ) -> None:
        """`commit_window_s`: a COMMIT whose logging ends later than this past the vote deadline
        is turned into ABORT. Ranks wait at least `decision_grace_s` past the deadline before
        giving up; keeping this window below that grace means no rank can have given up on a
        switch that the others then publish (attach uses half the grace)."""
        if world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {world_size}")
        self._out = transport
        self._inbox = transport.clone()
        self._token = token
        self._ranks = range(world_size)  # O(1) membership: checked per vote and ack
        self._tp_groups = tuple(tuple(g) for g in tp_groups)
        self._log = log
        self._faults = tuple(faults)
        self._commit_window_s = commit_window_s
        self._events: queue.Queue[Message | ProtocolError | TransportError] = queue.Queue()
        self._phase = Phase.IDLE
        self._switch: _Switch | None = None
        self._next_id = 1
        self._seen_requests: set[str] = set()
        self._recipe_keys: dict[int, str] = {}
        self._history: deque[dict[str, Any]] = deque(maxlen=_HISTORY)
        self._say = SwitchLog(None)
        self._threads: list[threading.Thread] = []
        self._status_due: list[str] = []  # status queries of the batch being taken in

    @property
    def phase(self) -> Phase:
        return self._phase

    def start(self) -> None:
        """Record this attempt and recover the log, then start the pump and state-machine
        threads (daemons)."""
        try:
            attempt = begin_attempt(self._log)
            self._say.info(
                f"job {attempt['job_id']} attempt {attempt['attempt']} "
                f"({'resumed from a checkpoint' if attempt['resumed'] else 'clean start'})"
            )
        except DecisionLogError as e:  # every switch will abort with this reason; training runs
            self._say.error(f"cannot record this attempt: {e}")
        dangling = self._log.recover_open_switch()
        if dangling is not None:
            self._say.warning("closed as aborted after a restart", switch_id=dangling)
        self._next_id = self._log.last_switch_id() + 1
        for target, name in ((self._pump, "pump"), (self.run, "main")):
            t = threading.Thread(target=target, name=f"dist_quant.coordinator.{name}", daemon=True)
            t.start()
            self._threads.append(t)

    def stop(self, timeout: float = 5.0) -> None:
        """Ask both threads to end (through the inbox, which wakes the pump) and join them."""
        try:
            self._out.push(INBOX, seal(Stop("coordinator"), self._token))
        except TransportError:
            self._events.put(Stop("coordinator"))
        for t in self._threads:
            t.join(timeout)

    # -- threads ---------------------------------------------------------------------------------

    def _pump(self) -> None:
        while True:
            try:
                data = self._inbox.pop(INBOX)
            except TransportError as e:
                self._events.put(e)
                return
            try:
                msg: Message | ProtocolError = unseal(data, self._token)
            except ProtocolError as e:
                msg = e
            self._events.put(msg)
            if isinstance(msg, Stop):
                return

    def run(self) -> None:
        try:
            while True:
                event = self._next_event()
                # Everything already queued is taken in before the phase moves on: one pass of
                # `_advance` per batch instead of per message, and a vote that sits in the queue
                # when the deadline passes is counted, not reported missing.
                while event is not None:
                    if isinstance(event, (Stop, TransportError)):
                        if isinstance(event, TransportError):
                            self._say.error(f"inbox lost, coordinator stops: {event}")
                        return
                    self._on_message(event)
                    try:
                        event = self._events.get_nowait()
                    except queue.Empty:
                        event = None
                self._advance()
                for request_id in self._status_due:  # answered as of after the batch
                    self._reply(request_id, "status", None, body=self._status())
                self._status_due.clear()
        except CoordinatorKilled as e:
            self._say.warning(str(e), phase=self._phase.value)

    def _next_event(self) -> Message | ProtocolError | TransportError | None:
        """The next message, or None once the open switch's vote deadline has passed."""
        timeout = None
        sw = self._switch
        if self._phase is Phase.PREPARING and sw is not None:
            timeout = max(sw.deadline - time.monotonic(), 0.0)
        elif self._phase is Phase.CANCELLING and sw is not None and sw.cancel is not None:
            timeout = max(sw.cancel.deadline - time.monotonic(), 0.0)
        try:
            return self._events.get(timeout=timeout)
        except queue.Empty:
            return None

    # -- the state machine -----------------------------------------------------------------------

    def _transition(self, new: Phase) -> None:
        """The only place the phase changes."""
        if new not in TRANSITIONS[self._phase]:
            raise RuntimeError(f"coordinator bug: illegal transition {self._phase} -> {new}")
        switch_id = self._switch.prepare.switch_id if self._switch else None
        self._say.info(f"{self._phase.value} -> {new.value}", switch_id=switch_id, phase=new.value)
        self._phase = new

    def _advance(self) -> None:
        """Dispatch on the phase until it stops changing."""
        while True:
            before = self._phase
            sw = self._switch
            switch_id = sw.prepare.switch_id if sw is not None else None
            if self._phase is Phase.PREPARING and sw is not None:
                # decide() reads every vote: called once all are in (counted as they arrive,
                # so a switch costs O(ranks), not O(ranks^2)) or once the deadline passed
                passed = time.monotonic() >= sw.deadline
                complete = len(sw.votes) == len(self._ranks)
                decision = (
                    decide(sw.prepare, sw.votes, self._ranks, self._tp_groups, passed)
                    if complete or passed
                    else None
                )
                if decision is not None:
                    sw.decision, sw.decided_at = decision, time.monotonic()
                    self._transition(Phase.DECIDING)
            elif self._phase is Phase.DECIDING and sw is not None:
                self._record_and_announce(sw)
            elif self._phase is Phase.CANCELLING and sw is not None and sw.cancel is not None:
                passed = time.monotonic() >= sw.cancel.deadline
                votes = sw.cancel.votes
                outcome = (
                    decide_cancel(sw.cancel.prepare, votes, self._ranks, passed)
                    if passed or len(votes) == len(self._ranks)
                    else None
                )
                if outcome is not None:
                    self._record_cancel(sw, outcome)
            elif self._phase is Phase.COMMITTED and sw is not None:
                if len(sw.acks) == len(self._ranks):  # acks are kept from known ranks only
                    self._transition(Phase.PUBLISHED)
                    self._history[-1]["published"] = True
                    self._append_best_effort({"event": "published", "switch_id": switch_id})
            if self._phase is before:
                return

    def _record_and_announce(self, sw: _Switch) -> None:
        """Log the decision durably, then make it visible to ranks and the client."""
        decision = sw.decision
        switch_id = decision.switch_id
        inject(self._faults, "decide", rank=None, switch_id=switch_id)
        t0 = time.monotonic()
        decision = self._log_settled(
            "decision",
            decision,
            settle_decision,
            sw.deadline,
            "cannot record the decision, aborting",
        )
        sw.log_s = time.monotonic() - t0
        sw.decision = decision
        inject(self._faults, "publish", rank=None, switch_id=switch_id)
        self._transition(Phase.COMMITTED if decision.commit else Phase.ABORTED)
        self._history.append({**decision.to_dict(), "published": False})
        self._broadcast(decision)
        self._reply(sw.request_id, "result", switch_id, body=self._result(sw).to_dict())

    def _log_settled(
        self, event: str, outcome: Any, settle: Callable[..., Any], deadline: float, failure: str
    ) -> Any:
        """Log `outcome` durably and settle it by the protocol's abort rules (`settle`: a log
        that failed, or an outcome logged after the commit window); a changed outcome is reported
        and logged as well, best effort. Returns the settled outcome."""
        log_error = self._append_outcome(event, outcome)
        if log_error is not None:
            self._say.error(f"{failure}: {log_error}", switch_id=outcome.switch_id)
        settled = settle(
            outcome,
            log_error=log_error,
            logged_late_s=time.monotonic() - deadline,
            commit_window_s=self._commit_window_s,
        )
        if settled is not outcome:
            if log_error is None:
                self._say.error(settled.summary, switch_id=outcome.switch_id)
            self._append_best_effort({"event": event, **settled.to_dict()})
        return settled

    def _record_cancel(self, sw: _Switch, outcome: CancelDecision) -> None:
        """Log the cancel's outcome durably, then tell the ranks and the client (as a decision)."""
        cancel = sw.cancel
        outcome = self._log_settled(
            "cancel", outcome, settle_cancel, cancel.deadline,
            "cannot record the cancel, keeping the commit",
        )  # fmt: skip
        sw.cancel = None
        self._transition(Phase.CANCELLED if outcome.cancelled else Phase.COMMITTED)
        if outcome.cancelled:
            self._history[-1]["cancelled"] = True
        self._broadcast(outcome)
        self._reply(cancel.request_id, "result", outcome.switch_id, body=outcome.to_dict())

    def _append_outcome(self, event: str, outcome: Decision | CancelDecision) -> str | None:
        """Record a switch's or a cancel's outcome durably; the error text if the log failed."""
        try:
            self._log.append({"event": event, **outcome.to_dict()})
        except DecisionLogError as e:
            return str(e)
        return None

    def _append_best_effort(self, record: dict[str, Any]) -> None:
        """Records whose loss is harmless: an ABORT after a COMMIT that failed or came too late
        (the last decision record of a switch is its outcome) and the "published" marker."""
        try:
            self._log.append(record)
        except DecisionLogError as e:
            self._say.warning(
                f"could not log {record['event']}: {e}", switch_id=record["switch_id"]
            )

    # -- messages --------------------------------------------------------------------------------

    def _on_message(self, msg: Message | ProtocolError) -> None:
        if isinstance(msg, ProtocolError):
            self._on_refused(msg)
        elif isinstance(msg, SwitchRequest):
            self._on_request(msg)
        elif isinstance(msg, StatusQuery):
            self._status_due.append(msg.request_id)
        elif isinstance(msg, CancelRequest):
            self._on_cancel_request(msg)
        elif isinstance(msg, CancelVote):
            self._on_cancel_vote(msg)
        elif isinstance(msg, Vote):
            self._on_vote(msg)
        elif isinstance(msg, Ack):
            self._on_ack(msg)
        elif isinstance(msg, Hello):
            self._recipe_keys[msg.rank] = msg.recipe_key
        else:
            self._say.warning(f"ignored unexpected {msg.kind} message")

    def _on_refused(self, err: ProtocolError) -> None:
        unverified = getattr(err, "unverified", None)
        self._say.warning(f"refused: {err}")
        if isinstance(unverified, (SwitchRequest, StatusQuery, CancelRequest)):
            # Sealed with our token, which the client lacks; it reads the refusal unverified.
            self._reply(unverified.request_id, "refused", None, error=f"refused: {err}")

    def _on_request(self, req: SwitchRequest) -> None:
        sw = self._switch
        if req.request_id in self._seen_requests:
            self._say.warning(f"ignored replayed request {req.request_id}")
            return
        self._seen_requests.add(req.request_id)
        if self._phase.open and sw is not None:
            open_id = sw.prepare.switch_id
            step = sw.decision.step if sw.decision is not None else None
            hint = (
                f"; `dist-quant cancel {open_id}` cancels it"
                if self._phase is Phase.COMMITTED
                else ""
            )
            self._reply(
                req.request_id,
                "refused",
                open_id,
                error=f"switch {open_id} is still open ({self._phase.describe(open_id, step)}); "
                f"retry after it ends{hint}",
            )
            return
        problem = _request_problem(req)
        if problem:
            self._reply(req.request_id, "refused", None, error=problem)
            return
        switch_id, self._next_id = self._next_id, self._next_id + 1
        prepare = Prepare(switch_id, req.recipe, req.at_step, req.timeout_s)
        now = time.monotonic()
        self._switch = sw = _Switch(prepare, req.request_id, now, now + req.timeout_s)
        self._transition(Phase.PREPARING)
        self._reply(req.request_id, "accepted", switch_id)
        inject(self._faults, "open", rank=None, switch_id=switch_id)
        try:
            self._log.append({"event": "open", "request_id": req.request_id, **prepare.to_dict()})
        except DecisionLogError as e:
            self._say.error(f"cannot open the switch: {e}", switch_id=switch_id)
            sw.decision, sw.decided_at = Decision(switch_id, False, None, {}, str(e)), now
            self._transition(Phase.DECIDING)
            return
        self._broadcast(prepare)

    def _on_cancel_request(self, req: CancelRequest) -> None:
        if req.request_id in self._seen_requests:
            self._say.warning(f"ignored replayed request {req.request_id}")
            return
        self._seen_requests.add(req.request_id)
        sw = self._switch
        open_id = sw.prepare.switch_id if sw is not None and self._phase.open else None
        wanted = req.switch_id if req.switch_id is not None else open_id
        problem = ""
        if not (0 < req.timeout_s < float("inf")):
            problem = f"timeout_s must be a positive number of seconds, got {req.timeout_s}"
        elif open_id is None:
            problem = "no switch is open: nothing to cancel"
        elif wanted != open_id:
            problem = f"switch {wanted} is not the open switch ({open_id}); nothing to cancel"
        elif self._phase is not Phase.COMMITTED:
            problem = (
                f"switch {open_id} cannot be cancelled now "
                f"({self._phase.describe(open_id, None)}); only a committed switch can be"
            )
        if problem:
            self._reply(req.request_id, "refused", wanted, error=problem)
            return
        prepare = CancelPrepare(open_id, sw.decision.step, req.timeout_s)
        sw.cancel = _Cancel(prepare, req.request_id, time.monotonic() + req.timeout_s)
        self._transition(Phase.CANCELLING)
        self._reply(req.request_id, "accepted", open_id)
        self._broadcast(prepare)

    def _on_cancel_vote(self, vote: CancelVote) -> None:
        sw = self._switch
        cancel = sw.cancel if sw is not None else None
        where = {"switch_id": vote.switch_id, "phase": self._phase.value}
        if cancel is None or vote.switch_id != cancel.prepare.switch_id:
            self._say.info(f"ignored cancel vote of rank {vote.rank}: stale or too late", **where)
        elif vote.rank in self._ranks and vote.rank not in cancel.votes:
            cancel.votes[vote.rank] = vote
            self._say.info(
                f"rank {vote.rank} votes {'yes' if vote.yes else 'no'} to cancel", **where
            )

    def _on_vote(self, vote: Vote) -> None:
        sw = self._switch
        where = {"switch_id": vote.switch_id, "phase": self._phase.value}
        current = sw is not None and vote.switch_id == sw.prepare.switch_id
        if not current or self._phase is not Phase.PREPARING:
            self._say.info(f"ignored vote of rank {vote.rank}: stale or too late", **where)
        elif vote.rank not in self._ranks:
            self._say.warning(f"ignored vote from unknown rank {vote.rank}", **where)
        elif vote.rank in sw.votes:
            self._say.info(f"ignored repeated vote of rank {vote.rank}", **where)
        else:
            sw.votes[vote.rank] = vote
            self._say.info(f"rank {vote.rank} votes {'yes' if vote.yes else 'no'}", **where)

    def _on_ack(self, ack: Ack) -> None:
        sw = self._switch
        if sw is None or ack.switch_id != sw.prepare.switch_id or ack.rank in sw.acks:
            return
        if ack.rank not in self._ranks:
            self._say.warning(f"ignored ack from unknown rank {ack.rank}", switch_id=ack.switch_id)
            return
        sw.acks[ack.rank] = ack
        self._recipe_keys[ack.rank] = ack.recipe_key
        if not ack.ok:
            self._say.error(
                f"rank {ack.rank} failed to publish: {ack.error}",
                switch_id=ack.switch_id,
                phase=self._phase.value,
                step=ack.step,
            )

    # -- outputs ---------------------------------------------------------------------------------

    def _broadcast(self, msg: Message) -> None:
        data = seal(msg, self._token)
        for r in self._ranks:
            self._out.push(rank_queue(r), data)

    def _reply(
        self, request_id: str, status: str, switch_id: int | None, *, error: str = "", body=None
    ) -> None:
        reply = Reply(request_id, status, switch_id, error, body or {})
        self._out.push(reply_queue(request_id), seal(reply, self._token))

    def _result(self, sw: _Switch) -> SwitchResult:
        d = sw.decision
        decided = sw.decided_at if sw.decided_at is not None else sw.opened_at
        votes_s = decided - sw.opened_at
        return SwitchResult(
            switch_id=d.switch_id,
            committed=d.commit,
            step=d.step,
            reasons=dict(d.reasons),
            timings={"votes_s": votes_s, "log_s": sw.log_s, "total_s": votes_s + sw.log_s},
            prepare_s={r: v.prepare_s for r, v in sorted(sw.votes.items())},
            summary=d.summary,
        )

    def _status(self) -> dict[str, Any]:
        sw = self._switch
        switch_id = sw.prepare.switch_id if sw is not None else None
        step = sw.decision.step if sw is not None and sw.decision is not None else None
        return {
            "phase": self._phase.value,
            "phase_text": self._phase.describe(switch_id, step),
            "open_switch": sw.prepare.switch_id if sw and self._phase.open else None,
            "world_size": len(self._ranks),
            "tp_groups": [list(g) for g in self._tp_groups],
            "recipe_keys": {str(r): k for r, k in sorted(self._recipe_keys.items())},
            "decisions": list(self._history),
            "log": str(self._log.path),
        }


def _request_problem(req: SwitchRequest) -> str:
    if not (0 < req.timeout_s < float("inf")):
        return f"timeout_s must be a positive number of seconds, got {req.timeout_s}"
    if req.at_step is not None and req.at_step < 0:
        return f"at_step must be >= 0, got {req.at_step}"
    return ""
