"""How a kernel op is registered and dispatched: ``register_op`` and ``KernelOp``.

Every op file (``kernels/cast.py``, ``current.py``, ...) ends with the same two steps: it registers
its op with ``register_op`` (the reference as the default kernel, its launcher for CUDA, a fake
for tracing) and defines its public function, which normalises arguments and calls the
``KernelOp`` that ``register_op`` returned. ``KernelOp.__call__`` is the one dispatch path of the
package:

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


class KernelOp:
    """A registered op and what it runs (see the module docstring).

    ``x`` is the op's first argument: the tensor whose device decides, or, for an op called with
    a list of groups (the delayed update), that list, whose first group's first tensor decides;
    such an op has ``to_op``, which turns the list into the op's arguments off the eager CUDA path.
    ``pack`` turns the op's tuple into the result type of ``eager_cuda`` where the two differ (a
    ``NamedTuple`` with an optional field)."""

    __slots__ = ("op", "inlined", "reference", "eager_cuda", "pack", "to_op")

    def __init__(
        self,
        op: Any,
        inlined: Any,
        reference: Callable | None,
        eager_cuda: Callable,
        pack: Callable | None,
        to_op: Callable | None,
    ) -> None:
        self.op, self.inlined, self.reference, self.eager_cuda = op, inlined, reference, eager_cuda
        self.pack, self.to_op = pack, to_op

    def __call__(self, x: Any, *args: Any) -> Any:
        first = x if self.to_op is None else x[0][0]
        if not torch.compiler.is_compiling():
            if first.is_cuda:
                return self.eager_cuda(x, *args)
            if self.reference is None:
                raise RuntimeError(f"{self.op}: no kernel for {first.device} tensors")
            fn = self.reference
        elif first.is_cuda and self.inlined is not None and _static(first):
            fn = self.inlined
        else:
            fn = self.op
        out = fn(x.detach(), *args) if self.to_op is None else fn(*self.to_op(x, *args))
        return out if self.pack is None else self.pack(out)


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
    ``data_ptr``). ``eager_cuda`` (default: ``cuda``) is what an eager call on CUDA runs."""
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
    return KernelOp(op, inlined, reference, eager_cuda or cuda, pack, to_op)


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
