"""dist-quant: distributed-first FP8 training for PyTorch.

Every public name is importable from here: `_EXPORTS` below lists them with their modules.
"""

from __future__ import annotations

import importlib
from typing import Any

# Public name -> the module that defines it. Imported on first use (PEP 562), so that
# `import dist_quant` (and the `dist-quant` command line, whose `--help`, `switch` and `status`
# need no torch) costs nothing until a name is used.
_EXPORTS: dict[str, str] = {
    "checkpoint": "dist_quant.checkpoint",  # a namespace: dq.checkpoint.load, recipe_of, ...
    "AmaxReductionMismatch": "dist_quant.amax",
    "autocast": "dist_quant.context",
    "ConversionReport": "dist_quant.convert",
    "convert_model": "dist_quant.convert",
    "convert_model_with_report": "dist_quant.convert",
    "quantizer_factory": "dist_quant.factory_keys",
    "Format": "dist_quant.formats",
    "GraphedStep": "dist_quant.graphs",
    "GraphInvalidated": "dist_quant.graphs",
    "make_graphed_callables": "dist_quant.graphs",
    "DotProductAttention": "dist_quant.modules",
    "GroupedLinear": "dist_quant.modules",
    "LayerNormLinear": "dist_quant.modules",
    "LayerNormMLP": "dist_quant.modules",
    "Linear": "dist_quant.modules",
    "MultiheadAttention": "dist_quant.modules",
    "TransformerLayer": "dist_quant.modules",
    "allreduce_sequence_parallel_grads": "dist_quant.parallel",
    "load_full_state_dict_into_shards": "dist_quant.checkpoint.shards",
    "Float8BlockQuantizer": "dist_quant.quantizers",
    "Float8CurrentScalingQuantizer": "dist_quant.quantizers",
    "Float8Quantizer": "dist_quant.quantizers",
    "IdentityQuantizer": "dist_quant.quantizers",
    "MXFP8Quantizer": "dist_quant.quantizers",
    "NVFP4Quantizer": "dist_quant.nvfp4",
    "Quantizer": "dist_quant.quantizers",
    "CustomRecipe": "dist_quant.recipes",
    "DelayedScaling": "dist_quant.recipes",
    "Float8BlockScaling": "dist_quant.recipes",
    "Float8CurrentScaling": "dist_quant.recipes",
    "HighPrecision": "dist_quant.recipes",
    "MXFP8BlockScaling": "dist_quant.recipes",
    "NVFP4BlockScaling": "dist_quant.recipes",
    "Recipe": "dist_quant.recipes",
    "recipe_from_dict": "dist_quant.recipes",
    "recipe_from_json": "dist_quant.recipes",
    "DelayedScalingRequest": "dist_quant.roles",
    "QuantizerRequest": "dist_quant.roles",
    "QuantizerRole": "dist_quant.roles",
    "RecipeUpdateError": "dist_quant.runtime",
    "apply_recipe": "dist_quant.runtime",
    "current_recipe": "dist_quant.runtime",
    "plan_model": "dist_quant.runtime",
    "RecipeState": "dist_quant.state",
    "RecomputeError": "dist_quant.recompute",
    "activation_checkpoint": "dist_quant.recompute",
    "Float8BlockwiseTensor": "dist_quant.tensor",
    "Float8Tensor": "dist_quant.tensor",
    "MXFP8Tensor": "dist_quant.tensor",
    "NVFP4Tensor": "dist_quant.nvfp4_tensor",
    "QuantizedTensor": "dist_quant.tensor",
}


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'dist_quant' has no attribute {name!r}")
    imported = importlib.import_module(module)
    value = imported if module == f"dist_quant.{name}" else getattr(imported, name)
    globals()[name] = value  # later lookups skip __getattr__
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))


__all__ = sorted(_EXPORTS)
