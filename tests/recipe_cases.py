"""Cases shared by the tests that pin a built-in recipe against the reference factory it names."""

from __future__ import annotations

import pytest

import dist_quant as dq
from dist_quant import factories

# Each built-in recipe with the `dist_quant.factories` factory whose `CustomRecipe` must quantize
# every slot of a module the same way, bit for bit (Linear, GroupedLinear, LayerNormMLP).
builtin_and_reference_factory = pytest.mark.parametrize(
    "builtin,factory",
    [
        (dq.Float8CurrentScaling(), factories.current_scaling),
        (dq.DelayedScaling(), factories.delayed_scaling),
        (dq.MXFP8BlockScaling(), factories.mxfp8),
        (dq.Float8BlockScaling(), factories.float8_block_scaling),
    ],
    ids=["current", "delayed", "mxfp8", "block"],
)
