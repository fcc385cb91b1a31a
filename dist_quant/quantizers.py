"""Quantizers: turn a high-precision tensor into a ``QuantizedTensor`` under one scaling scheme.

Numerics live in the kernels (``kernels/reference.py`` defines them bit for bit); a quantizer only
picks the scale, calls the kernels and packs the result. One collective lives here: a
current-scaling quantizer given an ``amax_reduction_group`` all-reduces (MAX) its amax over that
group before scaling (``allreduce_current_amax``, which FSDP's FP8 weight all-gather shares).
Delayed-scaling quantizers never talk to other ranks: ``dist_quant.amax`` reduces their amaxes
after the fact, once per direction per step.

Usage flags (``set_usage``) say which GEMM operands the caller needs: ``rowwise`` for the tensor as
the left/right operand contracted along its last dim, ``columnwise`` for its transpose.
"""

from __future__ import annotations

import abc
import copy
import math
from collections.abc import Callable
from typing import Any, ClassVar, NamedTuple

import torch
import torch.distributed as dist
from torch import Tensor

# The quantizer-facing kernels: dispatchers that run Triton for CUDA tensors, the reference else.
from dist_quant import kernels as fp8_kernels
from dist_quant.kinds import ScalingKind, parse_kind
from dist_quant.tensor import Float8BlockwiseTensor, Float8Tensor, MXFP8Tensor, QuantizedTensor

_HP_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


class PerTensorCast(NamedTuple):
    """One per-tensor cast without its container (``Float8Quantizer.cast``): the FP8 bytes in
    ``x``'s shape, the ``(cols, rows)`` transpose of the 2D view or None, the (1,) fp32 scale
    inverse."""

    data: Tensor
    data_t: Tensor | None
    scale_inv: Tensor


CastObserver = Callable[["Quantizer", Tensor, "Tensor | None"], None]
# Observers of casts (`dist_quant.telemetry` installs one for its stats steps only): called with
# the quantizer, its input and the per-tensor scale it cast with (None for per-block scaling).
# Empty outside stats steps, so a cast then pays one tuple truth test.
_cast_observers: tuple[CastObserver, ...] = ()


def add_cast_observer(observer: CastObserver) -> None:
    global _cast_observers
    _cast_observers = (*_cast_observers, observer)


def remove_cast_observer(observer: CastObserver) -> None:
    global _cast_observers
    _cast_observers = tuple(o for o in _cast_observers if o is not observer)


def observe_cast(q: Quantizer, x: Tensor, scale: Tensor | None) -> None:
    for observer in _cast_observers:
        observer(q, x, scale)


def allreduce_current_amax(amax: Tensor, group: Any) -> None:
    """In-place all-reduce(MAX) of a current-scaling fp32 amax over `group` (no-op for a group of
    one rank, or without torch.distributed): the quantizers' one collective, which FSDP's FP8 weight
    all-gather shares (`dist_quant.fsdp`)."""
    if group is None or not dist.is_available() or not dist.is_initialized():
        return
    if dist.get_world_size(group) > 1:
        dist.all_reduce(amax, op=dist.ReduceOp.MAX, group=group)  # local amax -> group's amax


