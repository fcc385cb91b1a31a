"""Fuzzing `CustomRecipe` factories that misbehave, through every way a recipe reaches a model.

A factory answers per slot; hypothesis picks which roles of the `Zoo` model (one module of every
family) get a bad answer: None, an object that is not a quantizer, an exception, a request the
runtime does not know, a delayed-scaling request that cannot be built, or one that disagrees with
the other delayed slots of its state. The recipe then reaches the model through `apply_recipe`,
`plan_model` or a lazy `autocast(recipe=...)` switch.

The oracle walks the model's slots in planning order (modules in `model.modules()` order, forward
state before backward, slot order; API.md / runtime.py) and predicts the first failure. Expected:
`RecipeUpdateError` naming that module and role; the model exactly as before (runtime objects,
quantizers, buffer objects and bytes, cached weights, parameters: `Snapshot`); the next training
step bit-identical to a twin that never saw the bad recipe. Cases where no answer is bad must
switch, and then equal the twin switched the same way.

Slow factories have no deadline inside one process; the coordinator's vote deadline covers them
(tests/faults/test_switch_faults.py).
"""

from __future__ import annotations

import dataclasses
import warnings

import pytest
import torch
from fuzz_models import (
    Snapshot,
    Zoo,
    batch,
    check_twins,
    fuzz_budget,
    quantized_modules,
    train_step,
)
from hypothesis import given
from hypothesis import strategies as st

import dist_quant as dq
from dist_quant import factories
from dist_quant.roles import QuantizerRequest, QuantizerRole


@dataclasses.dataclass(frozen=True)
class OtherRequest(QuantizerRequest):
    """A request kind the runtime does not implement."""


ASK_FAILURES = ("none", "wrong_type", "raise", "unknown_request", "invalid_request")
WRONG_TYPES = [0, "E4M3", torch.ones(1), dq.Float8CurrentScalingQuantizer, dq.Format.E4M3, object()]
RAISED = [RuntimeError, KeyError, ValueError, TypeError, ZeroDivisionError, AssertionError]


class Misbehaving:
    """`base(role)` except for the roles in `faults`: (module name, tensor type) -> (kind, arg).
    A slot without a role is called with `None` (API.md), keyed ("", "")."""

    def __init__(self, base, faults: dict) -> None:
        self.base, self.faults = base, faults

    def answer(self, role: QuantizerRole | None):
        """(kind, what the factory returns) without raising: the oracle's view."""
        key = ("", "") if role is None else (role.name, role.tensor_type)
        kind, arg = self.faults.get(key, ("base", None))
        if kind == "base":
            return kind, self.base(role)
        if kind == "disagree":
            return kind, dq.DelayedScalingRequest(margin=7)
        if kind == "other_kind":
            return kind, dq.MXFP8Quantizer()
        if kind == "unsupported":  # FP8 attention cannot consume block-scaled tensors
            return kind, factories.float8_block_scaling(role)
        return kind, arg

    def __call__(self, role: QuantizerRole | None):
        kind, arg = self.answer(role)
        if kind == "none":
            return None
        if kind == "raise":
            raise arg("injected by the fuzz factory")
        if kind == "unknown_request":
            return OtherRequest()
        if kind == "invalid_request":
            return dq.DelayedScalingRequest(margin=-1)  # raises ValueError inside the factory
        return arg


def expected_failure(model, factory: Misbehaving, fp8_dpa: bool):
    """(module, role, slot) of the first slot planning must refuse, or None if all is well.

    Per module: both states are built (every slot asked, then the delayed requests of the state
    compared), then the module validates its quantizers: attention refuses, under `fp8_dpa`, a
    kind FP8 attention cannot use on its own (dpa) roles."""
    for m in quantized_modules(model):
        unsupported = []
        for fwd in (True, False):
            roles = m.get_quantizer_roles(fwd=fwd, num_quantizers=m.num_quantizers(fwd=fwd))
            answers = [factory.answer(r) for r in roles]
            for slot, (kind, _) in enumerate(answers):
                if kind in ASK_FAILURES:
                    return m, roles[slot], slot
            # one delayed-scaling scale/history per state: every request in it must agree
            requests = [
                (slot, a)
                for slot, (_, a) in enumerate(answers)
                if isinstance(a, dq.DelayedScalingRequest)
            ]
            for slot, request in requests[1:]:
                if request.margin != requests[0][1].margin:
                    return m, roles[slot], slot
            unsupported += [
                (m, roles[slot], slot)
                for slot, (kind, _) in enumerate(answers)
                if kind == "unsupported"
                and roles[slot] is not None
                and roles[slot].module_type == "dpa"
                and fp8_dpa
            ]
        if unsupported:
            return unsupported[0]
    return None


def all_role_keys() -> list[tuple[str, str]]:
    model = Zoo(0)
    dq.plan_model(model, dq.Float8CurrentScaling())  # names the modules by their paths
    keys = set()
    for m in quantized_modules(model):
        for fwd in (True, False):
            for r in m.get_quantizer_roles(fwd=fwd, num_quantizers=m.num_quantizers(fwd=fwd)):
                keys.add((r.name, r.tensor_type) if r is not None else ("", ""))
    return sorted(keys)


ROLE_KEYS = all_role_keys()
STARTS = [
    dq.DelayedScaling(amax_history_len=3),
    dq.Float8CurrentScaling(fp8_dpa=True),
    dq.CustomRecipe(factories.delayed_scaling, fp8_dpa=True),
    dq.MXFP8BlockScaling(),
]
BASES = [factories.delayed_scaling, factories.current_scaling, factories.mxfp8]

