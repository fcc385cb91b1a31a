"""`PrecisionGuard`: a policy that asks the coordinator to switch precision when training goes bad.

The policy is a frozen dataclass; `guard_decide` (one observed step -> a decision or None) and
`guard_resolve` (a switch's outcome -> the next state) are pure functions over a frozen
`GuardState`, tested as tables. `guard_runner.GuardRunner` calls them beside the coordinator on
rank 0, logs every decision and sends the switch request.

Triggers, in priority order (one decision per step at most):
1. a non-finite loss or gradient norm: the whole model to high precision ("bf16");
2. saturation: a module whose largest slot saturation fraction exceeds `saturation_threshold` on
   `saturation_intervals` consecutive stats steps: that module (plus those already switched) to
   `fallback` scaling, the rest of the model on its base recipe;
3. a loss spike: a finite loss more than `spike_sigma` standard deviations above the mean of the
   last `loss_window` finite losses (the window must be full): the modules that saturated on the
   last stats step, or, when none did, the whole model, to `fallback`;
4. with `undo_after_steps`, that many consecutive trigger-free steps after a committed switch:
   back to the base recipe (hysteresis: a switch is never undone early).
While a requested switch is open no new decision is made (never more than one open switch);
statistics keep accumulating, so a trigger that persists fires once the switch has closed. A
spike's loss does not enter the window, so one spike does not widen the band the next is judged by.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from enum import Enum
from pathlib import Path
from typing import Any

from dist_quant.recipe_files import read_recipe_spec
from dist_quant.recipes import FALLBACK_TARGETS, recipe_from_dict


class Trigger(str, Enum):
    NON_FINITE_LOSS = "non_finite_loss"
    NON_FINITE_GRAD_NORM = "non_finite_grad_norm"
    SATURATION = "saturation"
    LOSS_SPIKE = "loss_spike"
    STABLE = "stable"


class Action(str, Enum):
    LAYERS = "layers"  # `layers` to the fallback, the rest on the base recipe
    MODEL = "model"  # the whole model to `target`
    UNDO = "undo"  # back to the base recipe


@dataclass(frozen=True)
class PrecisionGuard:
    """When to ask for a precision switch, and to what."""

    loss_window: int = 50
    """Finite losses kept for the spike test; no spike is judged before the window is full."""
    spike_sigma: float = 6.0
    """A loss above mean + spike_sigma * std of the window is a spike."""
    saturation_threshold: float = 0.01
    """A module's saturation fraction (largest over its slots) above this counts as bad."""
    saturation_intervals: int = 2
    """Consecutive bad stats steps before the module is switched."""
    fallback: str | Mapping[str, Any] = "current"
    """What offending modules switch to: "current" (current scaling), "mxfp8" (the gentler
    step for an NVFP4 model), "bf16", or a recipe given as its dict or as the path of a YAML/JSON
    policy file (read once, here): a declarative policy then says what each offending module's
    slots run, and a whole-model fallback switches to the policy."""
    undo_after_steps: int | None = None
    """Trigger-free steps after a committed switch before switching back; None never undoes."""
    switch_timeout_s: float = 30.0
    """Vote deadline of the guard's switch requests."""
    fallback_label: str = field(init=False, compare=False)
    """The fallback as decisions, logs and reports name it: the name, "policy <file>", or
    "<recipe type> <digest>" for a dict."""
    fallback_recipe: str | dict[str, Any] = field(init=False, compare=False, repr=False)
    """The fallback as a switch request sends it: the name, or the recipe's dict."""

    def __post_init__(self) -> None:
        _check_int("loss_window", self.loss_window, 2)
        _check_positive("spike_sigma", self.spike_sigma)
        if not (_is_number(self.saturation_threshold) and 0.0 <= self.saturation_threshold < 1.0):
            raise ValueError(
                "PrecisionGuard.saturation_threshold must be a number in [0, 1), got "
                f"{self.saturation_threshold!r}"
            )
        _check_int("saturation_intervals", self.saturation_intervals, 1)
        label, recipe = _fallback(self.fallback)
        object.__setattr__(self, "fallback_label", label)  # derived once: the file is read here
        object.__setattr__(self, "fallback_recipe", recipe)
        if self.undo_after_steps is not None:
            _check_int("undo_after_steps", self.undo_after_steps, 1)
        _check_positive("switch_timeout_s", self.switch_timeout_s)

    def request_for(self, target: str) -> str | dict[str, Any]:
        """What a decision's `target` asks the coordinator for: the fallback's recipe for the
        fallback's label, else the named target itself ("bf16", "base")."""
        return self.fallback_recipe if target == self.fallback_label else target


