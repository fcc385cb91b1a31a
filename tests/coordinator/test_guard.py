"""`PrecisionGuard` decisions as tables: observation sequences -> the decisions the guard makes."""

import math

import pytest
from dist_quant.coordinator.guard import (
    Action,
    GuardState,
    Observation,
    PrecisionGuard,
    Trigger,
    guard_decide,
    guard_resolve,
)

POLICY = PrecisionGuard(
    loss_window=4, spike_sigma=3.0, saturation_threshold=0.01, saturation_intervals=2
)
FLAT = [2.0, 2.1, 1.9, 2.0]  # mean 2.0, std ~0.07: a spike is above ~2.21


def run(policy, observations, outcomes=()):
    """Feed observations; each decision is resolved with the next outcome (default: committed).
    Returns [(step, trigger, action, layers, target)] and the final state."""
    outcomes = list(outcomes)
    state, made = GuardState(), []
    for obs in observations:
        d, state = guard_decide(policy, state, obs)
        if d is not None:
            made.append((d.step, d.trigger, d.action, d.layers, d.target))
            state = guard_resolve(state, outcomes.pop(0) if outcomes else True)
    return made, state


def losses(values, start=0):
    return [Observation(start + i, loss=v) for i, v in enumerate(values)]


def sat(step, **fractions):
    return Observation(step, loss=2.0, saturation=tuple(fractions.items()))


CASES = [
    ("stable losses never trigger", losses(FLAT * 5), []),
    ("no spike judged before the window is full", losses([2.0, 2.0, 9.0]), []),
    (
        "spike without saturation -> whole model to current",
        losses([*FLAT, 9.0]),
        [(4, Trigger.LOSS_SPIKE, Action.MODEL, (), "current")],
    ),
    (
        "nan loss -> whole model bf16",
        losses([2.0, math.nan]),
        [(1, Trigger.NON_FINITE_LOSS, Action.MODEL, (), "bf16")],
    ),
    (
        "inf grad norm -> whole model bf16",
        [Observation(0, loss=2.0, grad_norm=math.inf)],
        [(0, Trigger.NON_FINITE_GRAD_NORM, Action.MODEL, (), "bf16")],
    ),
    (
        "nan after bf16 changes nothing more",
        losses([math.nan, math.nan, math.nan]),
        [(0, Trigger.NON_FINITE_LOSS, Action.MODEL, (), "bf16")],
    ),
    (
        "saturation on one interval is not enough",
        [sat(0, a=0.5, b=0.0), sat(1, a=0.0, b=0.0), sat(2, a=0.5, b=0.0)],
        [],
    ),
    (
        "saturation on m consecutive intervals switches exactly that layer",
        [sat(0, a=0.0, b=0.5), sat(1, a=0.001, b=0.02)],
        [(1, Trigger.SATURATION, Action.LAYERS, ("b",), "current")],
    ),
    (
        "a second bad layer joins the switched one",
        [sat(0, b=0.5), sat(1, b=0.5), sat(2, a=0.5), sat(3, a=0.5, b=0.0)],
        [
            (1, Trigger.SATURATION, Action.LAYERS, ("b",), "current"),
            (3, Trigger.SATURATION, Action.LAYERS, ("a", "b"), "current"),
        ],
    ),
    (
        "spike after saturation names the saturated layers",
        [*losses(FLAT), Observation(4, loss=2.0, saturation=(("a", 0.001),)),
         Observation(5, loss=50.0)],
        [(5, Trigger.LOSS_SPIKE, Action.LAYERS, ("a",), "current")],
    ),
]  # fmt: skip


@pytest.mark.parametrize(("name", "observations", "expected"), CASES, ids=[c[0] for c in CASES])
def test_guard_decisions(name, observations, expected):
    made, _ = run(POLICY, observations)
    assert made == expected


def test_never_a_second_decision_while_one_is_open():
    state = GuardState()
    d1, state = guard_decide(POLICY, state, Observation(0, loss=math.nan))
    assert d1 is not None and state.pending == d1
    for step in range(1, 4):
        d, state = guard_decide(POLICY, state, Observation(step, grad_norm=math.inf))
        assert d is None
    assert guard_resolve(state, True).whole_model == "bf16"


def test_an_aborted_switch_retries_only_after_the_full_interval_count_again():
    obs = [sat(i, b=0.5) for i in range(5)]
    made, state = run(POLICY, obs, outcomes=[False, True])
    assert [m[0] for m in made] == [1, 3]  # after the abort at 1: streak restarts, fires at 3
    assert state.switched == ("b",)


def test_undo_after_n_stable_steps_and_not_before():
    policy = PrecisionGuard(loss_window=4, saturation_intervals=1, undo_after_steps=3)
    obs = [sat(0, b=0.5), *losses([2.0] * 4, start=1)]
    made, state = run(policy, obs)
    assert made == [
        (0, Trigger.SATURATION, Action.LAYERS, ("b",), "current"),
        (3, Trigger.STABLE, Action.UNDO, (), "base"),
    ]
    assert state.switched == () and state.whole_model is None


def test_a_trigger_during_the_hold_restarts_the_stable_count():
    policy = PrecisionGuard(loss_window=4, saturation_intervals=1, undo_after_steps=3)
    obs = [
        sat(0, b=0.5),
        *losses([2.0, 2.0], start=1),
        Observation(3, loss=2.0, grad_norm=math.inf),  # escalates to bf16
        *losses([2.0] * 3, start=4),
    ]
    made, _ = run(policy, obs)
    assert [(m[0], m[1]) for m in made] == [
        (0, Trigger.SATURATION),
        (3, Trigger.NON_FINITE_GRAD_NORM),
        (6, Trigger.STABLE),
    ]


def test_the_spike_does_not_enter_the_window():
    _, state = run(POLICY, losses([*FLAT, 9.0]), outcomes=[False])
    assert 9.0 not in state.losses


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("loss_window", 1),
        ("loss_window", 2.5),
        ("spike_sigma", 0),
        ("spike_sigma", math.inf),
        ("saturation_threshold", 1.0),
        ("saturation_threshold", -0.1),
        ("saturation_intervals", 0),
        ("fallback", "fp4"),
        ("undo_after_steps", 0),
        ("switch_timeout_s", -1.0),
        ("saturation_intervals", True),
    ],
)
def test_bad_policy_parameters_are_refused_naming_the_field(field, value):
    with pytest.raises(ValueError, match=f"PrecisionGuard.{field} must be"):
        PrecisionGuard(**{field: value})
