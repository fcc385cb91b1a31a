"""dist-quant: distributed-first FP8 training for PyTorch.

Public names are listed in API.md; each is importable from here.
"""

from dist_quant.formats import Format
from dist_quant.quantizers import (
    Float8BlockQuantizer,
    Float8CurrentScalingQuantizer,
    Float8Quantizer,
    IdentityQuantizer,
    MXFP8Quantizer,
    Quantizer,
)
from dist_quant.tensor import Float8BlockwiseTensor, Float8Tensor, MXFP8Tensor, QuantizedTensor

__all__ = [
    "Float8BlockQuantizer",
    "Float8BlockwiseTensor",
    "Float8CurrentScalingQuantizer",
    "Float8Quantizer",
    "Float8Tensor",
    "Format",
    "IdentityQuantizer",
    "MXFP8Quantizer",
    "MXFP8Tensor",
    "QuantizedTensor",
    "Quantizer",
]
