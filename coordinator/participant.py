"""The per-rank participant: a background listener that votes, and `step_boundary` that publishes.

Ranks of a TP group meet in collectives every step, so a training thread that blocked waiting for
a peer's vote would deadlock that peer inside a collective. Hence votes are cast by the listener
thread: it blocks on the transport, plans + validates on a Prepare (building candidates, touching
nothing active), and votes YES with its digest and `last_step` (read under the lock together with
entering VOTED) or NO with the error text. The training thread only ever publishes, at the
boundary of the commit step S. A YES voter at step v waits (bounded) at boundary v+1 for the
decision; S >= v+1, so no rank passes S undecided.

Participant states (`_State`), changed only in `_set_state`:

    IDLE --Prepare--> PREPARING --yes--> VOTED --COMMIT--> COMMITTING --boundary S--> IDLE
                                 \\--no--> IDLE    \\--ABORT--> IDLE
                                                  \\--no decision in time--> GAVE_UP
    GAVE_UP --ABORT or next Prepare--> IDLE ;  GAVE_UP --COMMIT--> BROKEN (step_boundary raises)
    COMMITTING --CancelPrepare, before S--> CANCEL_VOTED --cancelled--> IDLE (candidate dropped)
                                            \\--not cancelled, or no outcome by S + grace--> COMMITTING
    (a rank that stopped waiting at S and published, then hears "cancelled": BROKEN)
"""

from __future__ import annotations

import atexit
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from enum import Enum
from typing import Any

from dist_quant.coordinator.errors import SwitchError
from dist_quant.coordinator.faults import Fault, inject
from dist_quant.coordinator.guard_runner import StepMonitor
from dist_quant.coordinator.logfmt import SwitchLog
from dist_quant.coordinator.protocol import (
    Ack,
    CancelDecision,
    CancelPrepare,
    CancelVote,
    Decision,
    Hello,
    Message,
    Prepare,
    ProtocolError,
    Stop,
    Vote,
)
from dist_quant.coordinator.transport import Transport, TransportError
from dist_quant.coordinator.wire import CLOSED, INBOX, rank_queue, seal, unseal


class _State(Enum):
    IDLE = "idle"
    PREPARING = "preparing"  # the listener plans; the training thread does not wait
    VOTED = "voted"  # voted YES; holds the candidate; waits at boundary v+1 for the decision
    COMMITTING = "committing"  # COMMIT known; publishes at boundary S
    CANCEL_VOTED = "cancel_voted"  # voted YES to cancel before S; holds its publish at S
    GAVE_UP = "gave_up"  # no decision in time; candidate dropped; a late COMMIT breaks the rank
    BROKEN = "broken"  # cannot stay consistent with the other ranks; step_boundary raises


# States in which step_boundary has nothing to do: the idle fast path.
_FAST = frozenset({_State.IDLE, _State.PREPARING, _State.GAVE_UP})


def _default_planner(model: Any, recipe: Any) -> Any:
    from dist_quant.runtime import plan_model

    return plan_model(model, recipe)


def _default_loader(payload: dict | str) -> Any:
    from dist_quant.recipes import recipe_from_dict

    return recipe_from_dict(payload)


