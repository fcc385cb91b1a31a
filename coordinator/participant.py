"""The per-rank participant: a background listener that votes, and `step_boundary` that publishes.

Ranks of a TP group meet in collectives every step, so a training thread that blocked waiting for
a peer's vote would deadlock that peer inside a collective. Hence votes are cast by the listener
thread: it blocks on the transport, plans + validates on a Prepare (building candidates, touching
nothing active), and votes YES with its digest and `last_step` (read under the lock together with
entering VOTED) or NO with the error text. The training thread only ever publishes, at the
boundary of the commit step S. A YES voter at step v waits (bounded) at boundary v+1 for the
decision; S >= v+1, so no rank passes S undecided.

The participant's states, their payload, the transition table and the pure step functions that
change them are in `participant_state.py` (tested as tables in
tests/coordinator/test_participant_transitions.py); this file holds the threads and the lock, asks
those functions what to do, and does it: send the message, wait, publish, raise. `_set_state` is
the only place the state changes and checks every change against the table.
"""

from __future__ import annotations

import atexit
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from dist_quant.coordinator.errors import SwitchError
from dist_quant.coordinator.faults import Fault, inject
from dist_quant.coordinator.guard_runner import StepMonitor
from dist_quant.coordinator.node_relay import NodeRelay
from dist_quant.coordinator.participant_state import (
    AckDue,
    Boundary,
    Broken,
    Committing,
    Idle,
    Ledger,
    Preparing,
    RankPhase,
    State,
    Step,
    Voted,
    check_transition,
    on_boundary,
    on_cancel_decision,
    on_cancel_prepare,
    on_decision,
    on_planned,
    on_prepare,
    on_published,
    reapplying,
)
from dist_quant.coordinator.protocol import (
    Ack,
    Alive,
    CancelDecision,
    CancelPrepare,
    Decision,
    DecisionQuery,
    Hello,
    Message,
    Prepare,
    ProtocolError,
    Stop,
)
from dist_quant.coordinator.switch_log import SwitchLog
from dist_quant.coordinator.timing import BEAT_S, FIRST_BEAT_S, LEASE_S, PACE_STEPS, pace
from dist_quant.coordinator.transport import Transport, TransportError
from dist_quant.coordinator.wire import CLOSED, INBOX, rank_queue, seal, unseal

from dist_quant.recipes import recipe_from_dict
from dist_quant.runtime import plan_model, recipe_key_of

# How often a listener behind a node leader's store, holding a YES vote, checks that the store
# still answers. A leader that dies closes the connection, which wakes the listener at once; only
# a stopped (hung) leader needs the check, and its collectives hold the whole job until it resumes
# or the job restarts, so its node gains nothing by noticing faster than the lease. A check is a
# timed pop and its cancel (~0.1 ms of CPU); every BEAT_S, that comes to some 20 s of CPU for
# 4,096 simulated ranks that wait 25 s for a decision.
PROBE_S = LEASE_S


def _default_describe(model: Any) -> str:
    key = recipe_key_of(model)
    return "none" if key is None else repr(key)