fault = st.one_of(
    st.tuples(st.just("none"), st.none()),
    st.tuples(st.just("wrong_type"), st.sampled_from(WRONG_TYPES)),
    st.tuples(st.just("raise"), st.sampled_from(RAISED)),
    st.tuples(st.sampled_from(["unknown_request", "invalid_request"]), st.none()),
    st.tuples(st.sampled_from(["disagree", "other_kind", "unsupported"]), st.none()),
)


def twins(start, pinned: bool):
    """Two identical Zoos trained two steps under `start` (pinned by apply_recipe or lazily)."""
    pair = []
    for _ in range(2):
        model = Zoo(1)
        opt = torch.optim.SGD(model.parameters(), lr=1e-2)
        if pinned:
            dq.apply_recipe(model, start)
        for step in range(2):
            train_step(model, opt, step, None if pinned else start)
        pair.append((model, opt))
    return pair


def reach(path: str, model, recipe) -> None:
    """Bring `recipe` to `model` the way `path` says (raises what the runtime raises)."""
    if path == "apply_recipe":
        dq.apply_recipe(model, recipe)
    elif path == "plan_model":
        dq.plan_model(model, recipe)
    else:
        x, _ = batch(99)
        with dq.autocast(recipe=recipe):
            model(x)


@given(
    start=st.sampled_from(STARTS),
    base=st.sampled_from(BASES),
    faults=st.dictionaries(st.sampled_from(ROLE_KEYS), fault, min_size=1, max_size=3),
    fp8_dpa=st.booleans(),
    path=st.sampled_from(["apply_recipe", "plan_model", "autocast"]),
)
@fuzz_budget(14)
def test_misbehaving_factory_is_refused_naming_module_and_role_and_changes_nothing(
    start, base, faults, fp8_dpa, path
):
    pinned = path != "autocast"
    (model, opt), (twin, twin_opt) = twins(start, pinned)
    factory = Misbehaving(base, faults)
    recipe = dq.CustomRecipe(
        factory, qfactory_key=f"fuzz {base.__name__} {faults}", fp8_dpa=fp8_dpa
    )
    expected = expected_failure(model, factory, fp8_dpa)
    before = Snapshot(model)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # an autocast recipe overriding nothing, fallback keys
        if expected is None:
            reach(path, model, recipe)
            if path == "plan_model":
                before.check("a plan that was never published")
            else:
                reach(path, twin, recipe)  # the twin switches the same way
            step_recipe = recipe if path == "autocast" else None
        else:
            module, role, slot = expected
            with pytest.raises(dq.RecipeUpdateError) as info:
                reach(path, model, recipe)
            message = str(info.value)
            assert f"'{module.role_name}'" in message, message
            described = "<no role>" if role is None else str(role)
            assert described in message, (described, message)
            if role is None or not role.name:
                assert f"slot {slot}" in message, message
            before.check(f"after a refused recipe via {path}")
            step_recipe = None if pinned else start
        loss = train_step(model, opt, 2, step_recipe)
        twin_loss = train_step(twin, twin_opt, 2, step_recipe)
    check_twins(model, twin, loss, twin_loss, f"{path}, expected failure {expected is not None}")


class AnswersOnce:
    """Answers like `factories.current_scaling` on its first `good` calls, then `bad`."""

    def __init__(self, good: int, bad) -> None:
        self.calls, self.good, self.bad = 0, good, bad

    def __call__(self, role: QuantizerRole | None):
        self.calls += 1
        if self.calls <= self.good:
            return factories.current_scaling(role)
        if isinstance(self.bad, type) and issubclass(self.bad, Exception):
            raise self.bad("the factory changed its mind")
        return self.bad


@given(
    which=st.sampled_from(["fc", "norm_fc", "experts", "attn"]),
    bad=st.sampled_from([None, 3, RuntimeError, KeyError]),
)
@fuzz_budget(6)
def test_factory_answering_differently_on_a_later_call_fails_the_replan_and_changes_nothing(
    which, bad
):
    """A role change re-plans one module at its next forward, calling the factory again; a
    factory that now answers badly must fail that forward cleanly and leave the model as it was."""
    pair = []
    for _ in range(2):
        model = Zoo(2)
        opt = torch.optim.SGD(model.parameters(), lr=1e-2)
        slots = sum(
            m.num_quantizers(fwd=f) for m in quantized_modules(model) for f in (True, False)
        )
        dq.apply_recipe(
            model, dq.CustomRecipe(AnswersOnce(slots, bad), qfactory_key="answers-once")
        )
        train_step(model, opt, 0)
        pair.append((model, opt))
    (model, opt), (twin, twin_opt) = pair
    module = getattr(model, which)
    before = Snapshot(model)
    module.output_quantizer_role = QuantizerRole("linear", "input", "somewhere.else")
    x, _ = batch(98)
    with pytest.raises(dq.RecipeUpdateError, match=f"'{which}'"):
        with dq.autocast():
            model(x)  # no weight caching: a partial forward must not replace cached weights
    before.check(f"after the failed re-plan of {which}")
    module.output_quantizer_role = None  # back to the planned roles: nothing to re-plan
    check_twins(model, twin, train_step(model, opt, 1), train_step(twin, twin_opt, 1), which)
