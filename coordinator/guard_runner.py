"""The precision guard and the telemetry beside training: what `attach(..., guard=...,
stats_interval=...)` adds to `participant.step_boundary` and `participant.observe`.

`StepMonitor` runs on every rank: telemetry's stats step opens at `step_boundary(step)` and is
reduced (one collective over the job) at `observe(step, loss=..., grad_norm=...)`. On rank 0 it
also feeds `GuardRunner`, which turns each step into an `Observation`, asks the pure
`guard_decide`, logs the decision into `decisions.jsonl` (record kind `log.GUARD_RECORD`) and
sends the switch request from a thread of its own, so the training thread never waits for a
vote. The outcome is logged too; a request that cannot reach the coordinator is logged as
"unreachable" and training goes on with the recipe it has.

The recipe a decision asks for is derived from the base recipe, the one the model ran when the
guard first acted: offending layers -> `CustomRecipe(fp8_fallback(layers, to=..., base=base))`,
the whole model -> the built-in "bf16" or "current", undo -> the base itself.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

from dist_quant.coordinator.guard import (
    Action,
    GuardDecision,
    GuardState,
    Observation,
    PrecisionGuard,
    guard_decide,
    guard_resolve,
)
from dist_quant.coordinator.log import GUARD_RECORD, DecisionLog, DecisionLogError
from dist_quant.coordinator.logfmt import SwitchLog

from dist_quant.context import default_recipe
from dist_quant.factories import fp8_fallback
from dist_quant.recipes import CustomRecipe
from dist_quant.runtime import current_recipe
from dist_quant.telemetry import StatsRecord, Telemetry

CLOSE_WAIT_S = 5.0
Requester = Callable[[Any, float], Any]  # (recipe payload, timeout_s) -> SwitchResult


class GuardRunner:
    """Rank 0's guard: decisions from observations, logged, and requested through `request`."""

    def __init__(
        self, policy: PrecisionGuard, model: Any, *, log: DecisionLog, request: Requester
    ) -> None:
        if not isinstance(policy, PrecisionGuard):
            raise ValueError(f"guard must be a PrecisionGuard, got {type(policy).__name__}")
        self.policy = policy
        self._model = model
        self._log = log
        self._request = request
        self._lock = threading.Lock()
        self._state = GuardState()
        self._base: dict | str | None = None
        self._thread: threading.Thread | None = None
        self._say = SwitchLog(0)

    @property
    def state(self) -> GuardState:
        with self._lock:
            return self._state

    def observe(self, obs: Observation) -> GuardDecision | None:
        """One step; returns the decision made (its request runs in the background), or None."""
        with self._lock:
            decision, self._state = guard_decide(self.policy, self._state, obs)
        if decision is None:
            return None
        try:
            recipe = self._recipe_for(decision)
        except Exception as e:  # noqa: BLE001 - a guard never stops training
            self._record(decision, outcome="refused", reason=f"{type(e).__name__}: {e}")
            self._resolve(False)
            return decision
        self._record(decision, outcome="requested", recipe=recipe)
        self._thread = threading.Thread(
            target=self._send, args=(decision, recipe), name="dist_quant.guard", daemon=True
        )
        self._thread.start()
        return decision

    def wait(self, timeout: float | None = None) -> None:
        """Until the last request has an outcome (tests, shutdown)."""
        if self._thread is not None:
            self._thread.join(timeout)

    def _recipe_for(self, d: GuardDecision) -> dict | str:
        if self._base is None:
            base = current_recipe(self._model) or default_recipe()
            self._base = base.to_dict()  # raises for a factory that cannot be serialised
        if d.action is Action.LAYERS:
            return CustomRecipe(fp8_fallback(d.layers, to=d.target, base=self._base)).to_dict()
        if d.action is Action.MODEL:
            return d.target
        return self._base

    def _send(self, decision: GuardDecision, recipe: dict | str) -> None:
        try:
            result = self._request(recipe, self.policy.switch_timeout_s)
        except Exception as e:  # noqa: BLE001 - unreachable or busy: log, keep training
            self._record(decision, outcome="unreachable", reason=f"{type(e).__name__}: {e}")
            self._resolve(False)
            return
        reasons = {str(r): why for r, why in (result.reasons or {}).items()}
        self._record(
            decision,
            outcome="committed" if result.committed else "aborted",
            switch_id=result.switch_id,
            commit_step=result.step,
            reasons=reasons,
        )
        self._resolve(bool(result.committed))

    def _resolve(self, committed: bool) -> None:
        with self._lock:
            self._state = guard_resolve(self._state, committed)

    def _record(self, decision: GuardDecision, **outcome: Any) -> None:
        record = {"event": GUARD_RECORD, **decision.to_record(), **outcome}
        self._say.info(
            f"guard: {decision.trigger.value} -> {decision.action.value} "
            f"{list(decision.layers) or decision.target}: {outcome.get('outcome')}",
            step=decision.step,
        )
        try:
            self._log.append(record)
        except DecisionLogError as e:
            self._say.warning(f"guard: could not log its decision: {e}", step=decision.step)


def saturation_by_module(record: StatsRecord | None) -> tuple[tuple[str, float], ...] | None:
    """Each module's largest slot saturation fraction on a stats step; None on other steps."""
    if record is None:
        return None
    worst: dict[str, float] = {}
    for s in record.slots:
        worst[s.module] = max(worst.get(s.module, 0.0), s.saturated_fraction)
    return tuple(sorted(worst.items()))


class StepMonitor:
    """Telemetry (every rank) and the guard (rank 0) at the step boundaries of one participant."""

    def __init__(self, telemetry: Telemetry | None, guard: GuardRunner | None) -> None:
        self.telemetry = telemetry
        self.guard = guard

    def begin_step(self, step: int) -> None:
        if self.telemetry is not None:
            self.telemetry.begin_step(step)

    def end_step(self, step: int, loss: Any, grad_norm: Any) -> GuardDecision | None:
        record = self.telemetry.end_step() if self.telemetry is not None else None
        if self.guard is None:
            return None
        obs = Observation(step, _as_float(loss), _as_float(grad_norm), saturation_by_module(record))
        return self.guard.observe(obs)

    def close(self) -> None:
        """Drops an open stats step; gives the guard's last request a few seconds to end, so its
        outcome is logged (a request still waiting on its vote is then left to the daemon thread)."""
        if self.telemetry is not None:
            self.telemetry.close()
        if self.guard is not None:
            self.guard.wait(CLOSE_WAIT_S)


def _as_float(v: Any) -> float | None:
    return None if v is None else float(v)  # a tensor: one host sync, on rank 0 only