class Quantizer(abc.ABC):
    """Base of every quantizer: ``quantize(x)``, ``set_usage``, ``scaling``, ``fp8_dtype`` and
    ``describe()``.

    A subclass sets ``scaling`` to its ``ScalingKind`` (a string spelling such as ``"current"`` is
    turned into the kind when the class is defined): modules read its capabilities from it."""

    scaling: ClassVar[ScalingKind]
    stats_slot: tuple[str, str, str] | None = None
    """(module name, tensor type, direction) of the slot this quantizer was planned for; set by
    the runtime at plan time (a copy made for tensor parallelism keeps it), read by telemetry."""

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if "scaling" in cls.__dict__:
            cls.scaling = parse_kind(
                ScalingKind, cls.__dict__["scaling"], f"{cls.__name__}.scaling"
            )
        elif "quantize" in cls.__dict__ and not hasattr(cls, "scaling"):
            raise TypeError(
                f"{cls.__name__} must set `scaling` to a dist_quant.kinds.ScalingKind (or its "
                f"spelling: {', '.join(repr(k.value) for k in ScalingKind)}): the modules read "
                "its capabilities (alignment, FP8 attention, FP8 GEMM) from it"
            )

    def __init__(self, fp8_dtype: torch.dtype) -> None:
        if fp8_dtype not in fp8_kernels.FP8_DTYPES:
            raise ValueError(
                f"{type(self).__name__}: fp8_dtype must be torch.float8_e4m3fn or "
                f"torch.float8_e5m2, got {fp8_dtype!r}"
            )
        self.fp8_dtype: torch.dtype | None = fp8_dtype
        self.rowwise_usage = True
        self.columnwise_usage = True

    def set_usage(self, rowwise: bool = True, columnwise: bool = True) -> None:
        """Which copies the next ``quantize`` calls produce; at least one must be requested."""
        if not isinstance(rowwise, bool) or not isinstance(columnwise, bool):
            raise ValueError(
                f"{type(self).__name__}.set_usage: rowwise and columnwise must be bool, "
                f"got rowwise={rowwise!r}, columnwise={columnwise!r}"
            )
        if not (rowwise or columnwise):
            raise ValueError(
                f"{type(self).__name__}.set_usage: at least one of rowwise/columnwise must be True"
            )
        if (rowwise, columnwise) == (self.rowwise_usage, self.columnwise_usage):
            return  # no store: torch.compile refuses a mutation inside an autograd.Function's backward
        self.rowwise_usage = rowwise
        self.columnwise_usage = columnwise

    @abc.abstractmethod
    def quantize(self, x: Tensor) -> QuantizedTensor | Tensor:
        """Quantize ``x`` (fp32, bf16 or fp16)."""

    def _regrouped(self, built: Quantizer | None, group: Any) -> Quantizer:
        """This quantizer with ``amax_reduction_group = group``. Eagerly (and for a subclass,
        whose fields a constructor call would miss: ``built`` None) a shallow copy, which keeps
        every instance attribute. While dynamo traces, ``built`` (made by the class's constructor
        from this one's fields) given its usage flags and slot: a compiled tensor-parallel forward
        plans its slots, and makes this copy, while it traces, and torch 2.11's dynamo cannot
        trace a copy."""
        if built is None:
            built = copy.copy(self)
            built.amax_reduction_group = group
            return built
        built.rowwise_usage, built.columnwise_usage = self.rowwise_usage, self.columnwise_usage
        if _cast_observers:
            # the slot telemetry files the copy's casts under; a trace without observers leaves it
            # unread, or every block's own name would become a guard of its compiled graph
            built.stats_slot = self.stats_slot
        return built

    def _check_input(self, x: object) -> Tensor:
        if not isinstance(x, Tensor) or x.dtype not in _HP_DTYPES:
            what = x.dtype if isinstance(x, Tensor) else type(x).__name__
            raise ValueError(
                f"{type(self).__name__}.quantize: expects a float32/bfloat16/float16 tensor, "
                f"got {what}"
            )
        return x

    def describe(self) -> tuple:
        """What this quantizer does to a tensor, for the plan digest that ranks of one tensor-
        parallel group must agree on: its class, kind and FP8 dtype, plus (in subclasses) every
        other setting that changes its output, all as values whose repr is the same in every
        process. Not its buffers' contents or usage flags. A subclass with settings of its own
        extends the tuple, so no setting escapes the digest."""
        return (type(self).__name__, self.scaling.value, ("fp8_dtype", str(self.fp8_dtype)))

    def __repr__(self) -> str:
        return f"{type(self).__name__}(fp8_dtype={self.fp8_dtype})"


