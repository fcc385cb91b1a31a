"""`NVFP4Quantizer`: Transformer Engine's NVFP4 contract (kernels/reference.py defines the bits).

A tensor viewed as `(rows, cols)` gets, as the usage flags ask, a rowwise copy (1x16 blocks along
cols) and a columnwise copy (the transpose, 1x16 blocks along rows), each quantized from the
high-precision tensor with its own global amax. Options, set per slot by the recipe state:
- `block_2d`: 16x16 blocks (weights), so both copies hold the same values;
- `rht`: the columnwise (wgrad) copy goes through the 16x16 random Hadamard transform first, its
  amax taken after the transform;
- `stochastic_rounding`: elements rounded stochastically from `(seed, offset)`, the offset a
  1-element int64 counter that advances by one per copy cast, owned by the recipe state
  (`count_sr_in`; checkpointed with it, whether the recipe or a factory built the quantizer), so
  a run and its resume draw the same bits;
- `amax_reduction_group`: both global amaxes max-reduced over the group (one all-reduce) before
  the casts, so shards of one tensor on tensor-parallel ranks quantize with the whole tensor's
  global scale; with `reduce_amax` (the default) tensor-parallel planning gives a sharded slot
  its TP group (`parallel.tp_amax_quantizer`). A sequence-parallel input is all-gathered in high
  precision and quantized whole, so its amax is the group's by construction.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from dist_quant import kernels as fp8_kernels
from dist_quant.kinds import NVFP4_BLOCK, ScalingKind
from dist_quant.nvfp4_tensor import SCALE_DTYPE, NVFP4Copy, NVFP4Tensor
from dist_quant.quantizers import Quantizer, allreduce_current_amax, group_ranks, observe_cast

__all__ = ["NVFP4Quantizer"]


class NVFP4Quantizer(Quantizer):
    """NVFP4: E2M1 values, an E4M3 decode scale per 16-element block (16x16 with `block_2d`), an
    fp32 global scale per copy (see the module docstring for the options). `fp8_dtype` reports
    the block scales' format, E4M3."""

    scaling = ScalingKind.NVFP4

    def __init__(
        self,
        *,
        block_2d: bool = False,
        rht: bool = False,
        stochastic_rounding: bool = False,
        seed: int = 0,
        sr_offset: Tensor | None = None,
        amax_reduction_group: Any = None,
        reduce_amax: bool = True,
    ) -> None:
        super().__init__(SCALE_DTYPE)
        for name, flag in (
            ("block_2d", block_2d),
            ("rht", rht),
            ("stochastic_rounding", stochastic_rounding),
        ):
            if not isinstance(flag, bool):
                raise ValueError(f"NVFP4Quantizer: {name} must be True or False, got {flag!r}")
        if not isinstance(seed, int) or isinstance(seed, bool) or seed < 0:
            raise ValueError(f"NVFP4Quantizer: seed must be an int >= 0, got {seed!r}")
        self.block_2d, self.rht, self.stochastic_rounding = block_2d, rht, stochastic_rounding
        self.seed = seed
        self.sr_offset = torch.zeros(1, dtype=torch.int64)
        if sr_offset is not None:
            self.count_sr_in(sr_offset)
        self.amax_reduction_group = amax_reduction_group
        self.reduce_amax = bool(reduce_amax)
        """Tensor-parallel planning may give it the TP group where its tensor is sharded."""

    def count_sr_in(self, counter: Tensor) -> None:
        """Advance `counter` (a 1-element int64 CPU tensor) per stochastically rounded cast
        instead of the quantizer's own: a recipe state hands each slot a view into a buffer it
        owns, so a checkpoint of the state carries the rounding stream's position."""
        if counter.dtype != torch.int64 or counter.numel() != 1 or counter.is_cuda:
            raise ValueError(
                f"{self._where()}: sr_offset must be a 1-element int64 CPU tensor, got "
                f"{counter.dtype} {tuple(counter.shape)} on {counter.device}"
            )
        self.sr_offset = counter

    def with_amax_reduction_group(self, group: Any) -> NVFP4Quantizer:
        """A copy that all-reduces its amaxes over ``group`` (``parallel.tp_amax_quantizer``)."""
        built = (
            NVFP4Quantizer(
                block_2d=self.block_2d,
                rht=self.rht,
                stochastic_rounding=self.stochastic_rounding,
                seed=self.seed,
                sr_offset=self.sr_offset,
                amax_reduction_group=group,
                reduce_amax=self.reduce_amax,
            )
            if type(self) is NVFP4Quantizer and torch.compiler.is_compiling()
            else None
        )
        return self._regrouped(built, group)

    def describe(self) -> tuple:
        return (
            *super().describe(),
            ("block_2d", self.block_2d),
            ("rht", self.rht),
            ("stochastic_rounding", self.stochastic_rounding),
            ("seed", self.seed),
            ("reduce_amax", self.reduce_amax),
            ("amax_reduction_group", group_ranks(self.amax_reduction_group)),
        )

    def _where(self) -> str:
        if self.stats_slot is None:
            return "NVFP4Quantizer"
        module, tensor_type, direction = self.stats_slot
        return f"module {module!r}, role {tensor_type} ({direction})"

    def _check_shape(self, rows: int, cols: int) -> None:
        # each copy is blocked along its own last dim: cols for rowwise, rows for columnwise
        for usage, wanted, dim, size in (
            ("rowwise", self.rowwise_usage, "inner dimension", cols),
            ("columnwise", self.columnwise_usage, "row count (tokens)", rows),
        ):
            if wanted and size % NVFP4_BLOCK:
                raise ValueError(
                    f"{self._where()}: NVFP4 needs the {dim} of a tensor's {usage} copy to be a "
                    f"multiple of {NVFP4_BLOCK}, got {size} (shape ({rows}, {cols})); pad it or "
                    "keep this slot in another recipe"
                )

    def _check_traceable(self) -> None:
        if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
            raise NotImplementedError(
                f"{self._where()}: NVFP4 cannot be captured in a CUDA graph yet: its reference "
                "transform and emulated GEMM copy host constants to the device (refused by the "
                "capture, seen on the H200), and stochastic rounding advances a host-side offset "
                "per cast that a replay would freeze; run NVFP4 steps eagerly or compiled"
            )
        if self.stochastic_rounding and torch.compiler.is_compiling():
            raise NotImplementedError(
                f"{self._where()}: stochastic rounding advances a host-side offset per cast, "
                "which a traced graph would freeze; compile around the quantized GEMMs (the "
                "default: the offset read is a graph break) or set stochastic_rounding=False"
            )

    def quantize(self, x: Tensor) -> NVFP4Tensor:
        x = self._check_input(x)
        if x.dim() == 0:
            raise ValueError(f"{self._where()}: a 0-dim tensor has no NVFP4 blocks")
        self._check_traceable()
        observe_cast(self, x, None)
        rows, cols = x.numel() // x.shape[-1], x.shape[-1]
        self._check_shape(rows, cols)
        x2d = x.reshape(rows, cols)
        # (values to cast, cast them columnwise, transformed): the transform needs its output for
        # the amax anyway, so a transformed copy is cast rowwise from it; an untransformed
        # columnwise copy is read in place by the cast and shares the tensor's amax
        sources: list[tuple[Tensor, bool, bool]] = []
        if self.rowwise_usage:
            sources.append((x2d, False, False))
        if self.columnwise_usage and self.rht:
            x_t = fp8_kernels.random_hadamard_transform(x2d.t())  # (cols, rows) fp32
            sources.append((x_t, False, True))
        elif self.columnwise_usage:
            sources.append((x2d, True, False))
        amaxes = torch.stack([fp8_kernels.amax(src).reshape(()) for src, _, _ in sources])
        allreduce_current_amax(amaxes, self.amax_reduction_group)  # one collective for both
        copies = [self._cast(*source, amaxes[i : i + 1]) for i, source in enumerate(sources)]
        rowwise = copies.pop(0) if self.rowwise_usage else None
        columnwise = copies.pop(0) if self.columnwise_usage else None
        return NVFP4Tensor(shape=x.shape, dtype=x.dtype, rowwise=rowwise, columnwise=columnwise)

    def _cast(self, src: Tensor, columnwise: bool, transformed: bool, amax: Tensor) -> NVFP4Copy:
        offset = 0
        if self.stochastic_rounding:
            offset = int(self.sr_offset.item())
            self.sr_offset.add_(1)
        data, scales, _ = fp8_kernels.nvfp4_cast(
            src,
            amax,
            columnwise=columnwise,
            block_2d=self.block_2d,
            stochastic=self.stochastic_rounding,
            seed=self.seed,
            offset=offset,
        )
        return NVFP4Copy(data, scales, amax, transformed)

    def __repr__(self) -> str:
        return (
            f"NVFP4Quantizer(block_2d={self.block_2d}, rht={self.rht}, "
            f"stochastic_rounding={self.stochastic_rounding}, seed={self.seed})"
        )
