"""SwiGLU in Triton: ``silu(gate) * up`` from fc1's stacked output, and its backward, one launch
each, equal bit for bit to what eager torch computes on CUDA.

``h`` is fc1's output ``(..., 2 * ffn)``, gate the first half of the last dim, up the second. Eager
torch runs SwiGLU as ``F.silu(gate) * up`` on the two halves, which are strided views: each of
its three elementwise kernels (silu, mul, and in the backward silu's and mul's derivatives) takes
the strided, unvectorised path, and the backward concatenates the halves' gradients in a fourth
pass. Here a program reads a row's gate and up blocks contiguously and writes ``out`` (forward)
or both halves of ``dh`` in place (backward).

The arithmetic is torch's CUDA kernels', in their order and rounding, so the bits are the same:

    silu(g)       = g / (1 + exp(-g))                        fp32, rounded to h's dtype
    out           = silu(g) * u                              fp32 product of the rounded values
    d_up          = dy * silu(g)                             each rounded to h's dtype
    d_silu        = dy * u
    d_gate        = d_silu * sig * (1 + g * (1 - sig)),  sig = 1 / (1 + exp(-g))

``exp`` is CUDA's ``expf`` (``libdevice.exp``, not Triton's approximate ``tl.exp``), divisions
are IEEE-rounded (``div_rn``: Triton's ``/`` is not), as in torch's kernels. The reference (the
CPU's path, and the definition) is torch's own ops on the halves.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from dist_quant.kernels._fp8_round import _INTERPRETED, is_gpu, to_bf16_bits
from dist_quant.kernels._op import register_op
from dist_quant.kernels._triton import libdevice, tl, triton
from torch import Tensor

_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
GPU_BLOCK = {"BLOCK": 1024, "num_warps": 4}  # columns per program: one row's stretch of ffn


@triton.jit
def silu_parts(g):
    """(silu(g), sigmoid(g)) in fp32, as torch's CUDA silu and silu_backward compute them."""
    if _INTERPRETED:  # the interpreter has no libdevice; its tl.exp is numpy's, not approximate
        e = tl.exp(-g)
    else:
        e = libdevice.exp(-g)
    denom = 1.0 + e
    return tl.math.div_rn(g, denom), tl.math.div_rn(tl.zeros_like(g) + 1.0, denom)


@triton.jit
def round_to(x, out_ty, BITS: tl.constexpr):
    """`x` rounded to the output dtype, as fp32. BITS (bf16 in the interpreter, whose conversion
    truncates and flushes subnormals): round to nearest even on the bits instead."""
    if BITS:
        return (to_bf16_bits(x).to(tl.int32) << 16).to(tl.float32, bitcast=True)
    return x.to(out_ty).to(tl.float32)


@triton.jit
def store_rounded(ptr, x, mask, BITS: tl.constexpr):
    """Store `x`, already rounded; under BITS `ptr` is the bf16 output's int16 view."""
    if BITS:
        tl.store(ptr, to_bf16_bits(x), mask=mask)
    else:
        tl.store(ptr, x.to(ptr.dtype.element_ty), mask=mask)


@triton.jit
def swiglu_value(g, u, out_ty, BITS: tl.constexpr):
    """``silu(g) * u`` in fp32 holding a value of ``out_ty``, rounded where torch's ops round
    (``swiglu_cast.py`` casts this value without writing it)."""
    silu, _ = silu_parts(g)
    return round_to(round_to(silu, out_ty, BITS) * u, out_ty, BITS)


@triton.jit
def swiglu_grads(dy, g, u, out_ty, BITS: tl.constexpr):
    """``(d_gate, d_up)`` in fp32 holding values of ``out_ty``, rounded where torch's ops round
    (``swiglu_cast.py`` casts them without writing them)."""
    silu, sig = silu_parts(g)
    silu = round_to(silu, out_ty, BITS)
    d_silu = round_to(dy * u, out_ty, BITS)
    d_gate = round_to(d_silu * sig * (1.0 + g * (1.0 - sig)), out_ty, BITS)
    return d_gate, round_to(dy * silu, out_ty, BITS)


