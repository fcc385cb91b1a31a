"""`NVFP4Tensor`: a tensor quantized to NVFP4, one copy per GEMM usage.

Each copy is `NVFP4Copy(data, scales, amax, rht)`: `data` packs two E2M1 values per byte (even
element in the low nibble), `(rows, cols // 2)` uint8; `scales` holds the E4M3 decode scale of each
16-element block along `cols`; `amax` is the copy's own fp32 global amax `(1,)`, from which the
global decode scale `S_dec` and the GEMM's alpha follow (kernels/reference.py). The rowwise copy
is the `(rows, cols)` view, the columnwise copy the transpose `(cols, rows)`, each quantized from
the high-precision tensor; with `rht` the columnwise values went through the 16x16 random
Hadamard transform first (along their contracted dim, amax taken after it), which a GEMM of two
transformed operands cancels and `dequantize()` undoes.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

from dist_quant.kinds import OperandLayout
from dist_quant.tensor import (
    SAVED_REBUILDERS,
    GemmOperand,
    QuantizedTensor,
    SavedLayout,
)

SCALE_DTYPE = torch.float8_e4m3fn
"""The format of NVFP4 block decode scales (what `Quantizer.fp8_dtype` reports for NVFP4)."""


class NVFP4Copy(NamedTuple):
    """One usage's NVFP4 quantization of a 2D matrix `(rows, cols)`."""

    data: Tensor  # (rows, cols // 2) uint8, two E2M1 codes per byte
    scales: Tensor  # E4M3 block decode scales, one per 16 elements along cols
    amax: Tensor  # (1,) fp32, this copy's global amax
    rht: bool  # the values went through the random Hadamard transform (along cols)

    def operand(self) -> GemmOperand:
        return GemmOperand(
            self.data, self.scales, OperandLayout.NVFP4, SCALE_DTYPE, amax=self.amax, rht=self.rht
        )


def dequantize_copy(copy: NVFP4Copy, dtype: torch.dtype = torch.float32) -> Tensor:
    """A copy's 2D matrix in fp32 (the transform undone where it was applied), cast to `dtype`."""
    return copy.operand().dequantize(dtype)


class NVFP4Tensor(QuantizedTensor):
    """NVFP4 with a rowwise and/or a columnwise `NVFP4Copy` (the quantizer's usage flags decide
    which); both come from the high-precision tensor, each with its own global amax."""

    _layout = OperandLayout.NVFP4

    def __init__(
        self,
        *,
        shape: torch.Size,
        dtype: torch.dtype,
        rowwise: NVFP4Copy | None,
        columnwise: NVFP4Copy | None,
    ) -> None:
        if rowwise is None and columnwise is None:
            raise ValueError("NVFP4Tensor: needs rowwise or columnwise data, got neither")
        device = (rowwise or columnwise).data.device
        super().__init__(shape=shape, dtype=dtype, device=device, fp8_dtype=SCALE_DTYPE)
        self.rowwise = rowwise
        self.columnwise = columnwise

    def _copy(self, usage: str) -> NVFP4Copy:
        copy = self.rowwise if usage == "rowwise" else self.columnwise
        if copy is None:
            raise ValueError(
                f"NVFP4Tensor: no {usage} data; the quantizer ran with {usage}=False. "
                f"Call quantizer.set_usage({usage}=True) before quantize()."
            )
        return copy

    @property
    def data(self) -> Tensor:
        """The rowwise packed E2M1 bytes `(rows, cols // 2)`."""
        return self._copy("rowwise").data

    @property
    def scale_inv(self) -> Tensor:
        """The rowwise E4M3 block decode scales."""
        return self._copy("rowwise").scales

    def dequantize(self, dtype: torch.dtype = torch.float32) -> Tensor:
        if self.rowwise is not None:
            return dequantize_copy(self.rowwise, dtype).reshape(self.shape)
        return dequantize_copy(self.columnwise, dtype).t().reshape(self.shape)

    def rowwise_operand(self) -> GemmOperand:
        return self._copy("rowwise").operand()

    def columnwise_operand(self) -> GemmOperand:
        return self._copy("columnwise").operand()

    def saved(self) -> tuple[Tensor | None, ...]:
        """The tensors `tensor.to_saved` keeps: (data, scales, amax) of each copy, None where a
        copy is absent (the layout records the columnwise copy's transform)."""
        out: list[Tensor | None] = []
        for copy in (self.rowwise, self.columnwise):
            out.extend((None, None, None) if copy is None else copy[:3])
        return tuple(out)


def _from_saved(tensors: tuple[Tensor | None, ...], layout: SavedLayout) -> NVFP4Tensor:
    row, col = tensors[:3], tensors[3:]
    return NVFP4Tensor(
        shape=layout.shape,
        dtype=layout.dtype,
        rowwise=None if row[0] is None else NVFP4Copy(*row, False),
        columnwise=None if col[0] is None else NVFP4Copy(*col, layout.rht),
    )


SAVED_REBUILDERS["nvfp4"] = _from_saved