class Float8Quantizer(Quantizer):
    """Delayed scaling: casts with a scale computed from earlier steps' amaxes.

    ``scale`` and ``amax`` are 1-element fp32 views into buffers owned by a recipe state:
    ``scale`` into its scale vector, ``amax`` into row 0 of its amax history. Each ``quantize``
    folds ``max(|x|)`` into ``amax`` (a running max over the step; NaN propagates so a bad step is
    visible to the update) and casts with the current ``scale``. The update that turns history into
    a new scale happens elsewhere (``dist_quant.amax``), after the amax reduction.
    """

    scaling = ScalingKind.DELAYED

    def __init__(self, scale: Tensor, amax: Tensor, fp8_dtype: torch.dtype) -> None:
        super().__init__(fp8_dtype)
        for name, buf in (("scale", scale), ("amax", amax)):
            if not isinstance(buf, Tensor) or buf.dtype != torch.float32 or buf.numel() != 1:
                got = f"{buf.dtype} {tuple(buf.shape)}" if isinstance(buf, Tensor) else repr(buf)
                raise ValueError(
                    f"Float8Quantizer: {name} must be a 1-element float32 tensor, got {got}"
                )
        if scale.device != amax.device:
            raise ValueError(
                f"Float8Quantizer: scale ({scale.device}) and amax ({amax.device}) must share a "
                "device"
            )
        self.scale = scale
        self.amax = amax

    def quantize(self, x: Tensor) -> Float8Tensor:
        return _per_tensor_quantize(self, x)

    def cast(self, x: Tensor, *, transpose: bool) -> PerTensorCast:
        """What ``quantize`` wraps in a ``Float8Tensor``: the bytes, their transpose (only with
        ``transpose``, ``x`` at least 1-D) and the scale inverse, whatever the usage flags say."""
        x = self._check_input(x)
        # One pass reads x, writes the FP8 bytes (and their transpose) and folds max(|x|) into
        # the history slot; on CUDA a single Triton launch, no host sync. scale_inv is 1/scale
        # as of this cast: the update changes scale later.
        out = fp8_kernels.delayed_cast(
            x, self.scale, self.fp8_dtype, self.amax, transpose=transpose
        )
        if _cast_observers:
            observe_cast(self, x, self.scale)
        return PerTensorCast(out.data, out.data_t, out.scale_inv)

    def cast_swiglu(self, h: Tensor, *, transpose: bool) -> PerTensorCast:
        """``cast(swiglu(h))`` (``h = [gate, up]`` along the last dim, fc1's output) without
        writing ``swiglu(h)``: the same bytes, transpose, scale inverse and amax fold, one launch
        on CUDA (``kernels/swiglu_cast.py``). A telemetry step's observers read the activation
        itself, so there it is computed and cast as two ops."""
        h = self._check_input(h)
        if _cast_observers:
            return self.cast(fp8_kernels.swiglu(h), transpose=transpose)
        out = fp8_kernels.delayed_swiglu_cast(
            h, self.scale, self.fp8_dtype, self.amax, transpose=transpose
        )
        return PerTensorCast(out.data, out.data_t, out.scale_inv)

    def cast_swiglu_backward(self, dy: Tensor, h: Tensor, *, transpose: bool) -> PerTensorCast:
        """``cast(swiglu_backward(dy, h))`` (fc1's incoming gradient from the activation's) without
        writing the high-precision gradient: the same bytes, transpose, scale inverse and amax
        fold, one launch on CUDA (``kernels/swiglu_backward_cast.py``); two ops on a telemetry
        step, as ``cast_swiglu``."""
        h = self._check_input(h)
        if _cast_observers:
            return self.cast(fp8_kernels.swiglu_backward(dy, h), transpose=transpose)
        out = fp8_kernels.delayed_swiglu_backward_cast(
            dy, h, self.scale, self.fp8_dtype, self.amax, transpose=transpose
        )
        return PerTensorCast(out.data, out.data_t, out.scale_inv)


