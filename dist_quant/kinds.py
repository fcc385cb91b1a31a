"""The typed vocabulary of quantization: scaling kinds, GEMM operand layouts, directions, pass
modes, tensor-parallel modes and amax algorithms (`AmaxAlgo` and the `Kind` base live in
`kernels/kinds_base.py`, so that the kernels name them too; `AmaxAlgo` is re-exported here).

Each kind is a `str`-valued enum (its value is the spelling JSON, the command line and telemetry
use, and `ScalingKind.DELAYED == "delayed"` holds, so code comparing with strings keeps working)
that answers the capability questions about itself: is it per tensor, what row alignment its
kernels need, can FP8 attention use it, does it need an FP8 GEMM. Modules ask the kind instead of
keeping tables of strings. Strings become kinds on the first line that sees them (`ScalingKind(s)`,
`Direction.of(...)`).
"""

from __future__ import annotations

from typing import TypeVar

import torch

from dist_quant.formats import Format, bwd_dtype, fwd_dtype
from dist_quant.kernels.kinds_base import AmaxAlgo as AmaxAlgo
from dist_quant.kernels.kinds_base import Kind
from dist_quant.kernels.reference import FLOAT8_BLOCK, MXFP8_BLOCK

NVFP4_BLOCK = 16
"""Elements per NVFP4 scale block (1x16 along the contracted dim; 16x16 for 2D weights)."""

SCALED_MM_ALIGNMENT = 16
"""`torch._scaled_mm` (cuBLASLt FP8) wants K and N divisible by 16, and grouped splits padded so."""


class ScalingKind(Kind):
    """How a quantizer scales a tensor (`Quantizer.scaling`)."""

    DELAYED = "delayed"
    """Per tensor, the scale from earlier steps' amax history."""
    CURRENT = "current"
    """Per tensor, the scale from this tensor's own amax."""
    MXFP8 = "mxfp8"
    """One E8M0 power-of-two scale per 32 consecutive elements."""
    BLOCK = "block"
    """One fp32 scale per 1x128 tile or 128x128 block."""
    NVFP4 = "nvfp4"
    """4-bit E2M1 values, one E4M3 scale per 16 elements (or 16x16 weight block) and one fp32
    global scale per tensor and direction."""
    IDENTITY = "identity"
    """High precision: nothing is quantized."""

    @property
    def per_tensor(self) -> bool:
        """One scale for the whole tensor: its FP8 bytes can be all-gathered with the scale."""
        return self in (ScalingKind.DELAYED, ScalingKind.CURRENT)

    @property
    def needs_fp8_gemm(self) -> bool:
        """Its GEMMs take FP8 operands (real FP8 tensor cores, or the exact emulation)."""
        return self is not ScalingKind.IDENTITY

    @property
    def fp8_attention(self) -> bool:
        """FP8 attention can consume and produce it: per-tensor FP8, MXFP8 or identity, not
        Float8 block tiles or NVFP4."""
        return self not in (ScalingKind.BLOCK, ScalingKind.NVFP4)

    def row_alignment(self, device: torch.device) -> int:
        """The row multiple a tensor of this kind needs on `device`'s kernels: a block's length
        (MXFP8 32, Float8 block 128), 16 for per-tensor FP8 where `torch._scaled_mm` runs (CUDA),
        1 otherwise (the emulation, high precision)."""
        if self is ScalingKind.MXFP8:
            return MXFP8_BLOCK
        if self is ScalingKind.BLOCK:
            return FLOAT8_BLOCK
        if self is ScalingKind.NVFP4:
            return NVFP4_BLOCK
        if self.per_tensor and device.type == "cuda":
            return SCALED_MM_ALIGNMENT
        return 1


