"""Float8 block cast: one fp32 scale per 1x128 tile (``block_dim=1``) or 128x128 tile
(``block_dim=2``); the Triton kernel, its launcher and the op ``block_cast`` (``_op.py``).

Matches ``reference.block_cast`` bit for bit: tile scale ``s = fp8_max / amax_tile`` (IEEE
division; amax 0 or non-finite -> 1, inf -> FLT_MAX, optional power of two by zeroing the mantissa),
``q = saturate(rne(x * s))``, ``scale_inv = 1 / s``. ``q`` is contiguous in ``x``'s shape.

Each program loads a ``[BM, NB, 128]`` tile with the 128-element axis explicit; for 128x128 tiles
``BM`` is 128, so one program owns whole tiles and reduces over both axes.
"""

from __future__ import annotations

import torch
from dist_quant.kernels import reference
from dist_quant.kernels._fp8_round import (
    abs_bits,
    amax_from_bits,
    cdiv,
    fp8_encode,
    fp8_spec,
    hw_rounding,
    is_gpu,
    next_pow2,
    reciprocal,
    row_block_tile,
    rows_cols,
    scale_from_amax,
)
from dist_quant.kernels._launch import FastLaunch
from dist_quant.kernels._op import fake_rows_cols, register_op
from dist_quant.kernels._triton import tl, triton
from torch import Tensor

FLOAT8_BLOCK = 128

# GPU launch configurations (bench/bench_cast.py --sweep measures the alternatives); 128x128
# tiles always use BM = 128.
GPU_1X128 = {"BM": 16, "NB": 2, "num_warps": 4}
GPU_128X128 = {"NB": 1, "num_warps": 8}