class Float8CurrentScalingQuantizer(Quantizer):
    """Current scaling: the scale comes from this tensor's own amax.

    ``amax_epsilon`` floors the amax; ``use_power_2_scales`` rounds the scale down to a power of
    two. With ``amax_reduction_group`` the amax is first all-reduced (MAX) over that group, so
    every rank of a sequence-parallel group uses one scale and a quantized all-gather of the shards
    equals quantizing the gathered tensor. That choice changes numerics: set it only where shards
    of one logical tensor are quantized.
    """

    scaling = ScalingKind.CURRENT

    def __init__(
        self,
        fp8_dtype: torch.dtype,
        use_power_2_scales: bool = False,
        amax_epsilon: float = 0.0,
        amax_reduction_group: Any = None,
    ) -> None:
        super().__init__(fp8_dtype)
        if not (isinstance(amax_epsilon, (int, float)) and amax_epsilon >= 0.0):
            raise ValueError(
                f"Float8CurrentScalingQuantizer: amax_epsilon must be a number >= 0, "
                f"got {amax_epsilon!r}"
            )
        self.use_power_2_scales = bool(use_power_2_scales)
        self.amax_epsilon = float(amax_epsilon)
        self.amax_reduction_group = amax_reduction_group

    def with_amax_reduction_group(self, group: Any) -> Float8CurrentScalingQuantizer:
        """A copy that all-reduces its amax over ``group`` (``parallel.tp_amax_quantizer``)."""
        built = (
            Float8CurrentScalingQuantizer(
                self.fp8_dtype, self.use_power_2_scales, self.amax_epsilon, group
            )
            if type(self) is Float8CurrentScalingQuantizer and torch.compiler.is_compiling()
            else None
        )
        return self._regrouped(built, group)

    def describe(self) -> tuple:
        return (
            *super().describe(),
            ("use_power_2_scales", self.use_power_2_scales),
            ("amax_epsilon", self.amax_epsilon),
            ("amax_reduction_group", group_ranks(self.amax_reduction_group)),
        )

    def quantize(self, x: Tensor) -> Float8Tensor:
        return _per_tensor_quantize(self, x)

    def cast(self, x: Tensor, *, transpose: bool) -> PerTensorCast:
        """As ``Float8Quantizer.cast``."""
        x = self._check_input(x)
        if self.amax_reduction_group is None:
            # amax -> scale -> cast (+ transpose) without a host sync: two launches on CUDA.
            out = fp8_kernels.current_scaling_cast(
                x,
                self.fp8_dtype,
                amax_epsilon=self.amax_epsilon,
                use_power_2_scales=self.use_power_2_scales,
                transpose=transpose,
            )
            if _cast_observers:
                observe_cast(self, x, out.scale)
            return PerTensorCast(out.data, out.data_t, out.scale_inv)
        x_amax = fp8_kernels.amax(x).reshape(1)  # (1,): a plain 1-element buffer to all-reduce
        allreduce_current_amax(x_amax, self.amax_reduction_group)
        scale, scale_inv = fp8_kernels.current_scale(
            x_amax,
            self.fp8_dtype,
            amax_epsilon=self.amax_epsilon,
            use_power_2_scales=self.use_power_2_scales,
        )
        if _cast_observers:
            observe_cast(self, x, scale)
        if transpose:
            data, data_t = fp8_kernels.cast_transpose(x, scale, self.fp8_dtype)
        else:
            data, data_t = fp8_kernels.cast_to_fp8(x, scale, self.fp8_dtype), None
        return PerTensorCast(data, data_t, scale_inv)

    def cast_swiglu(self, h: Tensor, *, transpose: bool) -> PerTensorCast:
        """As ``Float8Quantizer.cast_swiglu``: SwiGLU writes its output and amax partials in one
        launch and the cast reads that output once (two launches on CUDA, not three). With an
        ``amax_reduction_group`` (the amax is all-reduced between the passes) or on a telemetry
        step, the activation is computed and cast as two ops."""
        h = self._check_input(h)
        if self.amax_reduction_group is not None or _cast_observers:
            return self.cast(fp8_kernels.swiglu(h), transpose=transpose)
        out = fp8_kernels.current_swiglu_cast(
            h,
            self.fp8_dtype,
            amax_epsilon=self.amax_epsilon,
            use_power_2_scales=self.use_power_2_scales,
            transpose=transpose,
        )
        return PerTensorCast(out.data, out.data_t, out.scale_inv)

    def cast_swiglu_backward(self, dy: Tensor, h: Tensor, *, transpose: bool) -> PerTensorCast:
        """As ``Float8Quantizer.cast_swiglu_backward``: the SwiGLU backward writes the gradient and
        its amax partials in one launch, the cast reads it once; two ops with an
        ``amax_reduction_group`` or on a telemetry step, as ``cast_swiglu``."""
        h = self._check_input(h)
        if self.amax_reduction_group is not None or _cast_observers:
            return self.cast(fp8_kernels.swiglu_backward(dy, h), transpose=transpose)
        out = fp8_kernels.current_swiglu_backward_cast(
            dy,
            h,
            self.fp8_dtype,
            amax_epsilon=self.amax_epsilon,
            use_power_2_scales=self.use_power_2_scales,
            transpose=transpose,
        )
        return PerTensorCast(out.data, out.data_t, out.scale_inv)


class MXFP8Quantizer(Quantizer):
    """MXFP8: 32-element blocks with a shared E8M0 power-of-two scale (RCEIL exponent).

    The rowwise copy (blocks along the last dim) and the columnwise copy (blocks along the first
    dim of the 2D view, stored transposed) are both quantized from the original tensor, as the
    usage flags ask: the transpose of a rowwise copy would have the wrong blocks.
    """

    scaling = ScalingKind.MXFP8

    def __init__(self, fp8_dtype: torch.dtype = torch.float8_e4m3fn) -> None:
        super().__init__(fp8_dtype)

    def quantize(self, x: Tensor) -> MXFP8Tensor:
        x = self._check_input(x)
        if _cast_observers:
            observe_cast(self, x, None)
        rowwise = fp8_kernels.mxfp8_cast(x, self.fp8_dtype) if self.rowwise_usage else None
        columnwise = (
            fp8_kernels.mxfp8_cast(x, self.fp8_dtype, columnwise=True)
            if self.columnwise_usage
            else None
        )
        return MXFP8Tensor(
            shape=x.shape,
            dtype=x.dtype,
            fp8_dtype=self.fp8_dtype,
            rowwise=rowwise,
            columnwise=columnwise,
        )


