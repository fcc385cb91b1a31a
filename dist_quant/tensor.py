"""Quantized tensors: containers of FP8 data and scales, plus the GEMM operands they hand out.

A ``QuantizedTensor`` is not a ``torch.Tensor`` subclass: it holds FP8 bytes and their scales and
knows how to dequantize and how to present itself to a GEMM. A GEMM contracts its operands along
their last dim, so each tensor offers two 2D operands (docs/INTERNALS.md):

- ``rowwise_operand()``: the ``(rows, cols)`` view, quantized along ``cols``;
- ``columnwise_operand()``: the transpose ``(cols, rows)``, quantized along ``rows``.

Per-tensor FP8 gets its transpose by transposing bytes (one scale fits both), built on first use and
cached unless the quantizer already produced it. MXFP8 and 1x128 blocks have scales along one
direction only, so their columnwise copy is quantized from the original high-precision tensor at
quantize time. A 128x128 block grid is symmetric: its transpose is an exact transpose of the bytes
and of the scale grid.

``to_saved`` / ``from_saved`` flatten a container into its tensors plus a tensor-free
``SavedLayout`` and rebuild it: autograd Functions save containers through
``ctx.save_for_backward`` this way, so saved-tensor hooks (non-reentrant checkpointing, offload)
see every byte.
"""

from __future__ import annotations

import abc
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import NoReturn

import torch
from torch import Tensor

# The kernel ops (kernels/_op.py): Triton on CUDA, the reference elsewhere, called directly when
# eager and as their torch.library ops while torch.compile traces.
from dist_quant import kernels as fp8_kernels
from dist_quant.kinds import NVFP4_BLOCK, OperandLayout, parse_kind


def rounded_to(t: Tensor, dtype: torch.dtype) -> Tensor:
    """``t`` in ``dtype``: ``t`` itself when it already is, never ``t.to(t.dtype)``.

    Eagerly the two are the same tensor object, but torch 2.11's dynamo records the no-op cast as a
    second graph node for that one object and traces an autograd.Function's forward with every
    intermediate as an extra output: a forward returning the cast then returns one tensor twice,
    autograd routes its gradient to the other slot and the compiled backward runs on zeros
    (a zero input gradient; a delayed-scaling enrolment hoisted into the forward). Every value an
    autograd.Function of ours returns is rounded to its dtype this way.
    """
    return t if t.dtype == dtype else t.to(dtype)


@dataclass(frozen=True)
class GemmOperand:
    """A 2D FP8 (or NVFP4) matrix ``(rows, K)`` quantized along its last dim, ready for ``gemm``.

    ``scaling`` is its ``OperandLayout`` (a string spelling is turned into one): ``scale_inv`` is
    the fp32 per-tensor scale inverse (``TENSOR``), the uint8 E8M0 block exponents (``MXFP8``),
    the fp32 tile scale inverses (``BLOCK1D``: 1x128, ``BLOCK2D``: 128x128) or the E4M3 decode
    scales of 16-element blocks (``NVFP4``: ``data`` is then uint8 ``(rows, K // 2)``, two E2M1
    codes a byte, ``amax`` the operand's fp32 global amax and ``rht`` whether its values went
    through the random Hadamard transform along K).
    """

    data: Tensor
    scale_inv: Tensor
    scaling: OperandLayout
    fp8_dtype: torch.dtype
    amax: Tensor | None = None
    rht: bool = False

    def __post_init__(self) -> None:
        if type(self.scaling) is not OperandLayout:
            layout = parse_kind(OperandLayout, self.scaling, "GemmOperand.scaling")
            object.__setattr__(self, "scaling", layout)
        nvfp4 = self.scaling is OperandLayout.NVFP4
        data_dtype = torch.uint8 if nvfp4 else self.fp8_dtype
        if self.data.dim() != 2 or self.data.dtype != data_dtype:
            raise ValueError(
                f"GemmOperand.data must be a 2D {data_dtype} tensor, "
                f"got {self.data.dtype} of shape {tuple(self.data.shape)}"
            )
        if nvfp4 != (self.amax is not None):
            raise ValueError("GemmOperand: an NVFP4 operand, and only one, carries its amax")

    @property
    def shape(self) -> torch.Size:
        """``(rows, K)``: the matrix it stands for (NVFP4 bytes hold two elements each)."""
        if self.scaling is OperandLayout.NVFP4:
            rows, half = self.data.shape
            return torch.Size((rows, 2 * half))
        return self.data.shape

    def dequantize(self, dtype: torch.dtype = torch.float32) -> Tensor:
        """The 2D matrix this operand stands for, computed in fp32 and cast to ``dtype`` (an
        NVFP4 operand's Hadamard transform undone)."""
        if self.scaling is OperandLayout.TENSOR:
            return fp8_kernels.dequantize(self.data, self.scale_inv, dtype)
        if self.scaling is OperandLayout.NVFP4:
            _, s_dec = fp8_kernels.nvfp4_global_scales(self.amax)
            out = fp8_kernels.dequantize_nvfp4(
                self.data, self.scale_inv, s_dec, dtype=torch.float32
            )
            return rounded_to(undo_rht(out) if self.rht else out, dtype)
        if self.scaling is OperandLayout.MXFP8:
            return fp8_kernels.mxfp8_dequantize(self.data, self.scale_inv, dtype=dtype)
        return fp8_kernels.block_dequantize(
            self.data, self.scale_inv, block_dim=self.scaling.block_dim, dtype=dtype
        )


