"""Fuzzing `recipe_from_dict` / `recipe_from_json` with broken recipes.

What a user can type into `dist-quant switch` or a config file: wrong types, missing and extra
fields, out-of-range values, unknown formats, import paths that do not exist or name something that
is not callable, broken JSON. The contract (API.md, recipes.py): a recipe comes back, or ValueError
naming the offending field; never another exception type.

The oracle is this file's own statement of the API (`SPEC`, checked against the dataclasses so it
cannot drift silently): a generated dict must parse exactly when the oracle finds no problem, and
the error must name one of the fields the oracle found wrong. Cases that currently escape as other
exception types are pinned separately as strict xfails (end of file) and left out of the
generators, so that the property tests keep finding new problems instead of the known ones.
"""

from __future__ import annotations

import dataclasses
import importlib
import json
import math
import warnings

import pytest
import torch
from fuzz_models import Snapshot, Zoo, fuzz_budget
from hypothesis import given
from hypothesis import strategies as st

import dist_quant as dq
from dist_quant.recipes import recipe_from_dict, recipe_from_json

# ---- the oracle ----------------------------------------------------------------------------------

PER_TENSOR = {"HYBRID", "E4M3"}
SPEC: dict[str, dict[str, tuple]] = {
    # field -> (kind, argument); kinds are checked by `problem` below
    "DelayedScaling": {
        "margin": ("int", 0),
        "fp8_format": ("format", PER_TENSOR),
        "amax_history_len": ("int", 1),
        "amax_compute_algo": ("algo", None),
        "scaling_factor_compute_algo": ("optional_callable", None),
        "reduce_amax": ("bool", None),
        "fp8_dpa": ("bool", None),
        "fp8_mha": ("bool", None),
    },
    "Float8CurrentScaling": {
        "fp8_format": ("format", PER_TENSOR),
        "use_power_2_scales": ("bool", None),
        "amax_epsilon": ("epsilon", None),
        "fp8_dpa": ("bool", None),
        "fp8_mha": ("bool", None),
    },
    "MXFP8BlockScaling": {"fp8_format": ("format", {"E4M3"})},
    "Float8BlockScaling": {
        "fp8_format": ("format", {"E4M3"}),
        "use_power_2_scales": ("bool", None),
    },
    "CustomRecipe": {
        "qfactory": ("callable", None),
        "qfactory_key": ("optional_key", None),
        "fp8_format": ("format", {"HYBRID", "E4M3", "E5M2"}),
        "fp8_dpa": ("bool", None),
        "fp8_mha": ("bool", None),
    },
}
REQUIRED = {"CustomRecipe": {"qfactory"}}
BUILTIN = {"delayed", "current", "mxfp8", "block", "bf16"}

# import paths whose fate is known without importing anything with side effects
CALLABLE_PATHS = [
    "dist_quant.factories:current_scaling",
    "dist_quant.factories:high_precision",
    "math:sqrt",
    "json:dumps",
]
BAD_PATHS = [
    "math:pi",  # a float
    "os:sep",  # a str
    "dist_quant.recipes:BUILTIN_RECIPE_NAMES",  # a tuple
    "dist_quant:factories",  # a module
    "math:no_such_function",
    "dist_quant.factories:current_scaling.nope",
    "",
    "nocolon",
    ":",
    "math:",
    ":sqrt",
    "math::sqrt",
]


def _is_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_callable_path(v: object) -> bool:
    return isinstance(v, str) and v in CALLABLE_PATHS


def problem(kind: str, arg: object, value: object) -> bool:
    """True when `value` is not acceptable for a field of this kind (API.md, recipe docstrings)."""
    if kind == "int":
        return not (_is_int(value) and value >= arg)
    if kind == "bool":
        return not isinstance(value, bool)
    if kind == "format":
        return not (isinstance(value, str) and value in arg)
    if kind == "epsilon":
        ok = (_is_int(value) or isinstance(value, float)) and 0 <= value < math.inf
        return not ok
    if kind == "algo":
        return not (value in ("max", "most_recent") or _is_callable_path(value))
    if kind == "optional_callable":
        return not (value is None or _is_callable_path(value))
    if kind == "callable":
        return not _is_callable_path(value)
    if kind == "optional_key":
        return not (value is None or (isinstance(value, str) and value != ""))
    raise AssertionError(f"unknown kind {kind}")


