"""Field checks shared by recipes and quantizer requests: each raises ValueError naming the owner,
the field, what is valid and the value it got."""

from __future__ import annotations

import math
from typing import Any

from dist_quant.formats import Format

AMAX_COMPUTE_ALGOS = ("max", "most_recent")
"""The spellings of `kinds.AmaxAlgo` (strings here, as the overrides below: the recipes layer stays
free of the kernels that define it; tests/test_kinds.py checks that they agree)."""

MAX_MARGIN = 127
"""Largest margin: scales are divided by 2**margin in fp32, where 2**128 is inf. A larger margin
could only give zero or denormal scales; Transformer Engine sets no bound and overflows instead."""


def check_format(
    owner: str, field: str, value: object, allowed: tuple[Format, ...], why: str = ""
) -> None:
    if not isinstance(value, Format):
        raise ValueError(
            f"{owner}.{field} must be a dist_quant.Format "
            f"({', '.join(f.name for f in Format)}), got {value!r}"
        )
    if value not in allowed:
        raise ValueError(
            f"{owner}.{field}={value.name} is not supported; "
            f"valid: {', '.join(f.name for f in allowed)}{why}"
        )


def check_int(
    owner: str, field: str, value: object, minimum: int, maximum: int | None = None, why: str = ""
) -> None:
    # bool is an int subclass; True as a margin is a bug, not 1
    is_int = isinstance(value, int) and not isinstance(value, bool)
    if not is_int or value < minimum or (maximum is not None and value > maximum):
        valid = f">= {minimum}" if maximum is None else f"in [{minimum}, {maximum}]"
        raise ValueError(f"{owner}.{field} must be an int {valid}{why}, got {value!r}")


def check_margin(owner: str, value: object) -> None:
    check_int(owner, "margin", value, 0, MAX_MARGIN, " (2**margin must stay finite in fp32)")


def check_float(owner: str, field: str, value: object, minimum: float) -> float:
    """`value` as a float: an int or float, finite once converted, and >= minimum."""
    problem = f"{owner}.{field} must be a finite float >= {minimum}, got {value!r}"
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(problem)
    try:
        number = float(value)
    except OverflowError:  # an int beyond the float range
        raise ValueError(f"{problem} (beyond the float range)") from None
    if not (math.isfinite(number) and number >= minimum):  # NaN fails both
        raise ValueError(problem)
    return number


def check_bool(owner: str, field: str, value: object) -> None:
    if not isinstance(value, bool):
        raise ValueError(f"{owner}.{field} must be True or False, got {value!r}")


def check_amax_algo(owner: str, field: str, value: object) -> None:
    if callable(value):
        return
    if value not in AMAX_COMPUTE_ALGOS:
        raise ValueError(
            f"{owner}.{field} must be one of {', '.join(map(repr, AMAX_COMPUTE_ALGOS))} "
            f"or a callable(amax_history) -> amax, got {value!r}"
        )


# The spellings of `kinds.PassMode` a recipe's overrides take (strings here: the recipes layer
# stays free of the kernels that `kinds` imports)
FORWARD_OVERRIDES = ("high_precision",)
BACKWARD_OVERRIDES = ("high_precision", "dequantized")


def check_overrides(owner: str, recipe: Any, *, delayed_forward: bool = False) -> None:
    """Transformer Engine's `backward_override` plus its forward twin (the request of TE #2569):
    each None (the recipe's quantization) or one of the valid spellings, in a combination that
    still quantizes something and that the recipe's state can honour."""
    fwd, bwd = recipe.forward_override, recipe.backward_override
    for field, value, valid in (
        ("forward_override", fwd, FORWARD_OVERRIDES),
        ("backward_override", bwd, BACKWARD_OVERRIDES),
    ):
        if value is not None and value not in valid:
            raise ValueError(
                f"{owner}.{field} must be None or one of {', '.join(map(repr, valid))}, "
                f"got {value!r}"
            )
    if fwd is None and bwd is None:
        return
    if fwd is not None and bwd == "high_precision":
        raise ValueError(
            f"{owner}: forward_override and backward_override both 'high_precision' quantize "
            "nothing; use HighPrecision() ('bf16')"
        )
    if fwd is not None and bwd == "dequantized":
        raise ValueError(
            f"{owner}: backward_override='dequantized' reads the forward's quantized operands, "
            "but forward_override='high_precision' quantizes none"
        )
    if fwd is not None and delayed_forward:
        raise ValueError(
            f"{owner}.forward_override='high_precision' would cast the forward's delayed-scaling "
            "operands in the backward, after the forward amax reduction; use "
            "Float8CurrentScaling (or another stateless recipe) for a high-precision forward"
        )
    if getattr(recipe, "fp8_dpa", False):
        raise ValueError(
            f"{owner}: forward_override / backward_override apply to the linear GEMMs; FP8 "
            "attention (fp8_dpa=True) has no high-precision pass of its own"
        )
