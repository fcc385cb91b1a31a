"""Delayed scaling's per-tensor cast: the op ``delayed_cast`` (``_op.py``) on ``cast.py``'s kernels.

A delayed-scaling quantizer's whole cast in one launch: the bytes (and the transpose), the amax
folded into the history slot ``amax_out`` (declared as written) and ``scale_inv = 1 / scale`` as of
this point of the stream (the update changes ``scale`` later). Its eager fast path is
``delayed_cast_triton``'s prepared launches: a training step casts the same layouts into the same
buffers every time, so after the first cast of a layout a cast only allocates and relaunches.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from dist_quant.kernels import reference
from dist_quant.kernels._launch import EAGER_TENSOR_TYPES, PreparedLaunch, remember
from dist_quant.kernels._op import as_scale, distinct, fake_rows_cols, register_op
from dist_quant.kernels.cast import cast_args, launch_cast
from torch import Tensor


class DelayedCast(NamedTuple):
    """What a delayed-scaling quantizer gets from one cast."""

    data: torch.Tensor  # FP8, x's shape
    data_t: torch.Tensor | None  # FP8 (cols, rows) when transposed
    scale_inv: torch.Tensor  # (1,) fp32: 1 / scale at the time of the cast


def delayed_cast_triton(
    x: torch.Tensor,
    scale: torch.Tensor,
    fp8_dtype: torch.dtype,
    amax_out: torch.Tensor,
    transpose: bool = False,
) -> DelayedCast:
    """Delayed scaling's whole cast in one launch: ``(q, q_t or None, 1 / scale)``, folding
    ``amax(x)`` into ``amax_out``; the reciprocal is the scale's value at this point of the
    stream (the update changes ``scale`` later).

    A training step casts the same activation, weight and gradient layouts into the same scaling
    buffers every time: the first cast of a layout is validated and launched in full and leaves
    a prepared launch behind, keyed on everything the validation and Triton's specialisation
    read; the next casts of that key allocate the outputs and relaunch it (``_delayed_plans``)."""
    key = None
    if type(x) in EAGER_TENSOR_TYPES and x.is_cuda:  # eager (under tracing: a fake tensor)
        key = (
            x.shape, x.stride(), x.dtype, fp8_dtype, transpose, torch._C._cuda_getDevice(),
            x.get_device(), scale.get_device(), amax_out.get_device(),
            scale.dtype, scale.shape, amax_out.dtype, amax_out.shape,
            x.data_ptr() & 15, scale.data_ptr() & 15, amax_out.data_ptr() & 15,
        )  # fmt: skip
        prepared = _delayed_plans.get(key)
        if prepared is not None:
            scale_inv = torch.empty(1, dtype=torch.float32, device=x.device)
            q = torch.empty_like(x, dtype=fp8_dtype)
            stream = torch._C._cuda_getCurrentRawStream(key[5])
            q_t = None if prepared[1] is None else torch.empty(prepared[1], dtype=fp8_dtype,
                                                                device=x.device)  # fmt: skip
            outs = (scale, scale, scale_inv)
            prepared[0].launch(stream, *cast_args(x, q, q_t, scale, amax_out, scale, 0, 0.0, outs))
            return DelayedCast(q, q_t, scale_inv)
    scale_inv = torch.empty(1, dtype=torch.float32, device=x.device)

    def store(prepared: PreparedLaunch, q_t_shape: tuple[int, int] | None) -> None:
        remember(_delayed_plans, key, (prepared, q_t_shape))

    q, q_t = launch_cast(
        x, fp8_dtype, transpose=transpose, scale=scale, amax_out=amax_out,
        scale_inv_out=scale_inv, prepare=None if key is None else store,
    )  # fmt: skip
    if x.numel() == 0:  # no program ran to write it
        scale_inv.copy_(torch.reciprocal(scale.reshape(1)))
    return DelayedCast(q, q_t, scale_inv)


# key (see delayed_cast_triton) -> (the prepared launch, the shape of q_t or None)
_delayed_plans: dict[tuple, tuple[PreparedLaunch, tuple[int, int] | None]] = {}


# ---- the op: reference calls, fakes, registration ---------------------------------------------
def _fold_amax(amax_out: Tensor, x: Tensor) -> None:
    """``amax_out = max(amax_out, amax(x))`` in place, NaN propagating (the kernels' atomic max)."""
    amax_out.copy_(torch.maximum(amax_out, reference.amax(x)))


def _delayed_cast_ref(
    x: Tensor, scale: Tensor, fp8_dtype: torch.dtype, amax_out: Tensor
) -> tuple[Tensor, Tensor]:
    q = reference.cast_to_fp8(x, scale, fp8_dtype)
    _fold_amax(amax_out, x)
    return q, torch.reciprocal(scale.reshape(1))


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
    q, q_t = distinct(*reference.cast_transpose(x, scale, fp8_dtype))
    _fold_amax(amax_out, x)
    return q, q_t, torch.reciprocal(scale.reshape(1))


def _delayed_cast_transpose_cuda(
    x: Tensor, scale: Tensor, fp8_dtype: torch.dtype, amax_out: Tensor
) -> tuple[Tensor, Tensor, Tensor]:
    return tuple(delayed_cast_triton(x, scale, fp8_dtype, amax_out, transpose=True))


def _delayed_cast_transpose_fake(
    x: Tensor, scale: Tensor, fp8_dtype: torch.dtype, amax_out: Tensor
) -> tuple[Tensor, Tensor, Tensor]:
    rows, cols = fake_rows_cols(x)
    return (
        torch.empty_like(x, dtype=fp8_dtype),
        x.new_empty((cols, rows), dtype=fp8_dtype),
        x.new_empty((1,), dtype=torch.float32),
    )


def _delayed_cast_transpose_eager(
    x: Tensor, scale: Tensor, fp8_dtype: torch.dtype, amax_out: Tensor
) -> DelayedCast:
    return delayed_cast_triton(x, scale, fp8_dtype, amax_out, True)


# Eager CUDA calls go to delayed_cast_triton itself: its prepared launches make a step's casts
# cheap, and it returns the DelayedCast (a positional call: keywords would cost host time).
_delayed_cast = register_op(
    "delayed_cast", ("amax_out",), _delayed_cast_ref, _delayed_cast_cuda, _delayed_cast_fake,
    eager_cuda=delayed_cast_triton, pack=lambda out: DelayedCast(out[0], None, out[1]),
)  # fmt: skip
_delayed_cast_transpose = register_op(
    "delayed_cast_transpose", ("amax_out",), _delayed_cast_transpose_ref,
    _delayed_cast_transpose_cuda, _delayed_cast_transpose_fake,
    eager_cuda=_delayed_cast_transpose_eager, pack=lambda out: DelayedCast(*out),
)  # fmt: skip


# ---- public functions ----------------------------------------------------------------------------
def delayed_cast(
    x: Tensor, scale: Tensor, fp8_dtype: torch.dtype, amax_out: Tensor, *, transpose: bool
) -> DelayedCast:
    """A delayed-scaling quantizer's cast: ``cast_to_fp8`` (``cast_transpose`` when
    ``transpose``), ``amax_out = max(amax_out, amax(x))`` in place (``amax_out`` a 1-element fp32
    view holding a value >= 0, such as ``amax_history[0]``'s slot), and ``scale_inv = 1 / scale``
    taken at this point of the stream (the update changes ``scale`` later); one launch on CUDA."""
    return (_delayed_cast_transpose if transpose else _delayed_cast)(x, scale, fp8_dtype, amax_out)


def cast_to_fp8_with_amax(
    x: Tensor, scale: Tensor | float, fp8_dtype: torch.dtype, amax_out: Tensor
) -> Tensor:
    """``delayed_cast``'s bytes: the cast and the amax folded into ``amax_out``."""
    return delayed_cast(x, as_scale(scale, x), fp8_dtype, amax_out, transpose=False).data


def cast_transpose_with_amax(
    x: Tensor, scale: Tensor | float, fp8_dtype: torch.dtype, amax_out: Tensor
) -> tuple[Tensor, Tensor]:
    """``delayed_cast``'s bytes and transpose, the amax folded into ``amax_out``."""
    out = delayed_cast(x, as_scale(scale, x), fp8_dtype, amax_out, transpose=True)
    return out.data, out.data_t