def _fallback(value: Any) -> tuple[str, str | dict[str, Any]]:
    """(label, request) of a `PrecisionGuard.fallback`; ValueError naming what is wrong. A
    recipe is built here once, so a bad policy is refused when the guard is made."""
    if isinstance(value, str) and value in FALLBACK_TARGETS:
        return value, value
    where = "PrecisionGuard.fallback"
    spec = dict(value) if isinstance(value, Mapping) else value
    if isinstance(value, str):
        try:
            spec = read_recipe_spec(value)
        except ValueError as e:
            raise ValueError(f"{where}: {e}") from e
        where = f"{where}: recipe file {value!r}"
    if not isinstance(spec, dict):
        raise ValueError(
            f"PrecisionGuard.fallback must be one of {FALLBACK_TARGETS}, a recipe dict or the path "
            f"of a recipe or policy file (JSON/YAML), got {value!r}"
        )
    try:
        recipe = recipe_from_dict(spec)
    except (ValueError, TypeError) as e:
        raise ValueError(f"{where}: {e}") from e
    kind = "policy" if spec.get("type") == "policy" else type(recipe).__name__
    name = (
        f"{kind} {Path(value).name}" if isinstance(value, str) else f"{kind} {recipe.digest()[:8]}"
    )
    return name, recipe.to_dict()


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _check_int(name: str, v: Any, minimum: int) -> None:
    if not isinstance(v, int) or isinstance(v, bool) or v < minimum:
        raise ValueError(f"PrecisionGuard.{name} must be an int >= {minimum}, got {v!r}")


def _check_positive(name: str, v: Any) -> None:
    if not (_is_number(v) and v > 0):
        raise ValueError(f"PrecisionGuard.{name} must be a finite number > 0, got {v!r}")


@dataclass(frozen=True)
class Observation:
    """What one step showed the guard (rank 0's loss and gradient norm, the job's stats)."""

    step: int
    loss: float | None = None
    grad_norm: float | None = None
    saturation: tuple[tuple[str, float], ...] | None = None
    """Per module, its largest slot saturation fraction; only on stats steps."""


@dataclass(frozen=True)
class GuardState:
    losses: tuple[float, ...] = ()
    streaks: tuple[tuple[str, int], ...] = ()  # module -> consecutive bad stats steps, sorted
    last_saturated: tuple[str, ...] = ()  # modules above 0 on the last stats step
    switched: tuple[str, ...] = ()  # modules on the fallback now
    whole_model: str | None = None  # the target the whole model runs now, if any
    pending: GuardDecision | None = None  # the open switch
    stable_steps: int = 0


@dataclass(frozen=True)
class GuardDecision:
    step: int
    trigger: Trigger
    action: Action
    layers: tuple[str, ...] = ()  # LAYERS: every module on the fallback after the switch
    target: str = ""  # the fallback (LAYERS / MODEL) or "base" (UNDO)
    statistic: dict[str, Any] = field(default_factory=dict)

    def to_record(self) -> dict[str, Any]:
        return {
            "step": self.step,
            "trigger": self.trigger.value,
            "action": self.action.value,
            "layers": list(self.layers),
            "target": self.target,
            "statistic": self.statistic,
        }


def _finite(v: float | None) -> bool:
    return v is not None and math.isfinite(v)


def _spike(policy: PrecisionGuard, losses: tuple[float, ...], loss: float) -> dict | None:
    if len(losses) < policy.loss_window:
        return None
    mean = math.fsum(losses) / len(losses)
    std = math.sqrt(math.fsum((v - mean) ** 2 for v in losses) / len(losses))
    limit = mean + policy.spike_sigma * std
    if std > 0 and loss > limit:
        return {"loss": loss, "mean": mean, "std": std, "limit": limit}
    return None