@triton.jit
def _block_cast_kernel(
    x_ptr,
    q_ptr,  # uint8 (rows, cols), contiguous
    s_ptr,  # fp32 scale_inv: (rows, n_tiles) or (ceil(rows/128), n_tiles)
    rows,
    cols,
    n_tiles,
    stride_xr,
    stride_xc,
    BM: tl.constexpr,
    NB: tl.constexpr,
    SQUARE: tl.constexpr,  # 128x128 tiles (then BM == 128)
    MAX_BITS: tl.constexpr,
    MANT_BITS: tl.constexpr,
    MIN_EXP: tl.constexpr,
    FP8_MAX: tl.constexpr,
    POW2: tl.constexpr,
    HW_ROUND: tl.constexpr,
):
    pid = tl.program_id(0)
    r, b, r3, c3, mask = row_block_tile(pid, rows, cols, n_tiles, BM, NB, 128)
    x = tl.load(x_ptr + r3 * stride_xr + c3 * stride_xc, mask=mask, other=0.0).to(tl.float32)
    m = tl.max(abs_bits(x), axis=2)  # [BM, NB]
    if SQUARE:
        m = tl.max(m, axis=0)[None, :]  # [1, NB]: one amax per 128x128 tile
    s = scale_from_amax(amax_from_bits(m), FP8_MAX, POW2)
    code = fp8_encode(x * s[:, :, None], MAX_BITS, MANT_BITS, MIN_EXP, HW_ROUND)
    tl.store(q_ptr + r3 * cols + c3, code.to(tl.uint8), mask=mask)
    if SQUARE:
        s_offs = (pid // tl.cdiv(n_tiles, NB)) * n_tiles + b[None, :]  # the tile row's scales
        s_mask = (b < n_tiles)[None, :]
    else:
        s_offs = r[:, None] * n_tiles + b[None, :]
        s_mask = (r < rows)[:, None] & (b < n_tiles)[None, :]
    tl.store(s_ptr + s_offs, reciprocal(s), mask=s_mask)


_launch_block = FastLaunch(_block_cast_kernel)


def block_cast_triton(
    x: torch.Tensor, fp8_dtype: torch.dtype, *, block_dim: int, use_power_2_scales: bool = True
) -> tuple[torch.Tensor, torch.Tensor]:
    """``reference.block_cast``: ``(q, scale_inv)``."""
    what = "kernels.block.block_cast"
    spec = fp8_spec(fp8_dtype, what)
    if block_dim not in (1, 2):
        raise ValueError(f"{what}: block_dim must be 1 (1x128) or 2 (128x128), got {block_dim!r}")
    if x.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"{what}: x must be fp32/bf16/fp16, got {x.dtype}")
    rows, cols = rows_cols(x, what)
    n_tiles = cdiv(cols, FLOAT8_BLOCK)
    scale_rows = rows if block_dim == 1 else cdiv(rows, FLOAT8_BLOCK)
    dev = x.device
    q = torch.empty(x.shape, dtype=fp8_dtype, device=dev)
    scale_inv = torch.empty((scale_rows, n_tiles), dtype=torch.float32, device=dev)
    if q.numel() == 0:
        return q, scale_inv
    x2d = x.detach().reshape(rows, cols)
    gpu = is_gpu(x)
    if block_dim == 2:
        nb = min(next_pow2(n_tiles), 2)
        cfg = {"BM": 128, **GPU_128X128} if gpu else {"BM": 128, "NB": nb, "num_warps": 1}
    elif gpu:
        cfg = GPU_1X128
    else:  # interpreter: ~16K-element tiles
        nb = min(next_pow2(n_tiles), 8)
        bm = min(next_pow2(rows), max(1, 128 // nb))
        cfg = {"BM": bm, "NB": nb, "num_warps": 1}
    grid = (cdiv(rows, cfg["BM"]) * cdiv(n_tiles, cfg["NB"]),)
    consts = {
        "SQUARE": block_dim == 2, "MAX_BITS": spec.max_bits, "MANT_BITS": spec.mant_bits,
        "MIN_EXP": spec.min_exp, "FP8_MAX": spec.max, "POW2": bool(use_power_2_scales),
        "HW_ROUND": hw_rounding(x),
    }  # fmt: skip
    _launch_block.launch(
        grid,
        (x2d, q.view(torch.uint8), scale_inv, rows, cols, n_tiles, *x2d.stride()),
        {**consts, **cfg},
        interpreted=not gpu,
    )
    return q, scale_inv


# ---- the op: reference call, fake, registration ------------------------------------------------
def _block_cast_ref(
    x: Tensor, fp8_dtype: torch.dtype, block_dim: int, use_power_2_scales: bool
) -> tuple[Tensor, Tensor]:
    q, s_inv = reference.block_cast(
        x, fp8_dtype, block_dim=block_dim, use_power_2_scales=use_power_2_scales
    )
    return q.contiguous(), s_inv.contiguous()


def _block_cast_cuda(
    x: Tensor, fp8_dtype: torch.dtype, block_dim: int, use_power_2_scales: bool
) -> tuple[Tensor, Tensor]:
    return block_cast_triton(
        x, fp8_dtype, block_dim=block_dim, use_power_2_scales=use_power_2_scales
    )


def _block_cast_fake(
    x: Tensor, fp8_dtype: torch.dtype, block_dim: int, use_power_2_scales: bool
) -> tuple[Tensor, Tensor]:
    rows, cols = fake_rows_cols(x)
    s_shape = reference._block_scale_shape(rows, cols, block_dim)
    return x.new_empty(x.shape, dtype=fp8_dtype), x.new_empty(s_shape, dtype=torch.float32)


_block_cast = register_op("block_cast", (), _block_cast_ref, _block_cast_cuda, _block_cast_fake)


def block_cast(
    x: Tensor, fp8_dtype: torch.dtype, *, block_dim: int, use_power_2_scales: bool = True
) -> tuple[Tensor, Tensor]:
    """``reference.block_cast``: ``(q, scale_inv)``, both contiguous."""
    return _block_cast(x, fp8_dtype, block_dim, bool(use_power_2_scales))
