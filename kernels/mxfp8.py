"""MXFP8 cast: 32-element blocks with a shared E8M0 (power-of-two) scale; the Triton kernels, their
launcher and the op ``mxfp8_cast`` (``_op.py``).

Matches ``reference.mxfp8_cast`` bit for bit. Rowwise: blocks along the last dim of the 2D view,
``q`` in ``x``'s shape (contiguous), E8M0 ``(rows, ceil(cols/32))``. Columnwise: blocks along the
first dim, written straight into the transposed ``(cols, rows)`` layout with E8M0
``(cols, ceil(rows/32))``, so no separate transpose pass exists. A ragged tail is a short block
(masked loads read 0, which never raises a block's amax).

Each program loads a 3D tile whose block axis is explicit (``[rows, blocks, 32]`` rowwise,
``[blocks, 32, cols]`` columnwise) and reduces along it, so no reshape is needed.
"""

from __future__ import annotations

import struct

import torch
from dist_quant.kernels import reference
from dist_quant.kernels._fp8_round import (
    abs_bits,
    amax_from_bits,
    fp8_encode,
    fp8_spec,
    hw_rounding,
    is_gpu,
    row_block_tile,
    rows_cols,
)
from dist_quant.kernels._launch import FastLaunch
from dist_quant.kernels._op import fake_rows_cols, register_op
from dist_quant.kernels._triton import tl, triton
from torch import Tensor

MXFP8_BLOCK = 32


def _fp32_bits(value: float) -> int:
    """The fp32 bit pattern of `value` (exact for the constants passed here)."""
    return struct.unpack("<i", struct.pack("<f", value))[0]


# GPU launch configurations (bench/bench_cast.py --sweep measures the alternatives).
GPU_ROWWISE = {"BM": 32, "NB": 4, "num_warps": 4}
GPU_COLUMNWISE = {"NB": 2, "BN": 64, "num_warps": 4}


@triton.jit
def _e8m0_and_multiplier(amax_bits, FP8_MAX: tl.constexpr, E0_MAX_BITS: tl.constexpr):
    """Exact RCEIL block exponent ``E`` (``reference.rceil_e8m0``) and the data multiplier
    ``2**(127 - E)``.

    ``E`` = biased exponent of ``v = amax / FP8_MAX`` plus 1 if ``v``'s mantissa is non-zero, and 0
    where ``amax <= 2**-127 * FP8_MAX`` (whose fp32 bits are ``E0_MAX_BITS``; amax bits are
    non-negative, so integer order is float order); a non-finite amax gives 255, whose multiplier
    is NaN. A finite ``v`` is below 2**120, so ``E`` stays <= 247 and ``254 - E`` is a valid
    (normal) exponent field.
    """
    a = amax_from_bits(amax_bits)
    v = tl.math.div_rn(a, tl.zeros_like(a) + FP8_MAX).to(tl.int32, bitcast=True)
    e = ((v >> 23) & 0xFF) + ((v & 0x7FFFFF) != 0).to(tl.int32)
    e = tl.where(amax_bits <= E0_MAX_BITS, 0, e)
    e = tl.where(amax_bits >= 0x7F800000, 255, e)
    mult_bits = tl.where(e == 255, 0x7FC00000, tl.maximum(254 - e, 0) << 23)
    return e, mult_bits.to(tl.float32, bitcast=True)


@triton.jit
def _mxfp8_rowwise_kernel(
    x_ptr,
    q_ptr,  # uint8 (rows, cols), contiguous
    e_ptr,  # uint8 (rows, n_blocks)
    rows,
    cols,
    n_blocks,
    stride_xr,
    stride_xc,
    BM: tl.constexpr,
    NB: tl.constexpr,
    MAX_BITS: tl.constexpr,
    MANT_BITS: tl.constexpr,
    MIN_EXP: tl.constexpr,
    FP8_MAX: tl.constexpr,
    E0_MAX_BITS: tl.constexpr,
    HW_ROUND: tl.constexpr,
):
    r, b, r3, c3, mask = row_block_tile(tl.program_id(0), rows, cols, n_blocks, BM, NB, 32)
    x = tl.load(x_ptr + r3 * stride_xr + c3 * stride_xc, mask=mask, other=0.0).to(tl.float32)
    e, mult = _e8m0_and_multiplier(tl.max(abs_bits(x), axis=2), FP8_MAX, E0_MAX_BITS)
    code = fp8_encode(x * mult[:, :, None], MAX_BITS, MANT_BITS, MIN_EXP, HW_ROUND)
    tl.store(q_ptr + r3 * cols + c3, code.to(tl.uint8), mask=mask)
    e_mask = (r < rows)[:, None] & (b < n_blocks)[None, :]
    tl.store(e_ptr + r[:, None] * n_blocks + b[None, :], e.to(tl.uint8), mask=e_mask)