class OperandLayout(Kind):
    """What a `GemmOperand`'s `scale_inv` holds, along its last (contracted) dim."""

    TENSOR = "tensor"
    """One fp32 scale inverse for the whole operand."""
    MXFP8 = "mxfp8"
    """uint8 E8M0 exponents, one per 32 elements."""
    BLOCK1D = "block1d"
    """fp32 scale inverses of 1x128 tiles."""
    BLOCK2D = "block2d"
    """fp32 scale inverses of 128x128 blocks."""
    NVFP4 = "nvfp4"
    """E4M3 decode scales of 16-element blocks (the bytes pack two E2M1 values each), with the
    operand's fp32 global decode scale beside them."""

    @property
    def per_tensor(self) -> bool:
        return self is OperandLayout.TENSOR

    @property
    def block_dim(self) -> int | None:
        """The Float8 block layout's `block_dim` (1: 1x128, 2: 128x128), None for other layouts."""
        return _BLOCK_DIMS.get(self)

    @staticmethod
    def of_block_dim(block_dim: int) -> OperandLayout:
        """The layout of a Float8 block operand with `block_dim` 1 or 2."""
        return OperandLayout.BLOCK1D if block_dim == 1 else OperandLayout.BLOCK2D


_BLOCK_DIMS = {OperandLayout.BLOCK1D: 1, OperandLayout.BLOCK2D: 2}


class Direction(Kind):
    """The pass a quantizer slot belongs to; `RecipeState`'s `mode`."""

    FORWARD = "forward"
    BACKWARD = "backward"

    @property
    def fwd(self) -> bool:
        """The `fwd=` flag of `get_quantizer_roles` / `num_quantizers` for this direction."""
        return self is Direction.FORWARD

    @staticmethod
    def of(fwd: bool) -> Direction:
        return Direction.FORWARD if fwd else Direction.BACKWARD

    def fp8_dtype(self, fmt: Format) -> torch.dtype:
        """The float8 dtype of this direction's tensors under `fmt` (HYBRID: E4M3 forward, E5M2
        backward)."""
        return fwd_dtype(fmt) if self is Direction.FORWARD else bwd_dtype(fmt)


class ParallelMode(Kind):
    """How a GEMM is split over a tensor-parallel group (Megatron-LM's, as in Transformer Engine):
    a module's `parallel_mode`, `TPLayout.mode`."""

    COLUMN = "column"
    """The weight's rows (output features) are sharded: the output holds this rank's features."""
    ROW = "row"
    """The weight's columns (input features) are sharded: the input holds this rank's features
    and the partial outputs are summed over the group."""

    @property
    def weight_split_dim(self) -> int:
        """The dim of the `(out, in)` weight that is split over the ranks."""
        return 0 if self is ParallelMode.COLUMN else 1


class PassMode(Kind):
    """How one pass of a quantized GEMM triple runs: a recipe's `forward_override` /
    `backward_override` (Transformer Engine's spellings), None meaning QUANTIZED."""

    QUANTIZED = "quantized"
    """The recipe's quantizers, on the operands the pass has (the default)."""
    HIGH_PRECISION = "high_precision"
    """No quantization in this pass: the GEMMs take the original high-precision operands (the
    forward keeps them for the backward)."""
    DEQUANTIZED = "dequantized"
    """Backward only: the GEMMs run in high precision on the forward's quantized operands,
    dequantized, and the unquantized output gradient."""

    @staticmethod
    def of(override: str | None) -> PassMode:
        return PassMode.QUANTIZED if override is None else PassMode(override)

    @staticmethod
    def of_recipe(recipe: object) -> tuple[PassMode, PassMode]:
        """(forward, backward) modes of a recipe's linear GEMMs: its `forward_override` /
        `backward_override`, QUANTIZED for a recipe without them (HighPrecision)."""
        return (
            PassMode.of(getattr(recipe, "forward_override", None)),
            PassMode.of(getattr(recipe, "backward_override", None)),
        )


_K = TypeVar("_K", bound=Kind)


def parse_kind(kind: type[_K], value: object, where: str) -> _K:
    """`value` as a member of `kind` (a member, or its string spelling); ValueError naming `where`
    and the valid spellings otherwise."""
    try:
        return kind(value)
    except ValueError:
        valid = ", ".join(repr(k.value) for k in kind)
        raise ValueError(f"{where} must be one of {valid}, got {value!r}") from None
