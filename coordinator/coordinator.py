"""The coordinator: the I/O loop around the state machine of `coordinator_state.py`.

One thread runs `run()`. A pump thread is the only reader of the transport's inbox and hands each
message to a local queue, so the state machine can wait for "the next message or the vote
deadline" without store timeouts. Each batch of queued messages is taken in (votes and acks into
the state's tallies, requests through their step functions), then `_advance` asks the step
functions whether the phase moves on and carries out what they return. `_set_state` is the only
place the state changes. The decision is appended to the durable log before any rank or client
can read it.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any

from dist_quant.coordinator import coordinator_intake as intake
from dist_quant.coordinator import coordinator_state as cs
from dist_quant.coordinator.decide import settle_decision
from dist_quant.coordinator.decide_cancel import settle_cancel
from dist_quant.coordinator.decision_log import DecisionLog, DecisionLogError, begin_attempt
from dist_quant.coordinator.faults import CoordinatorKilled, Fault, inject
from dist_quant.coordinator.phases import Phase
from dist_quant.coordinator.protocol import (
    Ack,
    AckSummary,
    Alive,
    AliveSummary,
    Bundle,
    CancelDecision,
    CancelRequest,
    CancelVote,
    Decision,
    DecisionQuery,
    Hello,
    Mark,
    Message,
    ProtocolError,
    Reply,
    StatusQuery,
    Stop,
    SwitchRequest,
    Vote,
    VoteSummary,
    run_messages,
)
from dist_quant.coordinator.switch_log import SwitchLog
from dist_quant.coordinator.tally import RankValues
from dist_quant.coordinator.timing import BEAT_S, LEASE_S, check_lease, lead_time
from dist_quant.coordinator.transport import Transport, TransportError
from dist_quant.coordinator.wire import (
    INBOX,
    node_down_queue,
    rank_queue,
    reply_queue,
    seal,
    unseal,
)

_HISTORY = 16  # decisions kept for `status` and for ranks that ask for one again
# messages the pump takes from the inbox at once: a round of 2,048 nodes' bundles in a few
# round trips, each reply batch well under a megabyte
_PUMP_BATCH = 512


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
        lease_s: float = LEASE_S,
        relayed_nodes: Sequence[Sequence[int]] = (),
    ) -> None:
        """`commit_window_s`: a COMMIT whose logging ends later than this past the vote deadline
        is turned into ABORT. Ranks wait at least `decision_grace_s` past the deadline before
        giving up; keeping this window below that grace means no rank can have given up on a
        switch that the others then publish (attach uses half the grace). `lease_s`: a rank
        that owes its vote and was not heard from for this long aborts the switch at once.
        `relayed_nodes`: the ranks of each node whose lowest rank runs a `NodeRelay`; what goes
        to every rank goes to those relays once per node, the other ranks get it directly."""
        if world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {world_size}")
        check_lease(lease_s)
        self._out = transport
        self._inbox = transport.clone()
        self._token = token
        self._world = world_size
        self._tp_groups = tuple(tuple(g) for g in tp_groups)
        self._log = log
        self._faults = tuple(faults)
        self._commit_window_s = commit_window_s
        # the pump hands over each batch it popped as one item (a bundle or message, or why one
        # was refused, each): the main thread wakes once per batch, not once per message, which
        # at 16k ranks was a thread switch per node's bundle
        self._events: queue.SimpleQueue[list[Message | ProtocolError | TransportError]] = (
            queue.SimpleQueue()
        )
        self._state: cs.State = cs.Idle()
        self._latency_s: float | None = None  # request -> decision sent, last committed switch
        self._next_id = 1
        self._seen_requests: set[str] = set()
        self._recipe_keys = RankValues()  # what each rank runs, by its hello and acks
        self._history: deque[dict[str, Any]] = deque(maxlen=_HISTORY)
        self._say = SwitchLog(None)
        self._threads: list[threading.Thread] = []
        self._status_due: list[str] = []  # status queries of the batch being taken in
        self._lease_s = lease_s
        self._relays = {min(node): tuple(sorted(node)) for node in relayed_nodes}
        relayed = {r for node in relayed_nodes for r in node}
        self._direct = tuple(r for r in range(world_size) if r not in relayed)
        self._decided: dict[int, Decision] = {}  # switch id -> what ranks were sent, for queries
        self._marks: dict[int, float] = {}  # nonce -> when pushed, of the mark on its way
        self._next_nonce = 1
        self._drained_to = float("-inf")  # every message pushed before then is taken in
        self._fresh_drain = False
        # what a rank sends the coordinator, itself or through its node's relay, by class
        self._relayed: dict[type, Callable[[Any], None]] = {
            Vote: self._on_vote,
            Ack: self._on_ack,
            Alive: self._on_alive,
            Hello: self._on_hello,
            CancelVote: self._on_cancel_vote,
            VoteSummary: self._on_vote_summary,
            AckSummary: self._on_ack_summary,
            AliveSummary: self._on_alive_summary,
        }

    @property
    def phase(self) -> Phase:
        return self._state.phase

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
            self._events.put([Stop("coordinator")])
        for t in self._threads:
            t.join(timeout)

    # -- threads ---------------------------------------------------------------------------------

    def _pump(self) -> None:
        while True:
            try:
                # whatever is queued at once: on a store, one round trip for the lot
                batch = self._inbox.pop_many(INBOX, _PUMP_BATCH)
            except TransportError as e:
                self._events.put([e])
                return
            items: list[Message | ProtocolError | TransportError] = []
            for data in batch:
                try:
                    msg: Message | ProtocolError = unseal(data, self._token)
                except ProtocolError as e:
                    msg = e
                items.append(msg)
                if isinstance(msg, Stop):
                    break
            self._events.put(items)
            if isinstance(items[-1], Stop):
                return

    def run(self) -> None:
        try:
            while True:
                batch = self._next_batch()
                # Everything already queued is taken in before the phase moves on: one pass of
                # `_advance` per batch instead of per message, and a vote that sits in the queue
                # when the deadline passes is counted, not reported missing.
                while batch is not None:
                    for event in batch:
                        if isinstance(event, (Stop, TransportError)):
                            if isinstance(event, TransportError):
                                self._say.error(f"inbox lost, coordinator stops: {event}")
                            return
                        self._on_message(event)
                    try:
                        batch = self._events.get_nowait()
                    except queue.Empty:
                        batch = None
                if self._mark_due():
                    self._push_mark()
                self._advance()
                for request_id in self._status_due:  # answered as of after the batch
                    self._reply(Reply(request_id, "status", None, "", self._status()))
                self._status_due.clear()
        except CoordinatorKilled as e:
            self._say.warning(str(e), phase=self.phase.value)

    def _next_batch(self) -> list[Message | ProtocolError | TransportError] | None:
        """The pump's next batch, or None once the inbox is due to be drained (`_mark_due`)."""
        wake = self._wake_at()
        timeout = None if wake is None else max(wake - time.monotonic(), 0.0)
        try:
            return self._events.get(timeout=timeout)
        except queue.Empty:
            return None

    # -- draining the inbox ------------------------------------------------------------------------
    # A round's deadline, and a rank's silence, are judged only up to the time the inbox has been
    # read to: the coordinator pushes a `Mark` into its own inbox and, once the pump hands it back,
    # has taken in everything pushed before it. Queued votes are then never counted as missing.

    def _wake_at(self) -> float | None:
        """When the open round next needs a drain: its deadline, or (while votes are due) the
        next look for silent ranks. None while a mark is on its way or nothing is open."""
        if self._marks:
            return None
        state = self._state
        if isinstance(state, cs.Preparing):
            first_look = state.lease.since + self._lease_s
            look = max(first_look, self._drained_to + BEAT_S)
            return min(state.opened.deadline, look)
        if isinstance(state, cs.Cancelling):
            return state.deadline
        return None

    def _mark_due(self) -> bool:
        wake = self._wake_at()
        return wake is not None and time.monotonic() >= wake

    def _push_mark(self) -> None:
        nonce, pushed_at = self._next_nonce, time.monotonic()
        self._next_nonce += 1
        try:
            self._out.push(INBOX, seal(Mark(nonce), self._token))
        except TransportError as e:  # the inbox is gone: what the pump handed over is all there is
            self._say.warning(f"cannot drain the inbox: {e}")
            self._on_drained(pushed_at)
            return
        self._marks[nonce] = pushed_at

    def _on_drained(self, drained_to: float) -> None:
        self._drained_to = max(self._drained_to, drained_to)
        self._fresh_drain = True

    # -- the state machine -----------------------------------------------------------------------

    def _set_state(self, new: cs.State) -> None:
        """The only place the state changes; checked against the table."""
        old = self._state
        cs.check_transition(old, new)
        if new.phase is not old.phase:
            self._say.info(
                f"{old.phase.value} -> {new.phase.value}",
                switch_id=cs.switch_id_of(new),
                phase=new.phase.value,
            )
        self._state = new

    def _apply(self, step: cs.Step) -> None:
        """Carry out a step: the new state and its log lines; its record, durably; then its
        broadcast and last its reply, so a client that holds a result knows every rank can read
        the decision. A record that cannot be logged aborts the switch before anything is sent."""
        self._set_state(step.state)
        for note in step.notes:
            self._say.error(note, switch_id=cs.switch_id_of(step.state))
        if step.record is not None:
            inject(self._faults, "open", rank=None, switch_id=cs.switch_id_of(step.state))
            try:
                self._log.append(step.record)
            except DecisionLogError as e:
                self._say.error(f"cannot open the switch: {e}", switch_id=step.record["switch_id"])
                if step.reply is not None:
                    self._reply(step.reply)
                self._apply(cs.on_open_failed(step.state, str(e), now=time.monotonic()))
                return
        if step.broadcast is not None:
            self._broadcast(step.broadcast)
            if isinstance(step.state, cs.Preparing):  # silence counts from when all could read it
                step.state.lease.since = time.monotonic()
        if step.reply is not None:
            self._reply(step.reply)

    def _advance(self) -> None:
        """Move the phase on as far as the tallies and the clock allow."""
        while True:
            before = self._state
            if isinstance(before, cs.Deciding):
                self._record_and_announce(before)
            elif isinstance(before, cs.Cancelling):
                outcome = cs.cancel_outcome(before, drained_to=self._drained_to)
                if outcome is not None:
                    self._record_cancel(before, outcome)
            else:
                now, drained_to = time.monotonic(), self._drained_to
                if self._fresh_drain:  # once per drain: the look at every rank is O(ranks)
                    self._fresh_drain = False
                    self._apply(
                        cs.on_drained(
                            before,
                            now=now,
                            drained_to=drained_to,
                            lease_s=self._lease_s,
                            nodes=tuple(self._relays.values()),
                        )  # fmt: skip
                    )
                if self._state is before:
                    tallied = cs.on_tally(
                        before, now=now, drained_to=drained_to, tp_groups=self._tp_groups
                    )
                    self._apply(tallied)
                if isinstance(self._state, cs.Published) and self._state is not before:
                    self._history[-1]["published"] = True
                    switch_id = self._state.settled.switch_id
                    self._append_best_effort({"event": "published", "switch_id": switch_id})
            if self._state is before:
                return

    def _record_and_announce(self, state: cs.Deciding) -> None:
        """Log the decision durably, then make it visible to ranks and the client."""
        switch_id = state.decision.switch_id
        inject(self._faults, "decide", rank=None, switch_id=switch_id)
        t0 = time.monotonic()
        decision = self._log_settled(
            "decision",
            state.decision,
            settle_decision,
            state.opened.deadline,
            "cannot record the decision, aborting",
        )
        log_s = time.monotonic() - t0
        inject(self._faults, "publish", rank=None, switch_id=switch_id)
        self._history.append({**decision.to_dict(), "published": False})
        logged = cs.on_logged(state, decision, log_s=log_s)
        self._decided[switch_id] = logged.broadcast  # what a rank that asks again is sent
        while len(self._decided) > _HISTORY:
            del self._decided[min(self._decided)]
        self._apply(logged)
        if decision.commit:  # the next switch books its commit step by this one's latency
            self._latency_s = time.monotonic() - state.opened.opened_at

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

    def _record_cancel(self, state: cs.Cancelling, outcome: CancelDecision) -> None:
        """Log the cancel's outcome durably, then tell the ranks and the client (as a decision)."""
        outcome = self._log_settled(
            "cancel", outcome, settle_cancel, state.deadline,
            "cannot record the cancel, keeping the commit",
        )  # fmt: skip
        if outcome.cancelled:
            self._history[-1]["cancelled"] = True
        self._apply(cs.on_cancel_logged(state, outcome))

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

    def _where(self) -> dict[str, Any]:
        return {"switch_id": cs.switch_id_of(self._state), "phase": self.phase.value}

    def _on_message(self, msg: Message | ProtocolError) -> None:
        if isinstance(msg, ProtocolError):
            self._on_refused(msg)
            return
        take = self._relayed.get(type(msg))
        if take is not None:
            take(msg)
        elif isinstance(msg, (SwitchRequest, CancelRequest)):
            self._on_request(msg)
        elif isinstance(msg, StatusQuery):
            self._status_due.append(msg.request_id)
        elif isinstance(msg, Mark):
            pushed_at = self._marks.pop(msg.nonce, None)
            if pushed_at is not None:
                self._on_drained(pushed_at)
        elif isinstance(msg, Bundle):
            self._on_bundle(msg)
        elif isinstance(msg, DecisionQuery):
            decision = self._decided.get(msg.switch_id)
            if decision is not None and 0 <= msg.rank < self._world:
                self._out.push(rank_queue(msg.rank), seal(decision, self._token))
        else:
            self._say.warning(f"ignored unexpected {msg.kind} message")

    def _on_request(self, msg: SwitchRequest | CancelRequest) -> None:
        if msg.request_id in self._seen_requests:
            self._say.warning(f"ignored replayed request {msg.request_id}")
            return
        self._seen_requests.add(msg.request_id)
        now = time.monotonic()
        if isinstance(msg, CancelRequest):
            self._apply(cs.on_cancel_request(self._state, msg, now=now))
            return
        step = cs.on_request(
            self._state,
            msg,
            switch_id=self._next_id,
            world_size=self._world,
            now=now,
            lead_s=lead_time(self._world, self._latency_s),
        )
        if isinstance(step.state, cs.Preparing):
            self._next_id += 1
        self._apply(step)

    # What a rank sends the coordinator, itself or through its node's relay: one handler per
    # class, looked up once per message (once per run of a bundle), not by a chain of checks.

    def _on_vote(self, msg: Vote) -> None:
        # a YES is one line per rank per switch: debug, or thousands of ranks flood the log
        note = intake.take_vote(self._state, msg)
        level = logging.DEBUG if msg.yes else logging.INFO
        if self._say.isEnabledFor(level):
            self._say.log(level, note, **self._where())

    def _on_cancel_vote(self, msg: CancelVote) -> None:
        self._say.info(intake.take_cancel_vote(self._state, msg), **self._where())

    def _on_ack(self, msg: Ack) -> None:
        note = intake.take_ack(self._state, msg)
        if 0 <= msg.rank < self._world:
            self._recipe_keys.set(msg.rank, msg.recipe_key)
        if note:
            self._say.warning(note, **self._where(), step=msg.step)

    def _on_alive(self, msg: Alive) -> None:
        intake.take_alive(self._state, msg, now=time.monotonic())

    def _on_hello(self, msg: Hello) -> None:
        self._recipe_keys.set(msg.rank, msg.recipe_key)

    # A node's relay summarizes a uniform run of its ranks' votes (acks) as one message, taken in
    # as one range: the coordinator's work per switch is then O(nodes), not O(ranks).

    def _on_vote_summary(self, msg: VoteSummary) -> None:
        note = intake.take_vote_summary(self._state, msg, self._relays)
        level = logging.WARNING if note.startswith("refused") else logging.DEBUG
        if self._say.isEnabledFor(level):
            self._say.log(level, note, **self._where())

    def _on_alive_summary(self, msg: AliveSummary) -> None:
        note = intake.take_alive_summary(self._state, msg, self._relays, now=time.monotonic())
        if note:
            self._say.warning(note, **self._where())

    def _on_ack_summary(self, msg: AckSummary) -> None:
        note = intake.take_ack_summary(self._state, msg, self._relays)
        if note:
            self._say.warning(note, **self._where(), step=msg.step)
        if not intake.node_range_problem(msg, self._relays):  # as an ack, counted or late
            self._recipe_keys.set_range(msg.first, msg.last, msg.recipe_key)

    def _on_bundle(self, bundle: Bundle) -> None:
        """A node leader's relay checked each message against the token, and the bundle is
        sealed with it: take the messages in, in order, as if they had come one by one. A
        malformed run is dropped whole (its values are checked column by column)."""
        for run in bundle.runs:
            try:
                msgs = run_messages(run)
            except ProtocolError as e:
                self._say.warning(f"ignored a run of node {bundle.leader}'s bundle: {e}")
                continue
            take = self._relayed.get(type(msgs[0]))
            if take is None:
                kind = msgs[0].kind
                self._say.warning(f"ignored {kind} messages in node {bundle.leader}'s bundle")
                continue
            for msg in msgs:
                take(msg)

    def _on_refused(self, err: ProtocolError) -> None:
        unverified = getattr(err, "unverified", None)
        self._say.warning(f"refused: {err}")
        if isinstance(unverified, (SwitchRequest, StatusQuery, CancelRequest)):
            # Sealed with our token, which the client lacks; it reads the refusal unverified.
            reply = Reply(unverified.request_id, "refused", None, f"refused: {err}", {})
            self._reply(reply)

    # -- outputs ---------------------------------------------------------------------------------

    def _broadcast(self, msg: Message) -> None:
        data = seal(msg, self._token)
        pushes = [(node_down_queue(leader), data) for leader in self._relays]
        pushes += [(rank_queue(r), data) for r in self._direct]
        self._out.push_many(pushes)

    def _reply(self, reply: Reply) -> None:
        self._out.push(reply_queue(reply.request_id), seal(reply, self._token))

    def _status(self) -> dict[str, Any]:
        state = self._state
        switch_id = cs.switch_id_of(state)
        return {
            "phase": state.phase.value,
            "phase_text": state.phase.describe(switch_id, cs.step_of(state)),
            "open_switch": switch_id if state.phase.open else None,
            "waiting_for": cs.waiting_for(state),
            "world_size": self._world,
            "tp_groups": self._tp_groups,  # tuples: JSON writes them as the lists readers get
            "recipe_keys": {str(r): k for r, k in self._recipe_keys.as_dict().items()},
            "decisions": list(self._history),
            "log": str(self._log.path),
        }
