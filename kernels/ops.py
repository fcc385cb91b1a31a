"""Kernel entry points as ``torch.library`` custom ops (namespace ``dist_quant``): the op helper,
the per-tensor casts, current scaling and the delayed update (``ops_block.py`` holds MXFP8, block
scaling, dequantize and the block-scaled GEMM).

The default implementation of each op is ``kernels/reference.py`` (CPU, and any device without a
registered kernel); CUDA tensors run the Triton launcher. Each op has a fake (meta) implementation
so that ``torch.compile`` traces through it without running it, and the ops that write scaling
state in place declare it (``mutates_args``), so a compiled graph keeps those writes in order and
a CUDA graph replays them into the same buffers.

Conventions shared by every op, so the fake and the real outputs agree on shape and stride:
outputs are new tensors, never views of an input; per-tensor casts and dequantize keep the
input's layout (``empty_like``, as the launchers and torch's elementwise ops do), a columnwise
MXFP8 dequantize is the transpose of a contiguous buffer (as the reference), everything else is
contiguous; per-tensor scales are 1-element fp32 tensors. Inputs are detached by the dispatchers in ``kernels/__init__.py``: no op here has a
derivative (quantized data is not differentiable; autograd lives in the modules' Functions).

Delayed-update algorithms travel as integer codes (``AmaxAlgo.code``): a schema has no list of strings.

Under ``torch.compile`` a CUDA tensor goes to a second registration of the same launcher,
``dist_quant::<name>_triton``, made with ``torch.library.triton_op``: AOTAutograd traces into the
launcher, whose launches go through ``wrap_triton`` (``_launch.FastLaunch``), so the graph holds
the Triton kernel calls themselves and inductor launches them from its generated code, with no
Python of ours per call (an opaque custom op costs the eager launcher's host time in every
compiled step). The kernels and their arguments are the eager ones, so the compiled step computes
the same bits. CPU tensors, tensors of symbolic (dynamic) shape, and the ops whose launcher keeps
host-side state (the delayed update's cached plans) stay opaque custom ops under compile.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
from dist_quant.kernels import reference
from dist_quant.kernels._triton import HAVE_TRITON
from dist_quant.kernels.cast import cast_to_fp8_triton, cast_transpose_triton, delayed_cast_triton
from dist_quant.kernels.current import (
    amax_triton,
    current_scale_triton,
    current_scaling_cast_triton,
)
from dist_quant.kernels.delayed_update import delayed_scaling_update_groups_triton
from dist_quant.kernels.kinds_base import AmaxAlgo
from torch import Tensor
from torch.library import custom_op, triton_op


class Op:
    """A registered op and the two functions it runs: called eagerly it runs the function for the
    tensors' device directly (the same computation, without the dispatcher's Python overhead of
    ~30-60 us a call on the CPU); while torch.compile traces, it is the op itself, or for CUDA
    tensors its ``triton_op`` twin (``inlined``) when the launcher is traceable."""

    def __init__(
        self, op: Any, default: Callable | None, cuda: Callable | None, inlined: Any = None
    ) -> None:
        self.op, self.default, self.cuda, self.inlined = op, default, cuda, inlined

    def __call__(self, *args: Any) -> Any:
        first = args[0][0] if isinstance(args[0], (list, tuple)) else args[0]
        if torch.compiler.is_compiling():
            if first.is_cuda and self.inlined is not None and _static(first):
                return self.inlined(*args)
            return self.op(*args)
        fn = self.cuda if first.is_cuda and self.cuda is not None else self.default
        if fn is None:
            raise RuntimeError(f"{self.op}: no kernel for {first.device} tensors")
        return fn(*args)


def _static(t: Tensor) -> bool:
    """Whether a traced tensor has concrete sizes: the launchers size grids and pick constexprs
    from sizes in plain Python, so under dynamic shapes (symbolic sizes) the op stays opaque."""
    return not any(isinstance(size, torch.SymInt) for size in t.shape)


def register_op(
    name: str,
    mutates_args: tuple[str, ...],
    default: Callable | None,
    cuda: Callable | None,
    fake: Callable,
    *,
    traceable: bool = True,
) -> Op:
    """``dist_quant::<name>`` (``default`` on every device, ``cuda`` on CUDA, ``fake`` for tracing),
    plus ``dist_quant::<name>_triton`` from the CUDA launcher when it is ``traceable``: it runs
    only torch ops on the shapes it is given and launches through ``_launch``."""
    impl = default if default is not None else cuda
    op = custom_op(
        f"dist_quant::{name}",
        impl,
        mutates_args=mutates_args,
        device_types=None if default is not None else "cuda",
    )
    if default is not None and cuda is not None:
        op.register_kernel("cuda")(cuda)
    op.register_fake(fake)
    inlined = None
    if cuda is not None and traceable and HAVE_TRITON:  # without Triton no CUDA kernel runs
        inlined = triton_op(f"dist_quant::{name}_triton", cuda, mutates_args=mutates_args)
    return Op(op, default, cuda, inlined)


def rows_cols(x: Tensor) -> tuple[int, int]:
    return math.prod(x.shape[:-1]), x.shape[-1]


def _pair(q: Tensor, q_t: Tensor) -> tuple[Tensor, Tensor]:
    """Two distinct outputs: the reference's transpose of a (1, n) or (n, 1) ``q`` is ``q`` itself
    (the Triton launchers always write two buffers)."""
    if q_t.untyped_storage().data_ptr() == q.untyped_storage().data_ptr():
        q_t = q_t.clone()
    return q, q_t


def _accumulate_amax(amax_out: Tensor, x: Tensor) -> None:
    """``amax_out = max(amax_out, amax(x))`` in place, NaN propagating (reference of the fused ops)."""
    amax_out.copy_(torch.maximum(amax_out, reference.amax(x)))


# ---- amax / per-tensor casts -----------------------------------------------------------------
def _amax_ref(x: Tensor) -> Tensor:
    return reference.amax(x)


def _amax_cuda(x: Tensor) -> Tensor:
    return amax_triton(x)


def _amax_fake(x: Tensor) -> Tensor:
    return x.new_empty((), dtype=torch.float32)


def _cast_to_fp8_ref(x: Tensor, scale: Tensor, fp8_dtype: torch.dtype) -> Tensor:
    return reference.cast_to_fp8(x, scale, fp8_dtype)


def _cast_to_fp8_cuda(x: Tensor, scale: Tensor, fp8_dtype: torch.dtype) -> Tensor:
    return cast_to_fp8_triton(x, scale, fp8_dtype)


def _cast_to_fp8_fake(x: Tensor, scale: Tensor, fp8_dtype: torch.dtype) -> Tensor:
    return torch.empty_like(x, dtype=fp8_dtype)


def _cast_transpose_ref(x: Tensor, scale: Tensor, fp8_dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    q, q_t = reference.cast_transpose(x, scale, fp8_dtype)
    return _pair(q, q_t)


def _cast_transpose_cuda(x: Tensor, scale: Tensor, fp8_dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    return cast_transpose_triton(x, scale, fp8_dtype)


def _cast_transpose_fake(x: Tensor, scale: Tensor, fp8_dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    rows, cols = rows_cols(x)
    return torch.empty_like(x, dtype=fp8_dtype), x.new_empty((cols, rows), dtype=fp8_dtype)


# Delayed scaling: the cast also folds max(|x|) into the history slot ``amax_out`` (a view into
# row 0 of a recipe state's amax history), declared as a mutation.
def _cast_to_fp8_with_amax_ref(
    x: Tensor, scale: Tensor, fp8_dtype: torch.dtype, amax_out: Tensor
) -> Tensor:
    q = reference.cast_to_fp8(x, scale, fp8_dtype)
    _accumulate_amax(amax_out, x)
    return q


def _cast_to_fp8_with_amax_cuda(
    x: Tensor, scale: Tensor, fp8_dtype: torch.dtype, amax_out: Tensor
) -> Tensor:
    return cast_to_fp8_triton(x, scale, fp8_dtype, amax_out=amax_out)


def _cast_to_fp8_with_amax_fake(
    x: Tensor, scale: Tensor, fp8_dtype: torch.dtype, amax_out: Tensor
) -> Tensor:
    return torch.empty_like(x, dtype=fp8_dtype)


def _cast_transpose_with_amax_ref(
    x: Tensor, scale: Tensor, fp8_dtype: torch.dtype, amax_out: Tensor
) -> tuple[Tensor, Tensor]:
    q, q_t = reference.cast_transpose(x, scale, fp8_dtype)
    _accumulate_amax(amax_out, x)
    return _pair(q, q_t)


def _cast_transpose_with_amax_cuda(
    x: Tensor, scale: Tensor, fp8_dtype: torch.dtype, amax_out: Tensor
) -> tuple[Tensor, Tensor]:
    return cast_transpose_triton(x, scale, fp8_dtype, amax_out=amax_out)


def _cast_transpose_with_amax_fake(
    x: Tensor, scale: Tensor, fp8_dtype: torch.dtype, amax_out: Tensor
) -> tuple[Tensor, Tensor]:
    rows, cols = rows_cols(x)
    return torch.empty_like(x, dtype=fp8_dtype), x.new_empty((cols, rows), dtype=fp8_dtype)


# The whole delayed-scaling cast of a quantizer: the cast (and transpose), the amax folded into
# ``amax_out``, and ``scale_inv = 1 / scale`` as of this point of the stream, in one launch on CUDA.
def _delayed_scale_inv_ref(scale: Tensor) -> Tensor:
    return torch.reciprocal(scale.reshape(1))


def _delayed_cast_ref(
    x: Tensor, scale: Tensor, fp8_dtype: torch.dtype, amax_out: Tensor
) -> tuple[Tensor, Tensor]:
    q = _cast_to_fp8_with_amax_ref(x, scale, fp8_dtype, amax_out)
    return q, _delayed_scale_inv_ref(scale)


def _delayed_cast_cuda(
    x: Tensor, scale: Tensor, fp8_dtype: torch.dtype, amax_out: Tensor
) -> tuple[Tensor, Tensor]:
    q, _, scale_inv = delayed_cast_triton(x, scale, fp8_dtype, amax_out, transpose=False)
    return q, scale_inv


def _delayed_cast_fake(
    x: Tensor, scale: Tensor, fp8_dtype: torch.dtype, amax_out: Tensor
) -> tuple[Tensor, Tensor]:
    return torch.empty_like(x, dtype=fp8_dtype), x.new_empty((1,), dtype=torch.float32)


def _delayed_cast_transpose_ref(
    x: Tensor, scale: Tensor, fp8_dtype: torch.dtype, amax_out: Tensor
) -> tuple[Tensor, Tensor, Tensor]:
    q, q_t = _cast_transpose_with_amax_ref(x, scale, fp8_dtype, amax_out)
    return q, q_t, _delayed_scale_inv_ref(scale)


def _delayed_cast_transpose_cuda(
    x: Tensor, scale: Tensor, fp8_dtype: torch.dtype, amax_out: Tensor
) -> tuple[Tensor, Tensor, Tensor]:
    q, q_t, scale_inv = delayed_cast_triton(x, scale, fp8_dtype, amax_out, transpose=True)
    return q, q_t, scale_inv


def _delayed_cast_transpose_fake(
    x: Tensor, scale: Tensor, fp8_dtype: torch.dtype, amax_out: Tensor
) -> tuple[Tensor, Tensor, Tensor]:
    rows, cols = rows_cols(x)
    return (
        torch.empty_like(x, dtype=fp8_dtype),
        x.new_empty((cols, rows), dtype=fp8_dtype),
        x.new_empty((1,), dtype=torch.float32),
    )


# ---- current scaling ---------------------------------------------------------------------------
def _current_scale_ref(
    amax: Tensor, fp8_dtype: torch.dtype, amax_epsilon: float, use_power_2_scales: bool
) -> tuple[Tensor, Tensor]:
    s, s_inv = reference.current_scale(
        amax, fp8_dtype, amax_epsilon=amax_epsilon, use_power_2_scales=use_power_2_scales
    )
    return s.contiguous(), s_inv.contiguous()


def _current_scale_cuda(
    amax: Tensor, fp8_dtype: torch.dtype, amax_epsilon: float, use_power_2_scales: bool
) -> tuple[Tensor, Tensor]:
    s, s_inv = current_scale_triton(
        amax, fp8_dtype, amax_epsilon=amax_epsilon, use_power_2_scales=use_power_2_scales
    )
    return s.contiguous(), s_inv.contiguous()


def _current_scale_fake(
    amax: Tensor, fp8_dtype: torch.dtype, amax_epsilon: float, use_power_2_scales: bool
) -> tuple[Tensor, Tensor]:
    return amax.new_empty(amax.shape, dtype=torch.float32), amax.new_empty(
        amax.shape, dtype=torch.float32
    )


def _reference_current_cast(
    x: Tensor,
    fp8_dtype: torch.dtype,
    amax_epsilon: float,
    use_power_2_scales: bool,
    transpose: bool,
) -> tuple[Tensor, ...]:
    a = reference.amax(x)
    scale, scale_inv = reference.current_scale(
        a, fp8_dtype, amax_epsilon=amax_epsilon, use_power_2_scales=use_power_2_scales
    )
    if transpose:
        q, q_t = reference.cast_transpose(x, scale, fp8_dtype)
        return (*_pair(q, q_t), scale.reshape(1), scale_inv.reshape(1), a)
    q = reference.cast_to_fp8(x, scale, fp8_dtype)
    return q, scale.reshape(1), scale_inv.reshape(1), a


def _current_scaling_cast_ref(
    x: Tensor, fp8_dtype: torch.dtype, amax_epsilon: float, use_power_2_scales: bool
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """``(q, scale (1,), scale_inv (1,), amax ())`` of amax -> current scale -> cast."""
    return _reference_current_cast(x, fp8_dtype, amax_epsilon, use_power_2_scales, False)


def _current_scaling_cast_cuda(
    x: Tensor, fp8_dtype: torch.dtype, amax_epsilon: float, use_power_2_scales: bool
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    out = current_scaling_cast_triton(
        x, fp8_dtype, amax_epsilon=amax_epsilon, use_power_2_scales=use_power_2_scales
    )
    return out.data, out.scale, out.scale_inv, out.amax


def _current_scaling_cast_fake(
    x: Tensor, fp8_dtype: torch.dtype, amax_epsilon: float, use_power_2_scales: bool
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    one = (1,)
    return (
        torch.empty_like(x, dtype=fp8_dtype),
        x.new_empty(one, dtype=torch.float32),
        x.new_empty(one, dtype=torch.float32),
        x.new_empty((), dtype=torch.float32),
    )


def _current_scaling_cast_transpose_ref(
    x: Tensor, fp8_dtype: torch.dtype, amax_epsilon: float, use_power_2_scales: bool
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """``(q, q_t (cols, rows), scale (1,), scale_inv (1,), amax ())``."""
    return _reference_current_cast(x, fp8_dtype, amax_epsilon, use_power_2_scales, True)


def _current_scaling_cast_transpose_cuda(
    x: Tensor, fp8_dtype: torch.dtype, amax_epsilon: float, use_power_2_scales: bool
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    out = current_scaling_cast_triton(
        x, fp8_dtype, amax_epsilon=amax_epsilon, use_power_2_scales=use_power_2_scales,
        transpose=True,
    )  # fmt: skip
    return out.data, out.data_t, out.scale, out.scale_inv, out.amax


def _current_scaling_cast_transpose_fake(
    x: Tensor, fp8_dtype: torch.dtype, amax_epsilon: float, use_power_2_scales: bool
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    rows, cols = rows_cols(x)
    one = (1,)
    return (
        torch.empty_like(x, dtype=fp8_dtype),
        x.new_empty((cols, rows), dtype=fp8_dtype),
        x.new_empty(one, dtype=torch.float32),
        x.new_empty(one, dtype=torch.float32),
        x.new_empty((), dtype=torch.float32),
    )


# ---- delayed scaling update ----------------------------------------------------------------------
def _delayed_scaling_update_groups_ref(
    histories: list[Tensor],
    scales: list[Tensor],
    fp8_maxes: list[Tensor],
    margins: list[float],
    algos: list[int],
) -> None:
    """``reference.delayed_scaling_update`` of each group ``i``, in place; one launch on CUDA."""
    for history, scale, limit, margin, code in zip(histories, scales, fp8_maxes, margins, algos):
        reference.delayed_scaling_update(
            history, scale, limit, margin=margin, algo=AmaxAlgo.of_code(code)
        )


def _delayed_scaling_update_groups_cuda(
    histories: list[Tensor],
    scales: list[Tensor],
    fp8_maxes: list[Tensor],
    margins: list[float],
    algos: list[int],
) -> None:
    delayed_scaling_update_groups_triton(
        [
            (h, s, limit, margin, AmaxAlgo.of_code(code))
            for h, s, limit, margin, code in zip(histories, scales, fp8_maxes, margins, algos)
        ]
    )


def _delayed_scaling_update_groups_fake(
    histories: list[Tensor],
    scales: list[Tensor],
    fp8_maxes: list[Tensor],
    margins: list[float],
    algos: list[int],
) -> None:
    return None


# ---- registration ------------------------------------------------------------------------------
amax = register_op("amax", (), _amax_ref, _amax_cuda, _amax_fake)
cast_to_fp8 = register_op("cast_to_fp8", (), _cast_to_fp8_ref, _cast_to_fp8_cuda, _cast_to_fp8_fake)
cast_transpose = register_op(
    "cast_transpose", (), _cast_transpose_ref, _cast_transpose_cuda, _cast_transpose_fake
)
cast_to_fp8_with_amax = register_op(
    "cast_to_fp8_with_amax",
    ("amax_out",),
    _cast_to_fp8_with_amax_ref,
    _cast_to_fp8_with_amax_cuda,
    _cast_to_fp8_with_amax_fake,
)
cast_transpose_with_amax = register_op(
    "cast_transpose_with_amax",
    ("amax_out",),
    _cast_transpose_with_amax_ref,
    _cast_transpose_with_amax_cuda,
    _cast_transpose_with_amax_fake,
)
delayed_cast = register_op(
    "delayed_cast", ("amax_out",), _delayed_cast_ref, _delayed_cast_cuda, _delayed_cast_fake
)
delayed_cast_transpose = register_op(
    "delayed_cast_transpose",
    ("amax_out",),
    _delayed_cast_transpose_ref,
    _delayed_cast_transpose_cuda,
    _delayed_cast_transpose_fake,
)
current_scale = register_op(
    "current_scale", (), _current_scale_ref, _current_scale_cuda, _current_scale_fake
)
current_scaling_cast = register_op(
    "current_scaling_cast",
    (),
    _current_scaling_cast_ref,
    _current_scaling_cast_cuda,
    _current_scaling_cast_fake,
)
current_scaling_cast_transpose = register_op(
    "current_scaling_cast_transpose",
    (),
    _current_scaling_cast_transpose_ref,
    _current_scaling_cast_transpose_cuda,
    _current_scaling_cast_transpose_fake,
)
delayed_scaling_update_groups = register_op(
    "delayed_scaling_update_groups",
    ("histories", "scales"),
    _delayed_scaling_update_groups_ref,
    _delayed_scaling_update_groups_cuda,
    _delayed_scaling_update_groups_fake,
    traceable=False,  # its launcher caches plans keyed on buffer addresses
)
