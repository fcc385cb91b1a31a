"""The precision guard and the telemetry beside training: what `attach(..., guard=...,
stats_interval=...)` adds to `participant.step_boundary` and `participant.observe`.

`StepMonitor` runs on every rank: telemetry's stats step opens at `step_boundary(step)` and is
reduced (one collective over the job) at `observe(step, loss=..., grad_norm=...)`. On rank 0 it
also feeds `GuardRunner`, which turns each step into an `Observation`, asks the pure
`guard_decide`, logs the decision into `decisions.jsonl` (record kind `log.GUARD_RECORD`) and
sends the switch request from a thread of its own, so the training thread never waits for a
vote. The outcome is logged too: "committed" / "aborted" (with the switch id and commit step),
"busy" (another switch, e.g. a scheduled one, stayed open for the whole switch timeout; retried
every 0.2 s until then), "unreachable" (no coordinator answered) or "refused" (no recipe could be
derived); in every case but a commit training goes on with the recipe it has.

The recipe a decision asks for is derived from the base recipe: the one the model runs when the
request is sent, or, while a guard switch is in force, the one that switch started from.
Offending layers -> `CustomRecipe(fp8_fallback(layers, to=..., base=base))`; the whole model ->
the built-in "bf16", "current" or "mxfp8", or the guard's fallback policy; undo -> the base
itself. Both fallbacks to a built-in carry the base's per-pass overrides
(`factories.fallback_recipe`; "bf16" quantizes nothing and takes none); a policy is taken as
written.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

from dist_quant.coordinator.decision_log import GUARD_RECORD, DecisionLog, DecisionLogError
from dist_quant.coordinator.errors import SwitchBusyError, SwitchRequestError
from dist_quant.coordinator.guard import (
    Action,
    GuardDecision,
    GuardState,
    Observation,
    PrecisionGuard,
    guard_decide,
    guard_resolve,
)
from dist_quant.coordinator.switch_log import SwitchLog

from dist_quant.context import default_recipe
from dist_quant.factories import fallback_recipe
from dist_quant.recipes import builtin_recipe
from dist_quant.runtime import current_recipe
from dist_quant.telemetry import StatsRecord, Telemetry

CLOSE_WAIT_S = 5.0
BUSY_RETRY_S = 0.2  # how often a request refused because another switch is open is retried
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
        self._base: dict | str | None = None  # set while a guard switch is in force
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
        self._record(decision, outcome="requested")
        self._thread = threading.Thread(
            target=self._send, args=(decision,), name="dist_quant.guard", daemon=True
        )
        self._thread.start()
        return decision

    def wait(self, timeout: float | None = None) -> None:
        """Until the last request has an outcome (tests, shutdown)."""
        if self._thread is not None:
            self._thread.join(timeout)

    def _recipe_for(self, d: GuardDecision) -> tuple[dict | str, dict | str]:
        """(recipe to request, base it derives from). The base is what the model runs now, until
        a guard switch commits; from then until an undo commits, the base that switch came from."""
        base = self._base
        if base is None:
            recipe = current_recipe(self._model) or default_recipe()
            base = recipe.to_dict()  # raises for a factory that cannot be serialised
        to = self.policy.request_for(d.target)
        if d.action is Action.LAYERS:
            return fallback_recipe(base, to, d.layers).to_dict(), base
        if d.action is Action.MODEL:
            whole = fallback_recipe(base, to)
            # the built-in's name where the base had no overrides (the request it always sent)
            named = isinstance(to, str) and whole == builtin_recipe(to)
            return (to if named else whole.to_dict()), base
        return base, base

    def _send(self, decision: GuardDecision) -> None:
        """Request, retrying while another switch (a scheduled one, say) is open, until the
        policy's switch timeout; every failure is logged and training goes on."""
        deadline = time.monotonic() + self.policy.switch_timeout_s
        while True:
            try:
                recipe, base = self._recipe_for(decision)
                result = self._request(recipe, self.policy.switch_timeout_s)
                break
            except SwitchBusyError as e:
                if time.monotonic() + BUSY_RETRY_S < deadline:
                    time.sleep(BUSY_RETRY_S)
                    continue
                self._finish(decision, False, outcome="busy", reason=str(e))
                return
            except Exception as e:  # noqa: BLE001 - unreachable or refused: log, keep training
                outcome = "unreachable" if isinstance(e, SwitchRequestError) else "refused"
                self._finish(decision, False, outcome=outcome, reason=f"{type(e).__name__}: {e}")
                return
        if result.committed:
            self._base = None if decision.action is Action.UNDO else base
        self._finish(
            decision,
            bool(result.committed),
            outcome="committed" if result.committed else "aborted",
            recipe=recipe,
            switch_id=result.switch_id,
            commit_step=result.step,
            reasons={str(r): why for r, why in (result.reasons or {}).items()},
        )

    def _finish(self, decision: GuardDecision, committed: bool, **outcome: Any) -> None:
        self._record(decision, **outcome)
        self._resolve(committed)

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
