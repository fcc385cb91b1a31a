"""FP8 modules that emit quantizer roles."""

from dist_quant.modules.attention import DotProductAttention
from dist_quant.modules.grouped_linear import GroupedLinear
from dist_quant.modules.layernorm_linear import LayerNormLinear
from dist_quant.modules.layernorm_mlp import LayerNormMLP
from dist_quant.modules.linear import Linear
from dist_quant.modules.multihead_attention import MultiheadAttention
from dist_quant.modules.transformer import TransformerLayer

__all__ = [
    "DotProductAttention",
    "GroupedLinear",
    "LayerNormLinear",
    "LayerNormMLP",
    "Linear",
    "MultiheadAttention",
    "TransformerLayer",
]
