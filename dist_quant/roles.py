"""Quantizer roles (what a slot quantizes) and requests (what a factory may answer instead).

Every module names each quantizer slot with a `QuantizerRole`; a `CustomRecipe` factory receives
that role and returns a quantizer, or a `QuantizerRequest` when the runtime should own the slot's
state. `DelayedScalingRequest` is the one request today: the state allocates the scale and amax
history, and the amax reduction keeps them in step across ranks.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from dist_quant.checks import (
    check_amax_algo,
    check_bool,
    check_format,
    check_int,
    check_margin,
)
from dist_quant.formats import Format


@dataclasses.dataclass(frozen=True)
class QuantizerRole:
    """Which tensor of which module a quantizer slot handles. Frozen and hashable.

    `str(role)` reads `module_type/tensor_type@name`, e.g. `linear/input@layers.0.fc1`.
    """

    module_type: str = ""
    """Kind of module owning the slot: "linear", "grouped_linear", "dpa"; empty if unknown."""
    tensor_type: str = ""
    """The operand: linear "input", "weight", "grad_output"; attention "qkv", "o", "s", "do",
    "dp", "dqkv"; empty if unknown."""
    name: str = ""
    """Hierarchical module name (`layers.3.self_attention.proj`); empty until it is named."""

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if not isinstance(value, str):
                raise ValueError(f"QuantizerRole.{f.name} must be a str, got {value!r}")

    def __str__(self) -> str:
        if not (self.module_type or self.tensor_type or self.name):
            return "<no role>"
        text = f"{self.module_type or '?'}/{self.tensor_type or '?'}"
        return f"{text}@{self.name}" if self.name else text


@dataclasses.dataclass(frozen=True)
class QuantizerRequest:
    """Base of the answers a factory gives when the runtime, not the quantizer, owns the state."""


@dataclasses.dataclass(frozen=True)
class DelayedScalingRequest(QuantizerRequest):
    """Ask for a delayed-scaling slot whose scale and amax history the recipe state owns.

    All requests in one state (one module, one direction) share one scale `(n,)` / history
    `(L, n)` pair, so they must agree on every field; `fp8_format` may differ only where it
    resolves to the same FP8 dtype in that direction (HYBRID is E4M3 forward, E5M2 backward).
    E5M2 is allowed here: a factory may ask for it on a gradient role.
    """

    fp8_format: Format = Format.HYBRID
    """HYBRID: E4M3 forward, E5M2 backward; E4M3 / E5M2: that format both ways."""
    margin: int = 0
    """The scale is divided by 2**margin; at most `checks.MAX_MARGIN` (127)."""
    amax_history_len: int = 1024
    """Steps of amax kept."""
    amax_compute_algo: str | Callable = "max"
    """"max", "most_recent", or `f(amax_history (L, n)) -> amax (n,)`."""
    reduce_amax: bool = True
    """All-reduce(MAX) the step's amax over the amax-reduction group before the update."""

    def __post_init__(self) -> None:
        owner = "DelayedScalingRequest"
        check_format(owner, "fp8_format", self.fp8_format, tuple(Format))
        check_margin(owner, self.margin)
        check_int(owner, "amax_history_len", self.amax_history_len, 1)
        check_amax_algo(owner, "amax_compute_algo", self.amax_compute_algo)
        check_bool(owner, "reduce_amax", self.reduce_amax)
