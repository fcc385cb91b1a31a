"""The base of the typed vocabulary (`Kind`) and the kind the kernels themselves name (`AmaxAlgo`).

Here, in the lowest layer, so that the kernels validate and encode the same names the rest of the
package uses; `dist_quant.kinds` builds its kinds on `Kind` and re-exports `AmaxAlgo`. It needs no
torch.
"""

from __future__ import annotations

import enum


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


def spellings(kind: type[Kind]) -> str:
    """The valid spellings of `kind` for a message: `'max' or 'most_recent'`."""
    values = [repr(k.value) for k in kind]
    return values[0] if len(values) == 1 else f"{', '.join(values[:-1])} or {values[-1]}"
