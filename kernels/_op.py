"""How a kernel op is registered and dispatched: ``register_op`` and ``KernelOp``.

Every op file (``kernels/cast.py``, ``current.py``, ...) ends with the same two steps: it registers
its op with ``register_op`` (the reference as the default kernel, its launcher for CUDA, a fake
for tracing) and defines its public function, which normalises arguments and calls the
``KernelOp`` (a function) that ``register_op`` returned, the one dispatch path of the package:

- eagerly (outside torch.compile) it calls the function for the tensors' device itself, without
  the torch dispatcher (~30-60 us of host time a call): the op's launcher, or the file's eager
  entry when it keeps prepared launches (``eager_cuda``), for CUDA tensors; the reference, on a
  detached input, everywhere else;
- while dynamo traces it is the ``torch.library`` op, or, for a CUDA tensor of static shape, the
  op's ``triton_op`` twin ``dist_quant::<name>_triton``: AOTAutograd traces into the launcher,
  whose launches go through ``wrap_triton`` (``_launch.FastLaunch``), so inductor launches the
  Triton kernels from its own code with no Python of ours per call. The kernels and arguments are
  the eager ones, so the compiled step computes the same bits. Launchers that keep host-side state
  (the delayed update's plans) register ``traceable=False`` and stay opaque.

Conventions shared by every op, so the fake and the real outputs agree: outputs are new tensors,
never views of an input; per-tensor casts and dequantize keep the input's layout (``empty_like``),
a columnwise MXFP8 dequantize is the transpose of a contiguous buffer, everything else is
contiguous; per-tensor scales are 1-element fp32 tensors; in-place writes of scaling state are
declared (``mutates_args``). No op has a derivative: quantized data is not differentiable, and
autograd lives in the modules' Functions.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
from dist_quant.kernels._triton import HAVE_TRITON
from torch import Tensor
from torch.library import custom_op, triton_op

KernelOp = Callable[..., Any]
"""What ``register_op`` returns: the op's dispatch function, with the ``torch.library`` op as its
``op`` attribute (``torch.library.opcheck(f.op, ...)``) and the ``triton_op`` twin or None as
``inlined``."""


def _static(t: Tensor) -> bool:
    """Whether a traced tensor has concrete sizes: the launchers size grids and pick constexprs
    from sizes in plain Python, so under dynamic shapes (symbolic sizes) the op stays opaque."""
    return not any(isinstance(size, torch.SymInt) for size in t.shape)


def register_op(
    name: str,
    mutates_args: tuple[str, ...],
    reference: Callable | None,
    cuda: Callable,
    fake: Callable,
    *,
    traceable: bool = True,
    eager_cuda: Callable | None = None,
    pack: Callable | None = None,
    to_op: Callable | None = None,
) -> KernelOp:
    """``dist_quant::<name>`` (``reference`` on every device, ``cuda`` on CUDA, ``fake`` for
    tracing), plus ``dist_quant::<name>_triton`` from ``cuda`` when Triton is installed and the
    launcher is ``traceable`` (torch ops on shapes only, launches through ``_launch``, no
    ``data_ptr``); returns the op's ``KernelOp``.

    ``eager_cuda`` (default: ``cuda``) is what an eager call on CUDA runs: a launcher entry that
    keeps prepared launches. ``pack`` turns the op's tuple into the type ``eager_cuda`` returns,
    where they differ (a ``NamedTuple`` with an optional field). ``to_op`` is for an op called with
    a list of groups (the delayed update): the call's first argument is that list, whose first
    group's first tensor decides the device, and ``to_op`` turns the call's arguments into the
    op's, off the eager CUDA path."""
    if pack is not None and eager_cuda is None:
        raise ValueError(
            f"register_op({name!r}): pack needs an eager_cuda returning the packed type"
        )
    impl = reference if reference is not None else cuda
    op = custom_op(
        f"dist_quant::{name}",
        impl,
        mutates_args=mutates_args,
        device_types=None if reference is not None else "cuda",
    )
    if reference is not None:
        op.register_kernel("cuda")(cuda)
    op.register_fake(fake)
    inlined = None
    # the one "has Triton" guard: without it no CUDA kernel runs, and triton_op needs it
    if traceable and HAVE_TRITON:
        inlined = triton_op(f"dist_quant::{name}_triton", cuda, mutates_args=mutates_args)
    return _dispatch(op, inlined, reference, eager_cuda or cuda, pack, to_op)


def _dispatch(
    op: Any,
    inlined: Any,
    reference: Callable | None,
    eager_cuda: Callable,
    pack: Callable | None,
    to_op: Callable | None,
) -> KernelOp:
    """The package's one dispatch path (module docstring). A closure, not an object with
    ``__call__``: an eager training step calls it for every cast, and a plain function call with
    its settings in cells costs the least host time."""
    compiling = torch.compiler.is_compiling

    def traced_or_reference(first: Tensor) -> Callable:
        if not compiling():
            if reference is None:
                raise RuntimeError(f"{op}: no kernel for {first.device} tensors")
            return reference
        if first.is_cuda and inlined is not None and _static(first):
            return inlined
        return op

    if to_op is None:

        def kernel_op(x: Tensor, *args: Any) -> Any:
            if x.is_cuda and not compiling():
                return eager_cuda(x, *args)
            out = traced_or_reference(x)(x.detach(), *args)
            return out if pack is None else pack(out)

    else:

        def kernel_op(groups: Any, *args: Any) -> Any:
            if groups[0][0].is_cuda and not compiling():
                return eager_cuda(groups, *args)
            out = traced_or_reference(groups[0][0])(*to_op(groups, *args))
            return out if pack is None else pack(out)

    kernel_op.op, kernel_op.inlined = op, inlined  # type: ignore[attr-defined]
    return kernel_op


def fake_rows_cols(x: Tensor) -> tuple[int, int]:
    """The 2D view ``(prod(shape[:-1]), shape[-1])`` of a fake input (no validation: the real
    kernels validate)."""
    return math.prod(x.shape[:-1]), x.shape[-1]


def distinct(q: Tensor, q_t: Tensor) -> tuple[Tensor, Tensor]:
    """Two distinct outputs: the reference's transpose of a (1, n) or (n, 1) ``q`` is ``q`` itself
    (the Triton launchers always write two buffers)."""
    if q_t.untyped_storage().data_ptr() == q.untyped_storage().data_ptr():
        q_t = q_t.clone()
    return q, q_t


def as_scale(value: Tensor | float, like: Tensor) -> Tensor:
    """A Python-number scale (tests, interactive use) as the fp32 tensor an op takes, on ``like``'s
    device; a tensor as it is (the kernels validate it)."""
    if isinstance(value, Tensor):
        return value
    return torch.as_tensor(value, dtype=torch.float32, device=like.device).reshape(-1)