def _default_describe(model: Any) -> str:
    from dist_quant.runtime import recipe_key_of

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
    ) -> None:
        """`reapply`: committed switches `{"switch_id", "step", "recipe"}` that a job resumed from
        a checkpoint taken before their step publishes again at that step (from the decision
        log's `restored` record, see `checkpoint_job`)."""
        self.rank = rank
        self.address = address
        self._model = model
        self._rx = transport  # the listener's connection
        self._tx = transport.clone()  # the training thread's (acks, close)
        self._token = token
        self._planner = planner or _default_planner
        self._loader = recipe_loader or _default_loader
        self._describe = describe or _default_describe
        self._faults = tuple(faults)
        self._grace = decision_grace_s
        self._on_close = tuple(on_close)
        self._monitor = monitor  # telemetry and the precision guard (guard_runner.py)
        self._closed = False
        self._say = SwitchLog(rank)
        self._lock = threading.Lock()
        self._cond = threading.Condition(self._lock)
        # Guarded by _lock:
        self._state = _State.IDLE
        self._nothing_pending = True  # self._state in _FAST, kept by _set_state for the fast path
        self._last_step: int | None = None
        self._switch_id = 0  # the newest switch this rank saw a Prepare for
        self._candidate: Any = None
        self._vote_step: int | None = None
        self._give_up_at = 0.0
        self._commit_step: int | None = None
        self._given_up: set[int] = set()
        self._cancel_give_up_at = 0.0
        self._cancel_given_up: set[int] = set()  # cancels this rank stopped waiting for at S
        self._decided: dict[
            int, tuple[bool, int | None]
        ] = {}  # switch id -> (commit, step) acted on
        self._broken_reason = ""
        self._reapply = deque(sorted(reapply, key=lambda e: e["step"]))
        self._listener = threading.Thread(
            target=self._listen, name=f"dist_quant.participant.r{rank}", daemon=True
        )

    def start(self) -> Participant:
        if self._reapply:
            self._schedule_reapply(None)
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
            self._tx.push(rank_queue(self.rank), seal(Stop(f"rank {self.rank}"), self._token))
        except TransportError:
            pass  # the store is gone, so the listener has already ended
        self._listener.join(timeout)
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
        return self._state.value

    # -- training thread -------------------------------------------------------------------------

    def step_boundary(self, step: int) -> None:
        """Call once per optimizer step, before its forward. Publishes a committed recipe at the
        commit step; otherwise a lock and a flag check (no network call, no collective)."""
        if self._monitor is not None:
            self._monitor.begin_step(step)  # a telemetry stats step starts counting here
        with self._lock:
            if self._last_step is None:
                self._cond.notify_all()  # a listener may wait for the first boundary
            self._last_step = step
            if self._nothing_pending:
                return
            publish = self._boundary_slow(step)
        if publish:
            self._publish(step)

    def observe(self, step: int, *, loss: Any = None, grad_norm: Any = None) -> Any:
        """Call after `step`'s backward on every rank when attached with `stats_interval` or a
        `guard`: ends a telemetry stats step (one collective) and, on rank 0, feeds the guard
        (rank 0's `loss` and `grad_norm`). Returns the guard's decision for this step, or None."""
        if self._monitor is None:
            return None
        return self._monitor.end_step(step, loss, grad_norm)

    def _boundary_slow(self, step: int) -> bool:
        """Called with the lock held; True when this boundary must publish the candidate."""
        if self._state is _State.BROKEN:
            raise SwitchError(self._broken_reason)
        if self._state is _State.VOTED:
            if step <= self._vote_step:
                return False
            self._say.info("waiting for the decision", **self._where(step))
            self._cond.wait_for(
                lambda: self._state is not _State.VOTED, max(self._give_up_at - time.monotonic(), 0)
            )
            if self._state is _State.VOTED:
                self._given_up.add(self._switch_id)
                self._candidate = None
                self._set_state(_State.GAVE_UP, step)
                self._say.warning(
                    "no decision in time: dropped the candidate, training on with the old recipe",
                    **self._where(step),
                )
                return False
            if self._state is _State.BROKEN:
                raise SwitchError(self._broken_reason)
        if self._state is _State.CANCEL_VOTED:
            if step < self._commit_step:
                return False
            self._say.info("waiting for the cancel decision", **self._where(step))
            self._cond.wait_for(
                lambda: self._state is not _State.CANCEL_VOTED,
                max(self._cancel_give_up_at - time.monotonic(), 0),
            )
            if self._state is _State.CANCEL_VOTED:
                self._cancel_given_up.add(self._switch_id)
                self._set_state(_State.COMMITTING, step)
                self._say.warning(
                    "no cancel decision in time: publishing the committed switch",
                    **self._where(step),
                )
            if self._state is _State.BROKEN:
                raise SwitchError(self._broken_reason)
        if self._state is _State.COMMITTING:
            if step < self._commit_step:
                return False
            if step > self._commit_step:
                self._break(
                    f"rank {self.rank} reached step {step} without a step_boundary at the commit "
                    f"step {self._commit_step} of switch {self._switch_id}; call step_boundary for "
                    "every step",
                    step,
                )
                raise SwitchError(self._broken_reason)
            return True
        return False

    def _publish(self, step: int) -> None:
        switch_id, plan = self._switch_id, self._candidate
        try:
            inject(self._faults, "commit", rank=self.rank, switch_id=switch_id)
            plan.publish()
            error = ""
        except Exception as e:  # noqa: BLE001 - any failure leaves this rank inconsistent
            error = f"{type(e).__name__}: {e}"
        with self._cond:
            self._candidate = None
            if error:
                self._break(f"rank {self.rank} failed to publish switch {switch_id}: {error}", step)
            else:
                self._set_state(_State.IDLE, step)
        self._say.info(f"published: {error or 'ok'}", **self._where(step))
        self._send(self._tx, Ack(switch_id, self.rank, step, not error, error, self._key()))
        if error:
            raise SwitchError(self._broken_reason)
        if self._reapply:
            self._schedule_reapply(step)

    def _schedule_reapply(self, step: int | None) -> None:
        """Hold the next re-applied switch as COMMITTING for its step, as if its COMMIT had just
        arrived (planned on the training thread: before training, or right after a publish)."""
        entry = self._reapply.popleft()
        plan = self._planner(self._model, self._loader(entry["recipe"]))
        with self._cond:
            self._switch_id = max(self._switch_id, entry["switch_id"])
            self._candidate, self._commit_step = plan, entry["step"]
            self._decided[entry["switch_id"]] = (True, entry["step"])
            self._set_state(_State.COMMITTING, step)
        self._say.info(f"re-applies switch {entry['switch_id']} at step {entry['step']}")

    # -- listener thread -------------------------------------------------------------------------

    def _listen(self) -> None:
        self._send(self._rx, Hello(self.rank, self._key()))
        while True:
            try:
                data = self._rx.pop(rank_queue(self.rank))
            except TransportError as e:
                busy = self._state not in (_State.IDLE, _State.GAVE_UP)
                (self._say.warning if busy else self._say.info)(f"coordinator unreachable: {e}")
                return
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
                self._on_decision(msg)
            elif isinstance(msg, CancelPrepare):
                self._on_cancel_prepare(msg)
            elif isinstance(msg, CancelDecision):
                self._on_cancel_decision(msg)
            else:
                self._say.warning(f"ignored unexpected {msg.kind} message")

    def _on_prepare(self, p: Prepare) -> None:
        with self._cond:
            if p.switch_id <= self._switch_id:
                self._say.info("ignored stale or replayed prepare", switch_id=p.switch_id)
                return
            busy = self._state not in (_State.IDLE, _State.GAVE_UP)
            busy_reason = f"still {self._state.value} for switch {self._switch_id}"
            last = self._last_step
            self._switch_id = p.switch_id
            if not busy:
                self._set_state(_State.PREPARING, last)
            received_at = time.monotonic()
        if busy:
            self._send(self._rx, Vote(p.switch_id, self.rank, False, "", last, busy_reason, 0.0))
            return
        with self._cond:
            started = self._cond.wait_for(lambda: self._last_step is not None, p.timeout_s)
        t0 = time.perf_counter()
        plan, digest, error = None, "", ""
        try:
            if not started:
                raise RuntimeError("training has not called step_boundary yet")
            inject(self._faults, "prepare", rank=self.rank, switch_id=p.switch_id)
            plan = self._planner(self._model, self._loader(p.recipe))
            digest = str(plan.digest)
        except Exception as e:  # noqa: BLE001 - any planning failure is this rank's NO
            plan, error = None, f"{type(e).__name__}: {e}"
        prepare_s = time.perf_counter() - t0
        with self._cond:
            last = self._last_step
            if plan is not None:
                self._candidate, self._vote_step = plan, last
                self._give_up_at = received_at + p.timeout_s + self._grace
                self._set_state(_State.VOTED, last)
            else:
                self._set_state(_State.IDLE, last)
        vote = Vote(p.switch_id, self.rank, plan is not None, digest, last, error, prepare_s)
        if inject(self._faults, "vote", rank=self.rank, switch_id=p.switch_id):
            self._say.warning("vote dropped (injected fault)", **self._where(last))
            return
        self._send(self._rx, vote)

    def _on_decision(self, d: Decision) -> None:
        ack = None
        with self._cond:
            step = self._last_step
            seen = self._decided.get(d.switch_id)
            if seen is not None:
                # a decision is acted on once: an identical replay (a retry, or a message read
                # twice from the store) changes nothing; a different one cannot come from a
                # correct coordinator
                if seen != (d.commit, d.step) and self._state is not _State.BROKEN:
                    self._break(
                        f"rank {self.rank} got two different decisions for switch {d.switch_id}",
                        step,
                    )
                else:
                    self._say.info("ignored a repeated decision", switch_id=d.switch_id)
                self._cond.notify_all()
                return
            if d.switch_id in self._given_up:
                self._given_up.discard(d.switch_id)
                if d.commit:
                    self._break(
                        f"rank {self.rank} gave up waiting for switch {d.switch_id} and kept its "
                        f"old recipe, but the coordinator recorded COMMIT at step {d.step}; other "
                        "ranks may have switched. Stop the job and restart from a checkpoint.",
                        step,
                    )
                    ack = Ack(d.switch_id, self.rank, -1, False, self._broken_reason, self._key())
                elif self._state is _State.GAVE_UP and d.switch_id == self._switch_id:
                    self._set_state(_State.IDLE, step)
            elif d.switch_id != self._switch_id:
                self._say.info("ignored decision of another switch", switch_id=d.switch_id)
            elif self._state is _State.VOTED:
                self._decided[d.switch_id] = (d.commit, d.step)
                if d.commit:
                    self._commit_step = d.step
                    self._set_state(_State.COMMITTING, step)
                else:
                    self._candidate = None
                    self._set_state(_State.IDLE, step)
            elif d.commit and self._state is not _State.BROKEN:
                # COMMIT for a switch this rank did not vote YES on: never sent by a correct
                # coordinator; continuing could run two recipes.
                self._break(
                    f"rank {self.rank} got COMMIT for switch {d.switch_id} without a YES vote", step
                )
            self._cond.notify_all()
        if ack is not None:
            self._send(self._rx, ack)

    def _on_cancel_prepare(self, p: CancelPrepare) -> None:
        with self._cond:
            last = self._last_step
            holding = (
                p.switch_id == self._switch_id
                and self._state is _State.COMMITTING
                and self._commit_step == p.step
            )
            if holding and (last is None or last < p.step):
                self._cancel_give_up_at = time.monotonic() + p.timeout_s + self._grace
                self._set_state(_State.CANCEL_VOTED, last)
                vote = CancelVote(p.switch_id, self.rank, True, last, "")
            elif holding:
                vote = CancelVote(p.switch_id, self.rank, False, last, f"reached step {last}")
            else:
                why = (
                    f"already published switch {p.switch_id} at step {p.step}"
                    if p.switch_id in self._decided and self._state is _State.IDLE
                    else f"not holding switch {p.switch_id} ({self._state.value})"
                )
                vote = CancelVote(p.switch_id, self.rank, False, last, why)
        self._send(self._rx, vote)

    def _on_cancel_decision(self, d: CancelDecision) -> None:
        with self._cond:
            step = self._last_step
            if d.switch_id in self._cancel_given_up:
                self._cancel_given_up.discard(d.switch_id)
                if d.cancelled:
                    self._break(
                        f"rank {self.rank} stopped waiting for the cancel of switch {d.switch_id} "
                        f"and published it at step {d.step}, but the coordinator recorded the "
                        "cancel; other ranks kept their recipe. Stop the job and restart from a "
                        "checkpoint.",
                        step,
                    )
            elif d.switch_id == self._switch_id and self._state is _State.CANCEL_VOTED:
                if d.cancelled:
                    self._candidate = None
                    self._set_state(_State.IDLE, step)
                else:
                    self._set_state(_State.COMMITTING, step)
            elif d.cancelled and d.switch_id == self._switch_id:
                # never sent by a correct coordinator without this rank's YES
                if self._state is not _State.BROKEN:
                    self._break(
                        f"rank {self.rank} got a cancel of switch {d.switch_id} it did not vote "
                        "for",
                        step,
                    )
            self._cond.notify_all()

    # -- helpers ---------------------------------------------------------------------------------

    def _set_state(self, new: _State, step: int | None) -> None:
        """The only place the state changes (callers hold the lock)."""
        if new is not self._state:
            self._say.info(
                f"{self._state.value} -> {new.value}",
                switch_id=self._switch_id,
                phase=new.value,
                step=step,
            )
            self._state = new
            self._nothing_pending = new in _FAST

    def _break(self, reason: str, step: int | None) -> None:
        self._broken_reason = reason
        self._set_state(_State.BROKEN, step)
        self._say.error(reason, **self._where(step))

    def _where(self, step: int | None) -> dict[str, Any]:
        return {"switch_id": self._switch_id, "phase": self._state.value, "step": step}

    def _key(self) -> str:
        try:
            return self._describe(self._model)
        except Exception as e:  # noqa: BLE001 - status only; never fail a switch over it
            return f"unknown ({type(e).__name__}: {e})"

    def _send(self, transport: Transport, msg: Message, queue: str = INBOX) -> None:
        try:
            transport.push(queue, seal(msg, self._token))
        except TransportError as e:
            self._say.warning(f"could not send {msg.kind}: {e}", switch_id=self._switch_id)