def problems(d: dict) -> set[str]:
    """The fields of `d` the oracle finds wrong ("type" for a bad type, extra names as given)."""
    kind = d.get("type")
    if not isinstance(kind, str) or kind not in SPEC:
        return {"type"}
    spec = SPEC[kind]
    found = {k for k in d if k != "type" and k not in spec}
    for name, (k, arg) in spec.items():
        if name in d:
            if problem(k, arg, d[name]):
                found.add(name)
        elif name in REQUIRED.get(kind, ()):
            found.add(name)
    if d.get("fp8_mha") is True and d.get("fp8_dpa") is not True and "fp8_mha" in spec:
        found.add("fp8_mha")  # FP8 MHA needs FP8 attention
    return found


def expected_value(kind: str, value: object) -> object:
    if kind == "format":
        return dq.Format[value]
    if (
        kind in ("callable", "optional_callable", "algo")
        and isinstance(value, str)
        and ":" in value
    ):
        module, _, qualname = value.partition(":")
        obj = importlib.import_module(module)
        for part in qualname.split("."):
            obj = getattr(obj, part)
        return obj
    if kind == "epsilon":
        return float(value)
    return value


# ---- generators ------------------------------------------------------------------------------------

JUNK = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**70), 2**70),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(st.characters(blacklist_characters=":"), max_size=12),  # never an import path
    st.lists(st.integers(), max_size=3),
    st.dictionaries(st.text(max_size=3), st.integers(), max_size=2),
)
NONEXISTENT_MODULE = st.from_regex(r"\Adq_fuzz_no_such_[a-z]{1,8}(\.[a-z]{1,5})?:[a-z_]{1,8}\Z")


def valid(kind: str, arg: object) -> st.SearchStrategy:
    """Values a field of this kind accepts."""
    if kind == "int":
        return st.integers(arg, arg + 2**40)
    if kind == "bool":
        return st.booleans()
    if kind == "format":
        return st.sampled_from(sorted(arg))
    if kind == "epsilon":
        return st.one_of(st.integers(0, 10**6), st.floats(0, 1e300))
    if kind == "algo":
        return st.sampled_from(["max", "most_recent", *CALLABLE_PATHS])
    if kind == "optional_callable":
        return st.sampled_from([None, *CALLABLE_PATHS])
    if kind == "callable":
        return st.sampled_from(CALLABLE_PATHS)
    if kind == "optional_key":
        return st.one_of(st.none(), st.text(min_size=1, max_size=8))
    raise AssertionError(kind)


def edge(kind: str, arg: object) -> st.SearchStrategy:
    """Values at and just past the edge of what a field of this kind accepts."""
    if kind == "int":
        return st.sampled_from([arg - 1, arg, arg + 1, -(2**63), 2**64, 1.0 * arg, str(arg), True])
    if kind == "bool":
        return st.sampled_from([0, 1, "true", "False", None, 1.0])
    if kind == "format":
        names = ["HYBRID", "E4M3", "E5M2", "hybrid", "e4m3", "E4M3 ", "FP8", "E8M0", "Format.E4M3"]
        return st.sampled_from(names)
    if kind == "epsilon":
        edges = [0, 0.0, -0.0, 1e-12, -1e-12, 1e308, math.inf, -math.inf, math.nan, True, "0.1"]
        return st.sampled_from(edges)
    if kind == "algo":
        return st.one_of(
            st.sampled_from(["max", "most_recent", "MAX", "mean", "min", ""]),
            st.sampled_from(CALLABLE_PATHS + BAD_PATHS),
            NONEXISTENT_MODULE,
        )
    if kind in ("callable", "optional_callable"):
        return st.one_of(st.sampled_from(CALLABLE_PATHS + BAD_PATHS), NONEXISTENT_MODULE)
    if kind == "optional_key":
        return st.sampled_from([None, "", "k", "attn.v2", 0, ["k"]])
    raise AssertionError(kind)