@triton.jit
def _mxfp8_columnwise_kernel(
    x_ptr,
    qt_ptr,  # uint8 (cols, rows), contiguous
    et_ptr,  # uint8 (cols, n_blocks)
    rows,
    cols,
    n_blocks,
    stride_xr,
    stride_xc,
    NB: tl.constexpr,
    BN: tl.constexpr,
    MAX_BITS: tl.constexpr,
    MANT_BITS: tl.constexpr,
    MIN_EXP: tl.constexpr,
    FP8_MAX: tl.constexpr,
    E0_MAX_BITS: tl.constexpr,
    HW_ROUND: tl.constexpr,
):
    pid = tl.program_id(0)
    n_col_tiles = tl.cdiv(cols, BN)
    b = (pid // n_col_tiles) * NB + tl.arange(0, NB)
    r = (b[:, None] * 32 + tl.arange(0, 32)[None, :]).to(tl.int64)  # [NB, 32]
    c = ((pid % n_col_tiles) * BN + tl.arange(0, BN)).to(tl.int64)
    r3 = r[:, :, None]
    c3 = c[None, None, :]
    mask = (r3 < rows) & (c3 < cols)
    x = tl.load(x_ptr + r3 * stride_xr + c3 * stride_xc, mask=mask, other=0.0).to(tl.float32)
    e, mult = _e8m0_and_multiplier(tl.max(abs_bits(x), axis=1), FP8_MAX, E0_MAX_BITS)  # [NB, BN]
    code = fp8_encode(x * mult[:, None, :], MAX_BITS, MANT_BITS, MIN_EXP, HW_ROUND)
    tl.store(qt_ptr + c3 * rows + r3, code.to(tl.uint8), mask=mask)
    e_mask = (b < n_blocks)[:, None] & (c < cols)[None, :]
    tl.store(et_ptr + c[None, :] * n_blocks + b[:, None], e.to(tl.uint8), mask=e_mask)


_launch_rowwise = FastLaunch(_mxfp8_rowwise_kernel)
_launch_columnwise = FastLaunch(_mxfp8_columnwise_kernel)


def mxfp8_cast_triton(
    x: torch.Tensor, fp8_dtype: torch.dtype, *, columnwise: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """``reference.mxfp8_cast``: ``(q, e8m0)``; ``q`` is contiguous in either layout."""
    spec = fp8_spec(fp8_dtype, "kernels.mxfp8.mxfp8_cast")
    if x.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"kernels.mxfp8.mxfp8_cast: x must be fp32/bf16/fp16, got {x.dtype}")
    rows, cols = rows_cols(x, "kernels.mxfp8.mxfp8_cast")
    x2d = x.detach().reshape(rows, cols)
    dev = x.device
    consts = dict(
        MAX_BITS=spec.max_bits, MANT_BITS=spec.mant_bits, MIN_EXP=spec.min_exp, FP8_MAX=spec.max,
        E0_MAX_BITS=_fp32_bits(spec.max * 2.0**-127), HW_ROUND=hw_rounding(x),
    )  # fmt: skip
    # columnwise blocks run along the rows and land in the transposed (cols, rows) layout
    n_blocks = triton.cdiv(rows if columnwise else cols, MXFP8_BLOCK)
    q = torch.empty((cols, rows) if columnwise else x.shape, dtype=fp8_dtype, device=dev)
    e8m0 = torch.empty((cols if columnwise else rows, n_blocks), dtype=torch.uint8, device=dev)
    if q.numel() == 0:
        return q, e8m0
    gpu = is_gpu(x)
    if columnwise:
        if gpu:
            cfg = GPU_COLUMNWISE
        else:  # interpreter: ~16K-element tiles
            nb = min(triton.next_power_of_2(n_blocks), 4)
            bn = min(triton.next_power_of_2(cols), max(128, 512 // nb))
            cfg = {"NB": nb, "BN": bn, "num_warps": 1}
        launcher = _launch_columnwise
        n_programs = triton.cdiv(n_blocks, cfg["NB"]) * triton.cdiv(cols, cfg["BN"])
    else:
        if gpu:
            cfg = GPU_ROWWISE
        else:  # interpreter: ~16K-element tiles
            nb = min(triton.next_power_of_2(n_blocks), 16)
            bm = min(triton.next_power_of_2(rows), max(1, 512 // nb))
            cfg = {"BM": bm, "NB": nb, "num_warps": 1}
        launcher = _launch_rowwise
        n_programs = triton.cdiv(rows, cfg["BM"]) * triton.cdiv(n_blocks, cfg["NB"])
    launcher.launch(
        (n_programs,),
        (x2d, q.view(torch.uint8), e8m0, rows, cols, n_blocks, *x2d.stride()),
        {**cfg, **consts},
        interpreted=not gpu,
    )
    return q, e8m0


# ---- the op: reference call, fake, registration ------------------------------------------------
def _mxfp8_cast_ref(x: Tensor, fp8_dtype: torch.dtype, columnwise: bool) -> tuple[Tensor, Tensor]:
    q, e8m0 = reference.mxfp8_cast(x, fp8_dtype, columnwise=columnwise)
    return q.contiguous(), e8m0.contiguous()


def _mxfp8_cast_cuda(x: Tensor, fp8_dtype: torch.dtype, columnwise: bool) -> tuple[Tensor, Tensor]:
    return mxfp8_cast_triton(x, fp8_dtype, columnwise=columnwise)


def _mxfp8_cast_fake(x: Tensor, fp8_dtype: torch.dtype, columnwise: bool) -> tuple[Tensor, Tensor]:
    rows, cols = fake_rows_cols(x)
    if columnwise:
        q_shape, s_shape = (cols, rows), (cols, -(-rows // MXFP8_BLOCK))
    else:
        q_shape, s_shape = tuple(x.shape), (rows, -(-cols // MXFP8_BLOCK))
    return x.new_empty(q_shape, dtype=fp8_dtype), x.new_empty(s_shape, dtype=torch.uint8)


_mxfp8_cast = register_op("mxfp8_cast", (), _mxfp8_cast_ref, _mxfp8_cast_cuda, _mxfp8_cast_fake)


def mxfp8_cast(
    x: Tensor, fp8_dtype: torch.dtype, *, columnwise: bool = False
) -> tuple[Tensor, Tensor]:
    """``reference.mxfp8_cast``: ``(q, e8m0)``, both contiguous."""
    return _mxfp8_cast(x, fp8_dtype, bool(columnwise))