def hadamard_matrix(device: torch.device) -> Tensor:
    """The 16x16 fp32 matrix ``M`` of NVFP4's random Hadamard transform as the kernels apply it to
    each 16-element block ``b`` of a row (``b -> b @ M``), read off by transforming the identity.
    ``M`` is orthogonal, so ``M.T`` undoes it."""
    eye = torch.eye(NVFP4_BLOCK, dtype=torch.float32, device=device)
    return fp8_kernels.random_hadamard_transform(eye)


def undo_rht(x: Tensor) -> Tensor:
    """The inverse random Hadamard transform of fp32 ``x`` ``(rows, cols)`` along cols, per
    16-element block (exact up to fp32 rounding of the product)."""
    rows, cols = x.shape
    blocks = x.reshape(rows, cols // NVFP4_BLOCK, NVFP4_BLOCK)
    return (blocks @ hadamard_matrix(x.device).t()).reshape(rows, cols)


class QuantizedTensor(abc.ABC):
    """FP8 data with its scales. ``dtype`` is the high-precision dtype it was quantized from."""

    _layout: OperandLayout
    """The layout of the GEMM operands it hands out."""

    def __init__(
        self, *, shape: torch.Size, dtype: torch.dtype, device: torch.device, fp8_dtype: torch.dtype
    ) -> None:
        self.shape = torch.Size(shape)
        self.dtype = dtype
        self.device = device
        self.fp8_dtype = fp8_dtype

    @property
    def ndim(self) -> int:
        return len(self.shape)

    def size(self, dim: int | None = None) -> torch.Size | int:
        return self.shape if dim is None else self.shape[dim]

    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    @abc.abstractmethod
    def data(self) -> Tensor:
        """The rowwise FP8 bytes, in the original shape."""

    @property
    @abc.abstractmethod
    def scale_inv(self) -> Tensor:
        """The rowwise scale inverse (per-tensor fp32, E8M0 uint8, or per-tile fp32)."""

    @abc.abstractmethod
    def dequantize(self, dtype: torch.dtype = torch.float32) -> Tensor:
        """The high-precision tensor (original shape), computed in fp32 and cast to ``dtype``."""

    @abc.abstractmethod
    def rowwise_operand(self) -> GemmOperand:
        """The ``(rows, cols)`` view quantized along ``cols``."""

    @abc.abstractmethod
    def columnwise_operand(self) -> GemmOperand:
        """The transpose ``(cols, rows)`` quantized along ``rows``."""

    def _rows_cols(self) -> tuple[int, int]:
        if self.ndim == 0:
            raise ValueError(f"{type(self).__name__}: a 0-dim tensor has no 2D GEMM view")
        return math.prod(self.shape[:-1]), self.shape[-1]

    def _no_arithmetic(self, *args: object) -> NoReturn:
        raise TypeError(
            f"{type(self).__name__} has no FP8 meaning for arithmetic; call .dequantize() first"
        )

    __add__ = __radd__ = __iadd__ = __sub__ = __rsub__ = __isub__ = _no_arithmetic
    __mul__ = __rmul__ = __imul__ = __truediv__ = __rtruediv__ = __itruediv__ = _no_arithmetic
    __matmul__ = __rmatmul__ = __imatmul__ = __floordiv__ = __rfloordiv__ = _no_arithmetic
    __mod__ = __rmod__ = __pow__ = __rpow__ = __neg__ = __pos__ = __abs__ = _no_arithmetic

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(shape={tuple(self.shape)}, dtype={self.dtype}, "
            f"fp8_dtype={self.fp8_dtype}, scaling={self._layout.value!r}, device={self.device})"
        )


class Float8Tensor(QuantizedTensor):
    """Per-tensor FP8: ``data`` in the original shape and one fp32 ``scale_inv``."""

    _layout = OperandLayout.TENSOR

    def __init__(
        self, data: Tensor, scale_inv: Tensor, *, dtype: torch.dtype, data_t: Tensor | None = None
    ) -> None:
        super().__init__(shape=data.shape, dtype=dtype, device=data.device, fp8_dtype=data.dtype)
        self._data = data
        self._scale_inv = scale_inv
        self._data_t = data_t  # (cols, rows) contiguous, cached once built

    @property
    def data(self) -> Tensor:
        return self._data

    @property
    def scale_inv(self) -> Tensor:
        return self._scale_inv

    def transpose_data(self) -> Tensor:
        """The 2D transpose ``(cols, rows)`` of the bytes; built on first call, then cached."""
        if self._data_t is not None:
            return self._data_t
        rows, cols = self._rows_cols()
        data_t = self._data.reshape(rows, cols).t().contiguous()
        if not torch.compiler.is_compiling():  # a traced graph cannot mutate this container
            self._data_t = data_t
        return data_t

    def dequantize(self, dtype: torch.dtype = torch.float32) -> Tensor:
        return fp8_kernels.dequantize(self._data, self._scale_inv, dtype)

    def rowwise_operand(self) -> GemmOperand:
        rows, cols = self._rows_cols()
        return GemmOperand(
            self._data.reshape(rows, cols), self._scale_inv, OperandLayout.TENSOR, self.fp8_dtype
        )

    def columnwise_operand(self) -> GemmOperand:
        data_t = self.transpose_data()
        return GemmOperand(data_t, self._scale_inv, OperandLayout.TENSOR, self.fp8_dtype)


class _TwoCopyTensor(QuantizedTensor):
    """Block-scaled FP8 whose scales run along one direction, so each GEMM usage has its own copy:
    ``rowwise = (data in the original shape, scales)`` and ``columnwise = (data (cols, rows),
    scales)``. At least one is present; the quantizer's usage flags decide which."""

    def __init__(
        self,
        *,
        shape: torch.Size,
        dtype: torch.dtype,
        fp8_dtype: torch.dtype,
        rowwise: tuple[Tensor, Tensor] | None,
        columnwise: tuple[Tensor, Tensor] | None,
    ) -> None:
        if rowwise is None and columnwise is None:
            raise ValueError(
                f"{type(self).__name__}: needs rowwise or columnwise data, got neither"
            )
        device = (rowwise or columnwise)[0].device
        super().__init__(shape=shape, dtype=dtype, device=device, fp8_dtype=fp8_dtype)
        self._rowwise = rowwise
        self._columnwise = columnwise

    @property
    def data(self) -> Tensor:
        return self._rowwise_pair()[0]

    @property
    def scale_inv(self) -> Tensor:
        return self._rowwise_pair()[1]

    def _rowwise_pair(self) -> tuple[Tensor, Tensor]:
        if self._rowwise is None:
            self._missing("rowwise")
        return self._rowwise

    def _columnwise_pair(self) -> tuple[Tensor, Tensor]:
        if self._columnwise is None:
            self._missing("columnwise")
        return self._columnwise

    def _missing(self, usage: str) -> NoReturn:
        raise ValueError(
            f"{type(self).__name__}: no {usage} data; the quantizer ran with {usage}=False. "
            f"Call quantizer.set_usage({usage}=True) before quantize()."
        )

    def rowwise_operand(self) -> GemmOperand:
        data, scale = self._rowwise_pair()
        rows, cols = self._rows_cols()
        return GemmOperand(data.reshape(rows, cols), scale, self._layout, self.fp8_dtype)

    def columnwise_operand(self) -> GemmOperand:
        data_t, scale_t = self._columnwise_pair()
        return GemmOperand(data_t, scale_t, self._layout, self.fp8_dtype)


class MXFP8Tensor(_TwoCopyTensor):
    """MXFP8: 32-element blocks with uint8 E8M0 exponents, scales ``(rows, ceil(cols/32))``
    rowwise and ``(cols, ceil(rows/32))`` columnwise; each copy quantized from the original."""

    _layout = OperandLayout.MXFP8

    def dequantize(self, dtype: torch.dtype = torch.float32) -> Tensor:
        if self._rowwise is not None:
            return fp8_kernels.mxfp8_dequantize(*self._rowwise, dtype=dtype)
        data_t, scale_t = self._columnwise
        out = fp8_kernels.mxfp8_dequantize(data_t, scale_t, columnwise=True, dtype=dtype)
        return out.reshape(self.shape)


class Float8BlockwiseTensor(_TwoCopyTensor):
    """Float8 block scaling with fp32 tile scale inverses.

    ``block_dim=1`` (1x128 tiles): each direction is quantized from the original, like MXFP8.
    ``block_dim=2`` (128x128 tiles): only the rowwise copy is stored; the columnwise copy is the
    exact transpose of the bytes and of the scale grid, built on first use and cached.
    """

    def __init__(
        self,
        *,
        shape: torch.Size,
        dtype: torch.dtype,
        fp8_dtype: torch.dtype,
        block_dim: int,
        rowwise: tuple[Tensor, Tensor] | None,
        columnwise: tuple[Tensor, Tensor] | None = None,
    ) -> None:
        if block_dim not in (1, 2):
            raise ValueError(f"Float8BlockwiseTensor: block_dim must be 1 or 2, got {block_dim!r}")
        if block_dim == 2 and (rowwise is None or columnwise is not None):
            raise ValueError(
                "Float8BlockwiseTensor: 128x128 blocks store the rowwise copy only; "
                "the columnwise copy is its exact transpose"
            )
        super().__init__(
            shape=shape, dtype=dtype, fp8_dtype=fp8_dtype, rowwise=rowwise, columnwise=columnwise
        )
        self.block_dim = block_dim
        self._layout = OperandLayout.of_block_dim(block_dim)

    def _columnwise_pair(self) -> tuple[Tensor, Tensor]:
        if self.block_dim == 2 and self._columnwise is None:
            data, scale = self._rowwise
            rows, cols = self._rows_cols()
            pair = (data.reshape(rows, cols).t().contiguous(), scale.t().contiguous())
            if torch.compiler.is_compiling():  # a traced graph cannot mutate this container
                return pair
            self._columnwise = pair
        return super()._columnwise_pair()

    def dequantize(self, dtype: torch.dtype = torch.float32) -> Tensor:
        if self._rowwise is not None:
            data, scale = self._rowwise
            return fp8_kernels.block_dequantize(data, scale, block_dim=self.block_dim, dtype=dtype)
        data_t, scale_t = self._columnwise  # only 1x128 tensors can lack the rowwise copy
        out = fp8_kernels.block_dequantize(data_t, scale_t, block_dim=1, dtype=dtype)
        return out.t().reshape(self.shape)


@dataclass(frozen=True)
class SavedLayout:
    """The tensor-free half of a value flattened by ``to_saved``: which container to rebuild and
    the metadata its tensors do not carry. ``kind`` is ``"plain"`` (a tensor or None, saved as
    is), ``"operand"`` (``GemmOperand``), ``"tensor"`` (``Float8Tensor``), ``"mxfp8"`` or
    ``"block"`` (``Float8BlockwiseTensor``), ``"nvfp4"`` (``NVFP4Tensor``, rebuilt by the function
    ``nvfp4_tensor`` registers in ``SAVED_REBUILDERS``: it sits above this file).
    """

    kind: str
    shape: torch.Size | None = None
    dtype: torch.dtype | None = None
    fp8_dtype: torch.dtype | None = None
    block_dim: int = 0
    scaling: OperandLayout | None = None
    rht: bool = False
    """NVFP4: the columnwise copy (or the operand) went through the Hadamard transform."""

    @property
    def num_tensors(self) -> int:
        """How many entries (tensors or None) ``to_saved`` gave for this layout."""
        if self.kind == "operand":
            return 3 if self.scaling is OperandLayout.NVFP4 else 2
        return {"plain": 1, "tensor": 3, "nvfp4": 6}.get(self.kind, 4)


SAVED_REBUILDERS: dict[str, Callable[[tuple, SavedLayout], QuantizedTensor]] = {}
"""``from_saved`` of container kinds defined above this file, by ``SavedLayout.kind``."""


def to_saved(
    value: QuantizedTensor | GemmOperand | Tensor | None,
) -> tuple[tuple[Tensor | None, ...], SavedLayout]:
    """Flatten ``value`` for ``ctx.save_for_backward``: its tensors (None where a copy is absent)
    and the layout ``from_saved`` rebuilds it from. A per-tensor transpose present now is kept (the
    quantizer fused it into the cast); a 128x128 grid's cached transpose is not (it is rebuilt from
    the rowwise copy on use), so what is saved never depends on what ran since the quantize."""
    if value is None or isinstance(value, Tensor):
        return (value,), SavedLayout("plain")
    if isinstance(value, GemmOperand):
        layout = SavedLayout(
            "operand", fp8_dtype=value.fp8_dtype, scaling=value.scaling, rht=value.rht
        )
        if value.scaling is OperandLayout.NVFP4:
            return (value.data, value.scale_inv, value.amax), layout
        return (value.data, value.scale_inv), layout
    if isinstance(value, Float8Tensor):
        layout = SavedLayout("tensor", dtype=value.dtype)
        return (value._data, value._scale_inv, value._data_t), layout
    if isinstance(value, (MXFP8Tensor, Float8BlockwiseTensor)):
        is_mx = isinstance(value, MXFP8Tensor)
        kind, block_dim = ("mxfp8", 0) if is_mx else ("block", value.block_dim)
        rowwise = value._rowwise or (None, None)
        columnwise = (value._columnwise if block_dim != 2 else None) or (None, None)
        layout = SavedLayout(kind, value.shape, value.dtype, value.fp8_dtype, block_dim)
        return (*rowwise, *columnwise), layout
    if value._layout is OperandLayout.NVFP4:
        rht = value.columnwise is not None and value.columnwise.rht
        return value.saved(), SavedLayout("nvfp4", value.shape, value.dtype, rht=rht)
    raise TypeError(f"to_saved: cannot flatten a {type(value).__name__} for save_for_backward")


def from_saved(
    tensors: tuple[Tensor | None, ...], layout: SavedLayout
) -> QuantizedTensor | GemmOperand | Tensor | None:
    """The value ``to_saved`` flattened into ``tensors`` and ``layout``."""
    if len(tensors) != layout.num_tensors:
        raise ValueError(
            f"from_saved: a {layout.kind!r} layout takes {layout.num_tensors} tensors, "
            f"got {len(tensors)}"
        )
    if layout.kind == "plain":
        return tensors[0]
    if layout.kind == "operand":
        data, scale_inv, *amax = tensors
        return GemmOperand(
            data,
            scale_inv,
            layout.scaling,
            layout.fp8_dtype,
            amax=amax[0] if amax else None,
            rht=layout.rht,
        )
    if layout.kind in SAVED_REBUILDERS:
        return SAVED_REBUILDERS[layout.kind](tensors, layout)
    if layout.kind == "tensor":
        data, scale_inv, data_t = tensors
        return Float8Tensor(data, scale_inv, dtype=layout.dtype, data_t=data_t)
    row_data, row_scale, col_data, col_scale = tensors
    rowwise = None if row_data is None else (row_data, row_scale)
    columnwise = None if col_data is None else (col_data, col_scale)
    common = dict(shape=layout.shape, dtype=layout.dtype, fp8_dtype=layout.fp8_dtype)
    if layout.kind == "mxfp8":
        return MXFP8Tensor(**common, rowwise=rowwise, columnwise=columnwise)
    return Float8BlockwiseTensor(
        **common, block_dim=layout.block_dim, rowwise=rowwise, columnwise=columnwise
    )