@triton.jit
def _swiglu_fwd_kernel(h_ptr, out_ptr, FFN, BLOCK: tl.constexpr, BITS: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < FFN
    out_ty = out_ptr.dtype.element_ty
    gate_ptr = h_ptr + row * 2 * FFN + cols
    g = tl.load(gate_ptr, mask=ok, other=0.0).to(tl.float32)
    u = tl.load(gate_ptr + FFN, mask=ok, other=0.0).to(tl.float32)
    store_rounded(out_ptr + row * FFN + cols, swiglu_value(g, u, out_ty, BITS), ok, BITS)


@triton.jit
def _swiglu_bwd_kernel(dy_ptr, h_ptr, dh_ptr, FFN, BLOCK: tl.constexpr, BITS: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < FFN
    out_ty = dh_ptr.dtype.element_ty
    dy = tl.load(dy_ptr + row * FFN + cols, mask=ok, other=0.0).to(tl.float32)
    gate_off = row * 2 * FFN + cols
    g = tl.load(h_ptr + gate_off, mask=ok, other=0.0).to(tl.float32)
    u = tl.load(h_ptr + gate_off + FFN, mask=ok, other=0.0).to(tl.float32)
    d_gate, d_up = swiglu_grads(dy, g, u, out_ty, BITS)
    store_rounded(dh_ptr + gate_off, d_gate, ok, BITS)
    store_rounded(dh_ptr + gate_off + FFN, d_up, ok, BITS)


def stacked_rows(h: Tensor, what: str) -> tuple[Tensor, int]:
    """`h` as contiguous (rows, 2 * ffn), and ffn; refuses what the kernels cannot take."""
    if h.dtype not in _DTYPES:
        raise ValueError(f"kernels.swiglu.{what}: h must be fp32/bf16/fp16, got {h.dtype}")
    if h.dim() == 0 or h.shape[-1] % 2:
        raise ValueError(
            f"kernels.swiglu.{what}: h's last dim stacks gate and up, so it must be even; got "
            f"shape {tuple(h.shape)}"
        )
    return h.contiguous().view(-1, h.shape[-1]), h.shape[-1] // 2


def bits_mode(h: Tensor) -> bool:
    """Round bf16 on the bits: only the interpreter needs it (its conversion truncates)."""
    return h.dtype == torch.bfloat16 and bool(_INTERPRETED.value)


def _grid(rows: int, ffn: int, block: int) -> tuple[int, int]:
    return (rows, triton.cdiv(ffn, block))


def _block(h: Tensor) -> tuple[int, int]:
    if is_gpu(h):
        return GPU_BLOCK["BLOCK"], GPU_BLOCK["num_warps"]
    return 64, 1  # the interpreter: small blocks keep masked tails in every test


def swiglu_triton(h: Tensor) -> Tensor:
    h2, ffn = stacked_rows(h, "swiglu")
    out = torch.empty(*h.shape[:-1], ffn, dtype=h.dtype, device=h.device)
    if out.numel():
        block, warps = _block(h)
        bits = bits_mode(h)
        _swiglu_fwd_kernel[_grid(h2.shape[0], ffn, block)](
            h2, out.view(torch.int16) if bits else out, ffn, BLOCK=block, BITS=bits,
            num_warps=warps,
        )  # fmt: skip
    return out


def swiglu_backward_triton(dy: Tensor, h: Tensor) -> Tensor:
    h2, ffn = stacked_rows(h, "swiglu_backward")
    if dy.shape != (*h.shape[:-1], ffn) or dy.dtype != h.dtype:
        raise ValueError(
            f"kernels.swiglu.swiglu_backward: dy must be {h.dtype} of shape "
            f"{(*h.shape[:-1], ffn)}, got {dy.dtype} {tuple(dy.shape)}"
        )
    dh = torch.empty(h.shape, dtype=h.dtype, device=h.device)
    if dh.numel():
        block, warps = _block(h)
        bits = bits_mode(h)
        _swiglu_bwd_kernel[_grid(h2.shape[0], ffn, block)](
            dy.contiguous(), h2, dh.view(torch.int16) if bits else dh, ffn, BLOCK=block,
            BITS=bits, num_warps=warps,
        )  # fmt: skip
    return dh


# ---- the ops: reference calls, fakes, registration -----------------------------------------------
def swiglu_reference(h: Tensor) -> Tensor:
    """The definition: torch's ops on the two halves, as an eager ``F.silu(gate) * up`` runs."""
    gate, up = h.chunk(2, dim=-1)
    return F.silu(gate) * up


def swiglu_backward_reference(dy: Tensor, h: Tensor) -> Tensor:
    """What autograd computes for ``F.silu(gate) * up``: the product's two derivatives, silu's
    derivative of the first, the halves' gradients side by side."""
    gate, up = h.chunk(2, dim=-1)
    d_up = dy * F.silu(gate)
    d_gate = torch.ops.aten.silu_backward(dy * up, gate)
    return torch.cat([d_gate, d_up], dim=-1)


def _swiglu_fake(h: Tensor) -> Tensor:
    return h.new_empty(*h.shape[:-1], h.shape[-1] // 2)


def _swiglu_backward_fake(dy: Tensor, h: Tensor) -> Tensor:
    return torch.empty_like(h, memory_format=torch.contiguous_format)


# opaque under compile: the launchers launch through Triton's JIT, not `_launch`
_swiglu = register_op("swiglu", (), swiglu_reference, swiglu_triton, _swiglu_fake, traceable=False)
_swiglu_backward = register_op(
    "swiglu_backward", (), swiglu_backward_reference, swiglu_backward_triton,
    _swiglu_backward_fake, traceable=False,
)  # fmt: skip


def swiglu(h: Tensor) -> Tensor:
    """``silu(gate) * up`` of ``h = [gate, up]`` (last dim): Triton on CUDA, torch elsewhere; the
    same bits either way on CUDA. No autograd: ``swiglu_backward`` is its derivative."""
    return _swiglu(h)


def swiglu_backward(dy: Tensor, h: Tensor) -> Tensor:
    """The gradient of ``swiglu`` at ``h`` for the output gradient ``dy``: ``(..., 2 * ffn)``."""
    return _swiglu_backward(dy, h)
