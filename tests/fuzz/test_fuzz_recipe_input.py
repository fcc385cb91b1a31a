"""Fuzzing `recipe_from_dict` / `recipe_from_json` with broken recipes.

What a user can type into `dist-quant switch` or a config file: wrong types, missing and extra
fields, out-of-range values, unknown formats, import paths that do not exist or name something that
is not callable, broken JSON. The contract (API.md, recipes.py): a recipe comes back, or ValueError
naming the offending field; never another exception type.

The oracle is the tests' own statement of the API (`SPEC` in fuzz_recipes.py, checked against the
dataclasses so it cannot drift silently): a generated dict must parse exactly when the oracle finds no problem, and
the error must name one of the fields the oracle found wrong. Inputs too costly or odd to generate
(deep nesting, a module raising at import, a whole training step, a history too large to allocate)
have their own tests at the end.
"""

from __future__ import annotations

import dataclasses
import json
import warnings

import pytest
import torch
from fuzz_models import Snapshot, Zoo, fuzz_budget
from fuzz_numerics import E4M3, FP8_MAX, amax, scale_from_amax
from fuzz_recipes import (
    BUILTIN,
    JUNK,
    MAX_MARGIN,
    SPEC,
    expected_value,
    names_a_bad_field,
    problems,
    recipe_dicts,
)
from hypothesis import given
from hypothesis import strategies as st

import dist_quant as dq
from dist_quant.recipes import recipe_from_dict, recipe_from_json


def _quiet(fn, *args):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the fallback-key warning of unkeyed callables
        return fn(*args)


def check_outcome(d: dict, parse) -> None:
    found = problems(d)
    if not found:
        recipe = _quiet(parse, d)
        assert type(recipe).__name__ == d["type"]
        for name, (kind, _) in SPEC[d["type"]].items():
            if name in d:
                assert getattr(recipe, name) == expected_value(kind, d[name]), name
        again = _quiet(recipe_from_dict, recipe.to_dict())
        assert _quiet(again.key) == _quiet(recipe.key)
        return
    with pytest.raises(ValueError) as info:
        _quiet(parse, d)
    message = str(info.value)
    assert names_a_bad_field(message, d, found), (
        f"error {message!r} names none of the bad fields {sorted(found, key=str)}"
    )


# ---- properties --------------------------------------------------------------------------------------


def test_the_oracle_knows_every_field_of_every_recipe():
    """A field added to a recipe must be added to SPEC, or the oracle would call it extra."""
    for name, spec in SPEC.items():
        fields = {f.name for f in dataclasses.fields(getattr(dq, name))}
        assert fields == set(spec), (name, fields ^ set(spec))


@given(recipe_dicts())
@fuzz_budget(60)
def test_recipe_dict_parses_exactly_when_valid_else_value_error_naming_the_field(d):
    check_outcome(d, recipe_from_dict)


@given(recipe_dicts())
@fuzz_budget(30)
def test_recipe_json_behaves_like_the_dict_it_encodes(d):
    check_outcome(d, lambda obj: recipe_from_json(json.dumps(obj)))


@given(recipe_dicts(), st.data())
@fuzz_budget(20)
def test_truncated_recipe_json_is_a_value_error(d, data):
    text = json.dumps(d)
    cut = data.draw(st.integers(1, len(text) - 1))
    with pytest.raises(ValueError):
        _quiet(recipe_from_json, text[:cut])


@given(st.one_of(st.text(max_size=40), st.sampled_from(sorted(BUILTIN))), st.data())
@fuzz_budget(30)
def test_any_text_is_a_recipe_or_a_value_error(text, data):
    pad = data.draw(st.sampled_from(["", " ", "\n", '"']))
    text = data.draw(st.sampled_from([text, text.upper(), pad + text + pad]))
    try:
        recipe = _quiet(recipe_from_json, text)
    except ValueError:
        return
    assert isinstance(recipe, dq.recipes.Recipe)


@given(JUNK.filter(lambda v: not isinstance(v, (dict, str))))
@fuzz_budget(20)
def test_a_recipe_that_is_not_a_dict_or_a_name_is_a_value_error(value):
    with pytest.raises(ValueError, match="a recipe must be a dict or a built-in name"):
        recipe_from_dict(value)


# ---- inputs not generated above -----------------------------------------------------------------


@pytest.mark.parametrize("path", [".factories:current_scaling", "fuzz_raises_on_import:factory"])
def test_import_path_that_cannot_be_imported_is_a_value_error_naming_field_and_path(path):
    with pytest.raises(ValueError, match="qfactory") as info:
        recipe_from_dict({"type": "CustomRecipe", "qfactory": path})
    assert repr(path) in str(info.value)


def test_deeply_nested_json_is_a_value_error():
    with pytest.raises(ValueError):
        recipe_from_json('{"type": "DelayedScaling", "margin": ' + "[" * 100_000)


def test_amax_epsilon_beyond_the_float_range_is_a_value_error_naming_it():
    with pytest.raises(ValueError, match="amax_epsilon"):
        recipe_from_dict({"type": "Float8CurrentScaling", "amax_epsilon": 10**400})


@pytest.mark.parametrize("over", [1, 897, 2**64])  # 2**128 (inf in fp32), 2**1024 (inf in fp64)
def test_a_margin_whose_power_of_two_overflows_fp32_is_refused_naming_the_field(over):
    margin = MAX_MARGIN + over
    with pytest.raises(ValueError, match=r"DelayedScaling\.margin"):
        recipe_from_dict({"type": "DelayedScaling", "margin": margin})
    with pytest.raises(ValueError, match=r"DelayedScalingRequest\.margin"):
        dq.DelayedScalingRequest(margin=margin)


def test_the_largest_accepted_margin_trains_a_step_with_the_expected_scales():
    margin = MAX_MARGIN
    fc = dq.Linear(16, 16, name="fc")
    dq.apply_recipe(fc, recipe_from_dict({"type": "DelayedScaling", "margin": margin}))
    x = torch.randn(4, 16)
    with dq.autocast():
        y = fc(x)
    y.sum().backward()
    # forward slots: input, weight, output (quantizes nothing here, so it keeps scale 1)
    expected = [scale_from_amax(amax(t), FP8_MAX[E4M3], margin=margin) for t in (x, fc.weight)]
    want = torch.tensor([*expected, 1.0], dtype=torch.float64)
    assert torch.equal(fc.quant_binding.runtime.fwd_state.scale.double(), want)
    assert all(torch.isfinite(p.grad).all() for p in fc.parameters())


def test_a_history_too_large_to_allocate_is_a_recipe_update_error_and_changes_nothing():
    model = Zoo(4)
    dq.apply_recipe(model, dq.Float8CurrentScaling())
    before = Snapshot(model)
    with pytest.raises(dq.RecipeUpdateError, match="'fc'"):
        dq.apply_recipe(model, dq.DelayedScaling(amax_history_len=2**40))  # 2**40 x 3 fp32: 13 TB
    before.check("after a recipe whose state cannot be allocated")