class Participant:
    """One rank's side of the switch protocol. Made by `attach`; call `step_boundary` every step."""

    def __init__(
        self,
        model: Any,
        *,
        rank: int,
        transport: Transport,
        token: str,
        address: str = "",
        planner: Callable[[Any, Any], Any] | None = None,
        recipe_loader: Callable[[dict | str], Any] | None = None,
        describe: Callable[[Any], str] | None = None,
        faults: Sequence[Fault] = (),
        decision_grace_s: float = 1.0,
        on_close: Sequence[Callable[[], None]] = (),
        monitor: StepMonitor | None = None,
        reapply: Sequence[dict[str, Any]] = (),
        upstream: str = INBOX,
        relay: NodeRelay | None = None,
        coordinator_link: Callable[[], Transport] | None = None,
    ) -> None:
        """`reapply`: committed switches `{"switch_id", "step", "recipe"}` that a job resumed from
        a checkpoint taken before their step publishes again at that step (from the decision
        log's `restored` record, see `job_checkpoint`). `upstream`: where this rank's messages
        for the coordinator go (its node leader's relay queue in a job that spans hosts);
        `relay`: the relay this rank runs as its node's leader. `coordinator_link`: for a rank
        whose `transport` goes to its node leader's store (node_store.py), how to open a
        connection to the coordinator's store; opened only when the rank must ask for a decision
        its relay did not bring, closed once it has it (None: `transport` reaches the
        coordinator)."""
        self.rank = rank
        self.address = address
        self._model = model
        self._rx = transport  # the listener's connection
        self._tx = transport.clone()  # the training and planning threads' (acks, votes, close)
        self._tx_lock = threading.Lock()
        self._token = token
        self._planner = planner or plan_model
        self._loader = recipe_loader or recipe_from_dict
        self._describe = describe or _default_describe
        self._faults = tuple(faults)
        self._grace = decision_grace_s
        self._on_close = tuple(on_close)
        self._monitor = monitor  # telemetry and the precision guard (guard_runner.py)
        self._upstream = upstream
        self._relay = relay
        self._open_direct = coordinator_link
        self._home_lost = False  # the leader's store is gone: `_rx` is a connection to rank 0's
        self._closed = False
        self._say = SwitchLog(rank)
        self._alive_sent_for: int | None = None  # the switch this listener last said Alive in
        self._lock = threading.Lock()
        self._cond = threading.Condition(self._lock)
        # Guarded by _lock:
        self._state: State = Idle()
        self._ledger = Ledger(rank)
        self._nothing_pending = True  # not self._state.phase.pending: the boundary's fast path
        self._last_step: int | None = None
        self._last_boundary_at: float | None = None
        self._intervals: deque[float] = deque(maxlen=PACE_STEPS)  # the last steps' seconds
        self._waited_s = 0.0  # `boundary_wait_s`
        self._reapply = deque(sorted(reapply, key=lambda e: e["step"]))
        self._listener = threading.Thread(
            target=self._listen, name=f"dist_quant.participant.r{rank}", daemon=True
        )

    def start(self) -> Participant:
        if self._reapply:
            entry = self._reapply.popleft()
            plan = self._plan_reapply(entry)
            with self._cond:
                self._apply(reapplying(self._state, self._ledger, entry, plan), None)
        if self._relay is not None:
            self._relay.start()
        self._listener.start()
        # Rank 0 hosts the store: tearing it down during interpreter shutdown, under a listener
        # still blocked on it, aborts the process. Closing at exit stops everything in order.
        atexit.register(self.close)
        return self

    def close(self, timeout: float = 5.0) -> None:
        """Stop the listener (rank 0 also stops the coordinator and its store). Idempotent; runs
        at interpreter exit if not called."""
        if self._closed:
            return
        self._closed = True
        atexit.unregister(self.close)
        try:
            with self._tx_lock:
                self._tx.push(rank_queue(self.rank), seal(Stop(f"rank {self.rank}"), self._token))
        except TransportError:
            pass  # the store is gone, so the listener has already ended
        self._listener.join(timeout)
        if self._relay is not None:
            self._relay.stop(timeout)
        if self._monitor is not None:
            self._monitor.close()
        for fn in self._on_close:
            fn()
        self._tx.close()

    def __enter__(self) -> Participant:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def state(self) -> str:
        return self._state.phase.value

    @property
    def boundary_wait_s(self) -> float:
        """Seconds `step_boundary` has spent waiting on the protocol since attach: at a hold step
        reached undecided, or at the commit step with a cancel still open (each wait until the
        training thread holds the lock again). The stall the switch protocol itself cost this
        rank; the rest of a boundary is the rank's own CPU."""
        return self._waited_s

    # -- training thread -------------------------------------------------------------------------

    def step_boundary(self, step: int) -> None:
        """Call once per optimizer step, before its forward. Publishes a committed recipe at the
        commit step; otherwise a lock and a flag check (no network call, no collective)."""
        if self._monitor is not None:
            self._monitor.begin_step(step)  # a telemetry stats step starts counting here
        now = time.monotonic()
        with self._lock:
            if self._last_step is None:
                self._cond.notify_all()  # a listener may wait for the first boundary
            elif step == self._last_step + 1:  # a repeated or skipped boundary says nothing
                self._intervals.append(now - self._last_boundary_at)
            self._last_step, self._last_boundary_at = step, now
            if self._nothing_pending:
                return
            held = self._boundary_slow(step)
        if held is not None:
            self._publish(step, held)

    def observe(self, step: int, *, loss: Any = None, grad_norm: Any = None) -> Any:
        """Call after `step`'s backward on every rank when attached with `stats_interval` or a
        `guard`: ends a telemetry stats step (one collective) and, on rank 0, feeds the guard
        (rank 0's `loss` and `grad_norm`). Returns the guard's decision for this step, or None."""
        if self._monitor is None:
            return None
        return self._monitor.end_step(step, loss, grad_norm)

    def _boundary_slow(self, step: int) -> Committing | None:
        """Called with the lock held; the COMMITTING state to publish at this boundary, if any.
        Waits (the lock released) where `on_boundary` says so, then asks again."""
        while True:
            now = time.monotonic()
            todo = self._apply(on_boundary(self._state, self._ledger, step=step, now=now), step)
            if todo.boundary is Boundary.RAISE:
                raise SwitchError(self._broken_reason())
            if todo.boundary is Boundary.PUBLISH:
                return todo.state
            if todo.boundary is Boundary.PASS:
                return None
            began = time.monotonic()
            timeout = max(todo.wait_until - began, 0)
            self._cond.wait_for(lambda waiting=todo.state: self._state is not waiting, timeout)
            self._waited_s += time.monotonic() - began

    def _publish(self, step: int, held: Committing) -> None:
        try:
            inject(self._faults, "commit", rank=self.rank, switch_id=held.switch_id)
            held.candidate.publish()
            error = ""
        except Exception as e:  # noqa: BLE001 - any failure leaves this rank inconsistent
            error = f"{type(e).__name__}: {e}"
        # The next re-applied switch is planned before the state leaves COMMITTING, so that no
        # Prepare can slip in between (it gets a busy NO).
        then, plan_error = None, None
        if not error and self._reapply:
            entry = self._reapply.popleft()
            try:
                then = (entry, self._plan_reapply(entry))
            except Exception as e:  # noqa: BLE001 - raised below, once the publish is recorded
                plan_error = e
        with self._cond:
            done = on_published(
                self._state,
                self._ledger,
                switch_id=held.switch_id,
                step=step,
                error=error,
                then=then,
            )
            self._apply(done, step)
        self._say.info(f"published: {error or 'ok'}", **self._where(step))
        self._send(self._tx, done.send)
        if error:
            raise SwitchError(self._broken_reason())
        if plan_error is not None:
            raise plan_error

    def _plan_reapply(self, entry: Mapping[str, Any]) -> Any:
        """Plan a re-applied switch on the training thread (before training, or after a
        publish)."""
        return self._planner(self._model, self._loader(entry["recipe"]))

    # -- listener thread -------------------------------------------------------------------------

    def _listen(self) -> None:
        self._send(self._rx, Hello(self.rank, self._key()))
        try:
            self._read_until_stopped()
        finally:
            if self._home_lost:
                self._rx.close()  # rank 0 holds no connection of ours past the decision

    def _read_until_stopped(self) -> None:
        while True:
            current = self._state  # only this thread enters PREPARING
            if self._home_lost and not isinstance(current, (Preparing, Voted)):
                return  # decided: nothing else can come without the node's relay
            try:
                data = self._rx.pop(rank_queue(self.rank), self._beat(current))
                if data is None:
                    self._on_quiet(current)
            except TransportError as e:
                if self._read_rank_0_instead(self._state, e):
                    continue
                busy = not self._state.phase.accepts_prepare
                (self._say.warning if busy else self._say.info)(f"coordinator unreachable: {e}")
                return
            if data is None:
                if self._closed:
                    return  # reading rank 0's store, where nobody stops this listener
                continue
            try:
                msg: Message = unseal(data, self._token)
            except ProtocolError as e:
                self._say.warning(f"ignored message: {e}")
                continue
            if isinstance(msg, Stop):
                # Lets rank 0 close the store only once no listener is blocked on it.
                self._send(self._rx, Stop(f"rank {self.rank}"), CLOSED)
                return
            if isinstance(msg, Prepare):
                self._on_prepare(msg)
            elif isinstance(msg, Decision):
                with self._cond:
                    done = self._apply(on_decision(self._state, self._ledger, msg), self._last_step)
                    self._cond.notify_all()
                self._send(self._rx, done.send)
            elif isinstance(msg, CancelPrepare):
                with self._cond:
                    now, last = time.monotonic(), self._last_step
                    vote = on_cancel_prepare(
                        self._state, self._ledger, msg, last_step=last, now=now, grace_s=self._grace
                    )
                    self._apply(vote, last)
                self._send(self._rx, vote.send)
            elif isinstance(msg, CancelDecision):
                with self._cond:
                    self._apply(on_cancel_decision(self._state, self._ledger, msg), self._last_step)
                    self._cond.notify_all()
            else:
                self._say.warning(f"ignored unexpected {msg.kind} message")

    def _beat(self, state: State) -> float | None:
        """How long the listener may wait for a message: forever, except while it plans (it says
        it is alive FIRST_BEAT_S after the Prepare, then every BEAT_S) or, behind a node relay,
        while it holds a YES vote: once training waits at the hold step, a rank that can reach
        the coordinator asks it for the decision every BEAT_S; a rank behind its leader's store
        checks every PROBE_S that the store still answers (a timed pop it does not answer within
        the connection's timeout fails)."""
        if isinstance(state, Preparing):
            return BEAT_S if self._alive_sent_for == state.switch_id else FIRST_BEAT_S
        if isinstance(state, Voted) and self._upstream != INBOX:
            return BEAT_S if self._open_direct is None or self._home_lost else PROBE_S
        return None

    def _on_quiet(self, state: State) -> None:
        """Nothing arrived for a beat while `state` held."""
        if self._state is not state:
            return
        if isinstance(state, Preparing):
            self._send(self._rx, Alive(state.switch_id, self.rank))
            self._alive_sent_for = state.switch_id
        elif isinstance(state, Voted) and (self._last_step or 0) >= state.hold_step:
            # Waiting at the hold step: the node's relay may be gone with its leader. Behind a
            # leader's store, that store goes with it (`_read_rank_0_instead`): until then the
            # relay is trusted, so that thousands of waiting ranks do not all call rank 0.
            if self._open_direct is None or self._home_lost:
                self._send(self._rx, DecisionQuery(state.switch_id, self.rank), INBOX)

    def _read_rank_0_instead(self, state: State, error: TransportError) -> bool:
        """The node leader's store is gone (`rx` failed, or did not answer within its socket's
        timeout), and the leader with it: a rank still planning or holding a YES vote reads its
        queue in the coordinator's store from now on, on a connection opened now, and asks there
        for the decision; True if it does."""
        if (
            self._open_direct is None
            or self._home_lost
            or not isinstance(state, (Preparing, Voted))
        ):
            return False
        try:
            link = self._open_direct()
        except TransportError as e:
            self._say.warning(f"node leader's store lost ({error}), and the coordinator too: {e}")
            return False
        self._say.warning(
            f"node leader's store lost ({error}); asking the coordinator for the decision",
            **self._where(self._last_step),
        )
        self._rx.close()
        self._rx, self._home_lost = link, True
        return True

    def _on_prepare(self, p: Prepare) -> None:
        with self._cond:
            now, last = time.monotonic(), self._last_step
            opened = on_prepare(
                self._state, self._ledger, p, last_step=last, now=now, grace_s=self._grace
            )
            self._apply(opened, last)
        if opened.state.phase is not RankPhase.PREPARING:
            self._send(self._rx, opened.send)  # stale (nothing to send) or busy (a NO)
            return
        # Planned on a thread of its own, so the listener keeps reading (an ABORT frees this rank
        # for the next switch even if the plan never ends) and says the rank is alive meanwhile.
        threading.Thread(
            target=self._plan_and_vote,
            args=(p,),
            name=f"dist_quant.participant.r{self.rank}.plan{p.switch_id}",
            daemon=True,
        ).start()

    def _plan_and_vote(self, p: Prepare) -> None:
        with self._cond:
            started = self._cond.wait_for(lambda: self._last_step is not None, p.timeout_s)
        t0 = time.perf_counter()
        plan, digest, parts, error = None, "", {}, ""
        try:
            if not started:
                raise RuntimeError("training has not called step_boundary yet")
            inject(self._faults, "prepare", rank=self.rank, switch_id=p.switch_id)
            plan = self._planner(self._model, self._loader(p.recipe))
            digest, parts = str(plan.digest), dict(plan.part_digests)
        except Exception as e:  # noqa: BLE001 - any planning failure is this rank's NO
            plan, error = None, f"{type(e).__name__}: {e}"
        prepare_s = time.perf_counter() - t0
        with self._cond:
            last, step_s = self._last_step, pace(self._intervals)
            voted = on_planned(
                self._state,
                self._ledger,
                p,
                plan=plan,
                digest=digest,
                part_digests=parts,
                error=error,
                last_step=last,
                prepare_s=prepare_s,
                step_s=step_s,
            )
            self._apply(voted, last)
        if voted.send is None:
            return  # decided while planning: the plan was dropped
        if inject(self._faults, "vote", rank=self.rank, switch_id=p.switch_id):
            self._say.warning("vote dropped (injected fault)", **self._where(last))
            return
        self._send(self._tx, voted.send)

    # -- helpers ---------------------------------------------------------------------------------

    def _apply(self, step: Step, at: int | None) -> Step:
        """Take a step function's result (callers hold the lock): the new state and ledger, then
        its log lines."""
        self._set_state(step.state, at)
        self._ledger = step.ledger
        for note in step.notes:
            where = self._where(at)
            if note.switch_id is not None:
                where = {"switch_id": note.switch_id}
            getattr(self._say, note.level)(note.text, **where)
        return step

    def _set_state(self, new: State, step: int | None) -> None:
        """The only place the state changes (callers hold the lock); checked against the table."""
        old = self._state
        check_transition(old, new)
        if new.phase is not old.phase:
            self._say.info(
                f"{old.phase.value} -> {new.phase.value}",
                switch_id=self._ledger.newest,
                phase=new.phase.value,
                step=step,
            )
        self._state = new
        self._nothing_pending = not new.phase.pending

    def _broken_reason(self) -> str:
        state = self._state
        return state.reason if isinstance(state, Broken) else ""

    def _where(self, step: int | None) -> dict[str, Any]:
        return {"switch_id": self._ledger.newest, "phase": self._state.phase.value, "step": step}

    def _key(self) -> str:
        try:
            return self._describe(self._model)
        except Exception as e:  # noqa: BLE001 - status only; never fail a switch over it
            return f"unknown ({type(e).__name__}: {e})"

    def _send(
        self, transport: Transport, msg: Message | AckDue | None, queue: str | None = None
    ) -> None:
        """Push to `queue` (default: to the coordinator, through the relay or, once the leader's
        store is lost, straight from the listener) on the listener's connection (from the
        listener) or on `_tx`, which the training thread (acks) and the planning thread (votes)
        share under `_tx_lock`."""
        if msg is None:
            return
        queue = queue or (INBOX if self._home_lost and transport is self._rx else self._upstream)
        if isinstance(msg, AckDue):
            msg = Ack(msg.switch_id, self.rank, msg.step, msg.ok, msg.error, self._key())
        try:
            if transport is self._tx:
                with self._tx_lock:
                    transport.push(queue, seal(msg, self._token))
            else:
                transport.push(queue, seal(msg, self._token))
        except TransportError as e:
            self._say.warning(f"could not send {msg.kind}: {e}", switch_id=self._ledger.newest)
