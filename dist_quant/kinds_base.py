"""The bottom of the typed vocabulary: the `Kind` base of every kind, and the kinds that the kernels
themselves name.

It imports nothing of the package and no torch, so both the kernels (the lowest layer of the
package) and the recipes layer (kept free of the kernels, whose import loads Triton and registers
the custom ops) can import it. `dist_quant.kinds` re-exports what it holds, beside the kinds that
need torch.
"""

from __future__ import annotations

import enum
from typing import TypeVar


class Kind(str, enum.Enum):
    """A `str` enum that prints and formats as its value on every Python version."""

    def __str__(self) -> str:
        return self.value

    __format__ = str.__format__


class AmaxAlgo(Kind):
    """Which amax a delayed-scaling update scales from, given the amax history `(L, n)` whose row 0
    is this step's (Transformer Engine's names; a recipe may pass a callable instead)."""

    MAX = "max"
    """The max over all L rows of the history."""
    MOST_RECENT = "most_recent"
    """Row 0 only: this step's amax."""

    @property
    def code(self) -> int:
        """The integer a kernel receives for it: a custom op's schema has no list of strings."""
        return _AMAX_ALGO_CODES[self]

    @staticmethod
    def of_code(code: int) -> AmaxAlgo:
        return _AMAX_ALGO_BY_CODE[code]


# the delayed-update kernel branches on these numbers (0: max over the history, 1: row 0)
_AMAX_ALGO_CODES = {AmaxAlgo.MAX: 0, AmaxAlgo.MOST_RECENT: 1}
_AMAX_ALGO_BY_CODE = {code: algo for algo, code in _AMAX_ALGO_CODES.items()}

_K = TypeVar("_K", bound=Kind)


def parse_kind(kind: type[_K], value: object, where: str) -> _K:
    """`value` as a member of `kind` (a member, or its string spelling); ValueError naming `where`
    and the valid spellings otherwise."""
    try:
        return kind(value)
    except ValueError:
        valid = ", ".join(repr(k.value) for k in kind)
        raise ValueError(f"{where} must be one of {valid}, got {value!r}") from None


def spellings(kind: type[Kind]) -> str:
    """The valid spellings of `kind` for a message: `'max' or 'most_recent'`."""
    values = [repr(k.value) for k in kind]
    return values[0] if len(values) == 1 else f"{', '.join(values[:-1])} or {values[-1]}"