class Float8BlockQuantizer(Quantizer):
    """Float8 block scaling: one fp32 scale per 1x128 tile (``block_scaling_dim=1``, activations
    and gradients) or per 128x128 block (``block_scaling_dim=2``, weights); power-of-two scales by
    default. 1x128 copies for each usage are quantized from the original; a 128x128 grid's
    columnwise copy is the exact transpose of its rowwise copy."""

    scaling = ScalingKind.BLOCK

    def __init__(
        self,
        fp8_dtype: torch.dtype = torch.float8_e4m3fn,
        block_scaling_dim: int = 1,
        use_power_2_scales: bool = True,
    ) -> None:
        super().__init__(fp8_dtype)
        if block_scaling_dim not in (1, 2):
            raise ValueError(
                "Float8BlockQuantizer: block_scaling_dim must be 1 (1x128 tiles) or 2 "
                f"(128x128 blocks), got {block_scaling_dim!r}"
            )
        self.block_scaling_dim = block_scaling_dim
        self.use_power_2_scales = bool(use_power_2_scales)

    def describe(self) -> tuple:
        return (
            *super().describe(),
            ("block_scaling_dim", self.block_scaling_dim),
            ("use_power_2_scales", self.use_power_2_scales),
        )

    def quantize(self, x: Tensor) -> Float8BlockwiseTensor:
        x = self._check_input(x)
        dim, pow2 = self.block_scaling_dim, self.use_power_2_scales
        if _cast_observers:
            observe_cast(self, x, None)
        rowwise = columnwise = None
        if self.rowwise_usage or dim == 2:  # a 128x128 columnwise copy derives from the rowwise
            rowwise = fp8_kernels.block_cast(
                x, self.fp8_dtype, block_dim=dim, use_power_2_scales=pow2
            )
        if self.columnwise_usage and dim == 1:
            if x.dim() == 0:
                raise ValueError("Float8BlockQuantizer: a 0-dim tensor has no columnwise copy")
            x_t = x.reshape(math.prod(x.shape[:-1]), x.shape[-1]).t()  # (cols, rows)
            columnwise = fp8_kernels.block_cast(
                x_t, self.fp8_dtype, block_dim=1, use_power_2_scales=pow2
            )
        return Float8BlockwiseTensor(
            shape=x.shape,
            dtype=x.dtype,
            fp8_dtype=self.fp8_dtype,
            block_dim=dim,
            rowwise=rowwise,
            columnwise=columnwise,
        )

    def __repr__(self) -> str:
        return (
            f"Float8BlockQuantizer(fp8_dtype={self.fp8_dtype}, "
            f"block_scaling_dim={self.block_scaling_dim}, "
            f"use_power_2_scales={self.use_power_2_scales})"
        )


class IdentityQuantizer(Quantizer):
    """High precision: ``quantize(x)`` returns ``x`` itself."""

    scaling = ScalingKind.IDENTITY

    def __init__(self) -> None:
        # No FP8 dtype to validate, so the base initialiser (which requires one) is skipped.
        self.fp8_dtype = None
        self.rowwise_usage = True
        self.columnwise_usage = True

    def quantize(self, x: Tensor) -> Tensor:
        return x

    def __repr__(self) -> str:
        return "IdentityQuantizer()"


def group_ranks(group: Any) -> tuple[int, ...] | str | None:
    """A reduction group as the global ranks it spans (the same on each of them); "unresolved"
    where torch.distributed cannot name them (not initialised, or not a process group)."""
    if group is None:
        return None
    if not dist.is_initialized():
        return "unresolved"
    try:
        return tuple(dist.get_process_group_ranks(group))
    except (RuntimeError, ValueError, TypeError, AttributeError):
        return "unresolved"


def _per_tensor_quantize(
    q: Float8Quantizer | Float8CurrentScalingQuantizer, x: Tensor
) -> Float8Tensor:
    """A per-tensor quantizer's ``quantize``: its cast, the transpose fused in with columnwise
    usage (otherwise ``Float8Tensor`` builds it on first use). ``cast`` validates ``x``; a
    non-tensor asks for no transpose and is refused there."""
    transpose = q.columnwise_usage and isinstance(x, Tensor) and x.dim() >= 1
    out = q.cast(x, transpose=transpose)
    return Float8Tensor(out.data, out.scale_inv, dtype=x.dtype, data_t=out.data_t)
