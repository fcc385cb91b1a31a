"""FP8 formats: which torch float8 dtype the forward and the backward pass use.

E4M3 (max 448) keeps more mantissa and suits activations and weights; E5M2 (max 57344) keeps more
range and suits gradients. ``HYBRID`` uses E4M3 forward and E5M2 backward, as in Transformer Engine.
"""

from __future__ import annotations

import enum

import torch


class Format(enum.Enum):
    """The FP8 format of a recipe; the value is the name, so recipe keys stay plain strings."""

    E4M3 = "E4M3"
    E5M2 = "E5M2"
    HYBRID = "HYBRID"


_FWD = {
    Format.E4M3: torch.float8_e4m3fn,
    Format.E5M2: torch.float8_e5m2,
    Format.HYBRID: torch.float8_e4m3fn,
}
_BWD = {
    Format.E4M3: torch.float8_e4m3fn,
    Format.E5M2: torch.float8_e5m2,
    Format.HYBRID: torch.float8_e5m2,
}


def fwd_dtype(fmt: Format) -> torch.dtype:
    """The float8 dtype of forward-pass tensors (inputs, weights, outputs) under ``fmt``."""
    return _FWD[_check(fmt)]


def bwd_dtype(fmt: Format) -> torch.dtype:
    """The float8 dtype of backward-pass tensors (output and input gradients) under ``fmt``."""
    return _BWD[_check(fmt)]


def _check(fmt: object) -> Format:
    if not isinstance(fmt, Format):
        raise ValueError(
            f"formats: expected a dist_quant.Format ({', '.join(f.name for f in Format)}), "
            f"got {fmt!r}"
        )
    return fmt
