"""FP8 modules that emit quantizer roles."""

from dist_quant.modules.grouped_linear import GroupedLinear
from dist_quant.modules.layernorm_linear import LayerNormLinear
from dist_quant.modules.layernorm_mlp import LayerNormMLP
from dist_quant.modules.linear import Linear

__all__ = [
    "GroupedLinear",
    "LayerNormLinear",
    "LayerNormMLP",
    "Linear",
]
