"""dist-quant: distributed-first FP8 training for PyTorch.

Public names are listed in API.md; each is importable from here.
"""

from dist_quant import checkpoint  # a namespace: dq.checkpoint.load_state_dict, recipe_of, ...
from dist_quant.amax import AmaxReductionMismatch
from dist_quant.context import autocast
from dist_quant.convert import convert_model
from dist_quant.factory_keys import quantizer_factory
from dist_quant.formats import Format
from dist_quant.modules import (
    DotProductAttention,
    GroupedLinear,
    LayerNormLinear,
    LayerNormMLP,
    Linear,
    MultiheadAttention,
    TransformerLayer,
)
from dist_quant.parallel import allreduce_sequence_parallel_grads, load_full_state_dict_into_shards
from dist_quant.quantizers import (
    Float8BlockQuantizer,
    Float8CurrentScalingQuantizer,
    Float8Quantizer,
    IdentityQuantizer,
    MXFP8Quantizer,
    Quantizer,
)
from dist_quant.recipes import (
    CustomRecipe,
    DelayedScaling,
    Float8BlockScaling,
    Float8CurrentScaling,
    MXFP8BlockScaling,
    Recipe,
    recipe_from_dict,
    recipe_from_json,
)
from dist_quant.recompute import RecomputeError, activation_checkpoint
from dist_quant.roles import DelayedScalingRequest, QuantizerRequest, QuantizerRole
from dist_quant.runtime import RecipeUpdateError, apply_recipe, current_recipe, plan_model
from dist_quant.state import RecipeState
from dist_quant.tensor import Float8BlockwiseTensor, Float8Tensor, MXFP8Tensor, QuantizedTensor

__all__ = [
    "AmaxReductionMismatch",
    "allreduce_sequence_parallel_grads",
    "load_full_state_dict_into_shards",
    "checkpoint",
    "activation_checkpoint",
    "apply_recipe",
    "autocast",
    "convert_model",
    "current_recipe",
    "CustomRecipe",
    "DelayedScaling",
    "DelayedScalingRequest",
    "DotProductAttention",
    "Float8BlockQuantizer",
    "Float8BlockScaling",
    "Float8BlockwiseTensor",
    "Float8CurrentScaling",
    "Float8CurrentScalingQuantizer",
    "Float8Quantizer",
    "Float8Tensor",
    "Format",
    "GroupedLinear",
    "IdentityQuantizer",
    "LayerNormLinear",
    "LayerNormMLP",
    "Linear",
    "MXFP8BlockScaling",
    "MXFP8Quantizer",
    "MXFP8Tensor",
    "MultiheadAttention",
    "plan_model",
    "QuantizedTensor",
    "Quantizer",
    "quantizer_factory",
    "QuantizerRequest",
    "QuantizerRole",
    "Recipe",
    "recipe_from_dict",
    "recipe_from_json",
    "RecipeState",
    "RecipeUpdateError",
    "RecomputeError",
    "TransformerLayer",
]