@st.composite
def recipe_dicts(draw: st.DrawFn) -> dict:
    kind = draw(st.sampled_from(sorted(SPEC)))
    d: dict = {"type": kind}
    for name, (k, arg) in SPEC[kind].items():
        how = draw(st.sampled_from(["omit", "valid", "valid", "valid", "edge", "junk"]))
        if how == "omit" and name not in REQUIRED.get(kind, ()):
            continue
        strategy = {"junk": JUNK, "edge": edge(k, arg)}.get(how, valid(k, arg))
        d[name] = draw(strategy)
    extra = draw(st.lists(st.text(min_size=1, max_size=10), max_size=2))
    extra = extra if draw(st.integers(0, 3)) == 0 else []
    for name in extra:
        if name not in SPEC[kind] and name != "type":
            d[name] = draw(JUNK)
    mangle = draw(st.sampled_from(["keep"] * 12 + ["drop", "junk", "case"]))
    if mangle == "drop":
        del d["type"]
    elif mangle == "junk":
        d["type"] = draw(JUNK)
    elif mangle == "case":
        d["type"] = kind.lower()
    return d


def _quiet(fn, *args):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the fallback-key warning of unkeyed callables
        return fn(*args)


def names_a_bad_field(message: str, d: dict, found: set[str]) -> bool:
    spec = SPEC.get(d.get("type"), {}) if isinstance(d.get("type"), str) else {}
    for name in found:
        if name == "type":
            if '"type"' in message or repr(d.get("type")) in message:
                return True
        elif name in spec:
            if name in message:
                return True
        elif repr(name) in message:  # an extra field, quoted as given
            return True
    return False


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


# ---- known bugs ---------------------------------------------------------------------------------------


@pytest.mark.xfail(
    strict=True,
    reason="recipes._import_callable catches only ImportError: a relative module path raises "
    "TypeError from importlib, an exception at the module's import time escapes as is",
)
@pytest.mark.parametrize("path", [".factories:current_scaling", "fuzz_raises_on_import:factory"])
def test_import_path_that_cannot_be_imported_is_a_value_error(path):
    with pytest.raises(ValueError, match="qfactory"):
        recipe_from_dict({"type": "CustomRecipe", "qfactory": path})


@pytest.mark.xfail(
    strict=True,
    reason="recipe_from_json catches only JSONDecodeError: json.loads raises RecursionError on "
    "deeply nested input",
)
def test_deeply_nested_json_is_a_value_error():
    with pytest.raises(ValueError):
        recipe_from_json('{"type": "DelayedScaling", "margin": ' + "[" * 100_000)


@pytest.mark.xfail(
    strict=True,
    reason="Float8CurrentScaling.__post_init__ checks 0 <= eps < inf before float(eps): an int "
    "beyond the float range raises OverflowError",
)
def test_amax_epsilon_beyond_the_float_range_is_a_value_error_naming_it():
    with pytest.raises(ValueError, match="amax_epsilon"):
        recipe_from_dict({"type": "Float8CurrentScaling", "amax_epsilon": 10**400})


@pytest.mark.xfail(
    strict=True,
    reason="DelayedScaling accepts any int margin, but 2.0**margin overflows for margin >= 1024: "
    "the first delayed update at autocast exit raises OverflowError "
    "(kernels/reference.py delayed_scaling_update; runtime._rescale_from_history too)",
)
def test_a_margin_the_recipe_accepts_trains_a_step():
    try:
        recipe = recipe_from_dict({"type": "DelayedScaling", "margin": 1024})
    except ValueError as e:
        assert "margin" in str(e)
        return
    fc = dq.Linear(16, 16)
    dq.apply_recipe(fc, recipe)
    with dq.autocast():
        y = fc(torch.randn(4, 16))
    y.sum().backward()


@pytest.mark.xfail(
    strict=True,
    reason="runtime.plan_module wraps only ValueError/TypeError/NotImplementedError from "
    "RecipeState.create: the allocator's RuntimeError for a huge amax history escapes apply_recipe",
)
def test_a_history_too_large_to_allocate_is_a_recipe_update_error_and_changes_nothing():
    model = Zoo(4)
    dq.apply_recipe(model, dq.Float8CurrentScaling())
    before = Snapshot(model)
    with pytest.raises(dq.RecipeUpdateError, match="'fc'"):
        dq.apply_recipe(model, dq.DelayedScaling(amax_history_len=2**40))  # 2**40 x 3 fp32: 13 TB
    before.check("after a recipe whose state cannot be allocated")
