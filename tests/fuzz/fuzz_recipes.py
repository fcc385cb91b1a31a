"""The recipe oracle and generators shared by the recipe-input fuzz suites.

`SPEC` is the tests' own statement of every recipe's fields (API.md and the recipe docstrings);
`problems(d)` says which fields of a recipe dict are wrong by that statement; `recipe_dicts()`
generates dicts with valid, edge, junk, missing and extra fields. Import paths are drawn from
closed lists whose fate is known, so nothing with import-time side effects is ever imported (a
module raising at import is tried once, in test_fuzz_recipe_input.py).
"""

from __future__ import annotations

import importlib
import math
import sys

import torch
from hypothesis import strategies as st

import dist_quant as dq

# ---- the oracle ----------------------------------------------------------------------------------

PER_TENSOR = {"HYBRID", "E4M3"}
# per-pass overrides (None: the recipe's quantization), Transformer Engine's spellings
FORWARD_OVERRIDES = (None, "high_precision")
BACKWARD_OVERRIDES = (None, "high_precision", "dequantized")
# the largest m whose 2**m is finite in fp32 (scales are divided by 2**margin there):
# FLT_MAX = 0.99.. * 2**128, so 2**127 is the largest finite power of two
MAX_MARGIN = math.frexp(torch.finfo(torch.float32).max)[1] - 1
SPEC: dict[str, dict[str, tuple]] = {
    # field -> (kind, argument); kinds are checked by `problem` below
    "DelayedScaling": {
        "margin": ("int", (0, MAX_MARGIN)),
        "fp8_format": ("format", PER_TENSOR),
        "amax_history_len": ("int", (1, None)),
        "amax_compute_algo": ("algo", None),
        "scaling_factor_compute_algo": ("optional_callable", None),
        "reduce_amax": ("bool", None),
        "fp8_dpa": ("bool", None),
        "fp8_mha": ("bool", None),
        "forward_override": ("override", FORWARD_OVERRIDES),
        "backward_override": ("override", BACKWARD_OVERRIDES),
    },
    "Float8CurrentScaling": {
        "fp8_format": ("format", PER_TENSOR),
        "use_power_2_scales": ("bool", None),
        "amax_epsilon": ("epsilon", None),
        "fp8_dpa": ("bool", None),
        "fp8_mha": ("bool", None),
        "forward_override": ("override", FORWARD_OVERRIDES),
        "backward_override": ("override", BACKWARD_OVERRIDES),
    },
    "MXFP8BlockScaling": {
        "fp8_format": ("format", {"E4M3"}),
        "forward_override": ("override", FORWARD_OVERRIDES),
        "backward_override": ("override", BACKWARD_OVERRIDES),
    },
    "Float8BlockScaling": {
        "fp8_format": ("format", {"E4M3"}),
        "use_power_2_scales": ("bool", None),
        "forward_override": ("override", FORWARD_OVERRIDES),
        "backward_override": ("override", BACKWARD_OVERRIDES),
    },
    "NVFP4BlockScaling": {
        "input_rht": ("bool", None),
        "grad_output_rht": ("bool", None),
        "weight_2d": ("bool", None),
        "stochastic_rounding": ("bool", None),
        "seed": ("int", (0, 2**63 - 1)),
        "reduce_amax": ("bool", None),
        "forward_override": ("override", FORWARD_OVERRIDES),
        "backward_override": ("override", BACKWARD_OVERRIDES),
    },
    "CustomRecipe": {
        "qfactory": ("callable", None),
        "qfactory_key": ("optional_key", None),
        "fp8_format": ("format", {"HYBRID", "E4M3", "E5M2"}),
        "fp8_dpa": ("bool", None),
        "fp8_mha": ("bool", None),
        "forward_override": ("override", FORWARD_OVERRIDES),
        "backward_override": ("override", BACKWARD_OVERRIDES),
    },
}
REQUIRED = {"CustomRecipe": {"qfactory"}}
BUILTIN = {"delayed", "current", "mxfp8", "block", "nvfp4", "bf16"}

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
    ".factories:current_scaling",  # relative
]


def _is_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _as_float(v: int | float) -> float:
    """The float an int or float becomes; inf for an int beyond the float range."""
    try:
        return float(v)
    except OverflowError:
        return math.inf


def _is_callable_path(v: object) -> bool:
    return isinstance(v, str) and v in CALLABLE_PATHS


def problem(kind: str, arg: object, value: object) -> bool:
    """True when `value` is not acceptable for a field of this kind (API.md, recipe docstrings)."""
    if kind == "int":
        lo, hi = arg
        return not (_is_int(value) and value >= lo and (hi is None or value <= hi))
    if kind == "bool":
        return not isinstance(value, bool)
    if kind == "format":
        return not (isinstance(value, str) and value in arg)
    if kind == "epsilon":
        if not (_is_int(value) or isinstance(value, float)):
            return True
        return not (math.isfinite(_as_float(value)) and value >= 0)
    if kind == "algo":
        return not (value in ("max", "most_recent") or _is_callable_path(value))
    if kind == "optional_callable":
        return not (value is None or _is_callable_path(value))
    if kind == "callable":
        return not _is_callable_path(value)
    if kind == "optional_key":
        return not (value is None or (isinstance(value, str) and value != ""))
    if kind == "override":
        return not any(value is v or (isinstance(value, str) and value == v) for v in arg)
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
    fwd, bwd = d.get("forward_override"), d.get("backward_override")
    if not found & {"forward_override", "backward_override"} and (fwd or bwd):
        if fwd and (bwd or kind == "DelayedScaling"):
            # both passes unquantized, a dequantized backward of an unquantized forward, or
            # delayed-scaling operands cast after the forward's amax reduction
            found.add("forward_override")
        if d.get("fp8_dpa") is True:
            found |= {"forward_override", "backward_override"} & set(d)  # linear GEMMs only
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
        lo, hi = arg
        return st.integers(lo, lo + 2**40 if hi is None else hi)
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
    if kind == "override":
        return st.sampled_from(arg)
    raise AssertionError(kind)


def edge(kind: str, arg: object) -> st.SearchStrategy:
    """Values at and just past the edge of what a field of this kind accepts."""
    if kind == "int":
        lo, hi = arg
        edges = [lo - 1, lo, lo + 1, -(2**63), 2**64, 1.0 * lo, str(lo), True]
        return st.sampled_from(edges + ([] if hi is None else [hi, hi + 1, 1024]))
    if kind == "bool":
        return st.sampled_from([0, 1, "true", "False", None, 1.0])
    if kind == "format":
        names = ["HYBRID", "E4M3", "E5M2", "hybrid", "e4m3", "E4M3 ", "FP8", "E8M0", "Format.E4M3"]
        return st.sampled_from(names)
    if kind == "epsilon":
        edges = [0, 0.0, -0.0, 1e-12, -1e-12, 1e308, math.inf, -math.inf, math.nan, True, "0.1"]
        edges += [10**400, -(10**400), int(sys.float_info.max)]
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
    if kind == "override":
        return st.sampled_from([None, "high_precision", "dequantized", "HIGH_PRECISION", "", 0])
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