def guard_decide(
    policy: PrecisionGuard, state: GuardState, obs: Observation
) -> tuple[GuardDecision | None, GuardState]:
    """One step: the decision to request (None for none) and the state after it."""
    if obs.saturation is not None:
        fractions = dict(obs.saturation)
        old = dict(state.streaks)
        streaks = {
            m: old.get(m, 0) + 1 for m, f in fractions.items() if f > policy.saturation_threshold
        }
        state = replace(
            state,
            streaks=tuple(sorted(streaks.items())),
            last_saturated=tuple(sorted(m for m, f in fractions.items() if f > 0)),
        )
    non_finite = _non_finite(obs)
    spike = _spike(policy, state.losses, obs.loss) if _finite(obs.loss) else None
    bad = [
        m for m, n in state.streaks if n >= policy.saturation_intervals and m not in state.switched
    ]
    decision = _choose(policy, state, obs, non_finite, bad, spike)
    if _finite(obs.loss) and spike is None:
        state = replace(state, losses=(*state.losses, obs.loss)[-policy.loss_window :])
    on_fallback = bool(state.switched) or state.whole_model is not None
    if non_finite or bad or spike is not None or not on_fallback:
        state = replace(state, stable_steps=0)
    elif state.pending is None:
        state = replace(state, stable_steps=state.stable_steps + 1)
        if policy.undo_after_steps is not None and state.stable_steps >= policy.undo_after_steps:
            stat = {"stable_steps": state.stable_steps}
            decision = GuardDecision(obs.step, Trigger.STABLE, Action.UNDO, (), "base", stat)
    if decision is None or state.pending is not None:
        return None, state  # nothing to do, or a switch is open: never two at once
    return decision, replace(state, pending=decision)


def _non_finite(obs: Observation) -> tuple[Trigger, dict[str, float]] | None:
    if obs.loss is not None and not math.isfinite(obs.loss):
        return Trigger.NON_FINITE_LOSS, {"loss": obs.loss}
    if obs.grad_norm is not None and not math.isfinite(obs.grad_norm):
        return Trigger.NON_FINITE_GRAD_NORM, {"grad_norm": obs.grad_norm}
    return None


def _choose(
    policy: PrecisionGuard,
    state: GuardState,
    obs: Observation,
    non_finite: tuple[Trigger, dict[str, float]] | None,
    bad: list[str],
    spike: dict[str, float] | None,
) -> GuardDecision | None:
    """The highest-priority trigger's decision; None where the model already runs that target."""
    if non_finite is not None:
        if state.whole_model == "bf16":
            return None
        return GuardDecision(obs.step, non_finite[0], Action.MODEL, (), "bf16", non_finite[1])
    if state.whole_model is not None:
        return None  # the whole model is off its base already: only a non-finite value escalates
    if bad:
        fractions = dict(obs.saturation or ())
        stat = {
            "saturated_fraction": {m: fractions[m] for m in bad if m in fractions},
            "threshold": policy.saturation_threshold,
            "intervals": policy.saturation_intervals,
        }
        layers = tuple(sorted({*state.switched, *bad}))
        return GuardDecision(
            obs.step, Trigger.SATURATION, Action.LAYERS, layers, policy.fallback_label, stat
        )
    if spike is not None:
        offenders = [m for m in state.last_saturated if m not in state.switched]
        if offenders:
            layers = tuple(sorted({*state.switched, *offenders}))
            return GuardDecision(
                obs.step, Trigger.LOSS_SPIKE, Action.LAYERS, layers, policy.fallback_label, spike
            )
        return GuardDecision(
            obs.step, Trigger.LOSS_SPIKE, Action.MODEL, (), policy.fallback_label, spike
        )
    return None


def guard_resolve(state: GuardState, committed: bool) -> GuardState:
    """The open switch's outcome. An aborted (or unsent) switch resets the streaks of the modules
    it named, so the guard retries only after the trigger holds again for the full interval count."""
    d = state.pending
    if d is None:
        return state
    state = replace(state, pending=None, stable_steps=0)
    named = set(d.layers)
    streaks = tuple((m, n) for m, n in state.streaks if m not in named)
    if not committed:
        return replace(state, streaks=streaks)
    if d.action is Action.LAYERS:
        return replace(state, switched=d.layers, whole_model=None, streaks=streaks)
    if d.action is Action.MODEL:
        return replace(state, switched=(), whole_model=d.target, streaks=())
    return replace(state, switched=(), whole_model=None, streaks=())
