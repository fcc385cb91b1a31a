"""FP8 dequantize for every layout: per-tensor, MXFP8 (E8M0) and Float8 blocks; the Triton kernels,
their launchers and the ops ``dequantize``, ``mxfp8_dequantize``, ``block_dequantize`` (``_op.py``).

Matches ``reference.dequantize``, ``reference.mxfp8_dequantize`` and ``reference.block_dequantize``
bit for bit: the FP8 byte is decoded exactly on its bits, multiplied by its scale in fp32, then
converted to the output dtype (bf16 by explicit round-to-nearest-even on the bits, since the
interpreter truncates; fp16 through ``.to``, which rounds to nearest even on both backends).

Two kernels: a flat one for the per-tensor scale (any layout, read as its dense storage), and a
grouped one for per-block scales: a ``[BM, NB, G]`` tile where each ``[BM, NB]`` entry has one scale,
row ``r`` using scale row ``r // ROW_GROUP`` (1 for rowwise blocks, 128 for 128x128 tiles).
"""

from __future__ import annotations

import torch
from dist_quant.kernels import reference
from dist_quant.kernels._fp8_round import (
    flat_pair,
    fp8_decode,
    fp8_spec,
    is_gpu,
    out_kind,
    row_block_tile,
    rows_cols,
    scalar_fp32,
    store_out,
    store_view,
)
from dist_quant.kernels._launch import FastLaunch
from dist_quant.kernels._op import as_scale, register_op
from dist_quant.kernels._triton import tl, triton
from torch import Tensor

# GPU launch configurations (bench/bench_cast.py --sweep measures the alternatives). Grouped:
# BM rows x (128 // G) groups of G per program.
GPU_FLAT = {"BLOCK": 8192, "num_warps": 8}
GPU_GROUPED = {"BM": 32, "num_warps": 4}


@triton.jit
def _dequantize_flat_kernel(
    q_ptr,
    s_ptr,
    out_ptr,
    n,
    BLOCK: tl.constexpr,
    MANT_BITS: tl.constexpr,
    MIN_EXP: tl.constexpr,
    HAS_INF: tl.constexpr,
    OUT_KIND: tl.constexpr,
):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    q = tl.load(q_ptr + offs, mask=mask, other=0)
    val = fp8_decode(q, MANT_BITS, MIN_EXP, HAS_INF) * tl.load(s_ptr)
    store_out(out_ptr + offs, val, mask, OUT_KIND)


@triton.jit
def _dequantize_grouped_kernel(
    q_ptr,
    s_ptr,
    out_ptr,  # (rows, cols), contiguous
    rows,
    cols,
    n_groups,  # scale columns
    stride_qr,
    stride_qc,
    BM: tl.constexpr,
    NB: tl.constexpr,
    G: tl.constexpr,
    ROW_GROUP: tl.constexpr,
    E8M0: tl.constexpr,
    MANT_BITS: tl.constexpr,
    MIN_EXP: tl.constexpr,
    HAS_INF: tl.constexpr,
    OUT_KIND: tl.constexpr,
):
    r, b, r3, c3, mask = row_block_tile(tl.program_id(0), rows, cols, n_groups, BM, NB, G)
    q = tl.load(q_ptr + r3 * stride_qr + c3 * stride_qc, mask=mask, other=0)
    s_mask = (r < rows)[:, None] & (b < n_groups)[None, :]
    s_offs = (r // ROW_GROUP)[:, None] * n_groups + b[None, :]
    if E8M0:  # 2**(E - 127): E = 0 is the subnormal 2**-127, E = 255 is NaN
        e = tl.load(s_ptr + s_offs, mask=s_mask, other=127).to(tl.int32)
        bits = tl.where(e == 0, 0x00400000, e << 23)
        s = tl.where(e == 255, 0x7FC00000, bits).to(tl.float32, bitcast=True)
    else:
        s = tl.load(s_ptr + s_offs, mask=s_mask, other=1.0)
    val = fp8_decode(q, MANT_BITS, MIN_EXP, HAS_INF) * s[:, :, None]
    store_out(out_ptr + r3 * cols + c3, val, mask, OUT_KIND)


_launch_flat = FastLaunch(_dequantize_flat_kernel)
_launch_grouped = FastLaunch(_dequantize_grouped_kernel)


def dequantize_triton(
    q: torch.Tensor, scale_inv: torch.Tensor | float, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """``reference.dequantize``: ``q.float() * scale_inv`` cast to ``dtype``, torch's layout."""
    spec = fp8_spec(q.dtype, "kernels.dequantize.dequantize (q.dtype)")
    kind = out_kind(dtype, "kernels.dequantize.dequantize")
    s = scalar_fp32(scale_inv, q.device, "kernels.dequantize.dequantize: scale_inv")
    q_flat, out, out_flat = flat_pair(q, dtype)
    n = q_flat.numel()
    if n:
        cfg = GPU_FLAT if is_gpu(q) else {"BLOCK": 1 << 15, "num_warps": 1}
        consts = {"MANT_BITS": spec.mant_bits, "MIN_EXP": spec.min_exp, "HAS_INF": spec.has_inf,
                  "OUT_KIND": kind}  # fmt: skip
        _launch_flat.launch(
            (triton.cdiv(n, cfg["BLOCK"]),),
            (q_flat.view(torch.uint8), s, store_view(out_flat), n),
            {**consts, **cfg},
            interpreted=not is_gpu(q),
        )
    return out


def _dequantize_grouped(
    q: torch.Tensor,
    scales: torch.Tensor,
    dtype: torch.dtype,
    *,
    group: int,
    row_group: int,
    e8m0: bool,
    what: str,
) -> torch.Tensor:
    """Dequantize the 2D view of ``q`` into a contiguous ``(rows, cols)`` tensor of ``dtype``."""
    spec = fp8_spec(q.dtype, f"kernels.dequantize.{what} (q.dtype)")
    kind = out_kind(dtype, f"kernels.dequantize.{what}")
    rows, cols = rows_cols(q, f"kernels.dequantize.{what}")
    out = torch.empty((rows, cols), dtype=dtype, device=q.device)
    if out.numel() == 0:
        return out
    q2d = q.reshape(rows, cols).view(torch.uint8)
    scales = scales.contiguous()
    n_groups = scales.shape[1]
    if is_gpu(q):
        cfg = {"NB": max(1, 128 // group), **GPU_GROUPED}
    else:  # interpreter: ~16K-element tiles
        nb = min(triton.next_power_of_2(n_groups), 512 // group)
        bm = min(triton.next_power_of_2(rows), max(1, 16384 // (nb * group)))
        cfg = {"BM": bm, "NB": nb, "num_warps": 1}
    grid = (triton.cdiv(rows, cfg["BM"]) * triton.cdiv(n_groups, cfg["NB"]),)
    consts = {"G": group, "ROW_GROUP": row_group, "E8M0": e8m0, "MANT_BITS": spec.mant_bits,
              "MIN_EXP": spec.min_exp, "HAS_INF": spec.has_inf, "OUT_KIND": kind}  # fmt: skip
    _launch_grouped.launch(
        grid,
        (q2d, scales, store_view(out), rows, cols, n_groups, *q2d.stride()),
        {**consts, **cfg},
        interpreted=not is_gpu(q),
    )
    return out


def mxfp8_dequantize_triton(
    q: torch.Tensor,
    e8m0: torch.Tensor,
    *,
    columnwise: bool = False,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """``reference.mxfp8_dequantize``: blocks of 32 along ``q``'s last dim in both layouts."""
    what = "mxfp8_dequantize"
    rows, cols = rows_cols(q, f"kernels.dequantize.{what}")
    expected = (rows, triton.cdiv(cols, 32))
    if tuple(e8m0.shape) != expected or e8m0.dtype != torch.uint8:
        raise ValueError(
            f"kernels.dequantize.{what}: e8m0 must be uint8 of shape {expected} for data of "
            f"shape {tuple(q.shape)}, got {e8m0.dtype} {tuple(e8m0.shape)}"
        )
    if columnwise and q.dim() != 2:
        raise ValueError(
            f"kernels.dequantize.{what}: columnwise data must be 2D, got {tuple(q.shape)}"
        )
    out = _dequantize_grouped(q, e8m0, dtype, group=32, row_group=1, e8m0=True, what=what)
    return out.t() if columnwise else out.reshape(q.shape)


def block_dequantize_triton(
    q: torch.Tensor,
    scale_inv: torch.Tensor,
    *,
    block_dim: int,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """``reference.block_dequantize``: ``q * scale_inv`` of each element's tile."""
    what = "block_dequantize"
    if block_dim not in (1, 2):
        raise ValueError(
            f"kernels.dequantize.{what}: block_dim must be 1 (1x128) or 2 (128x128), "
            f"got {block_dim!r}"
        )
    rows, cols = rows_cols(q, f"kernels.dequantize.{what}")
    n_tiles = triton.cdiv(cols, 128)
    expected = (rows, n_tiles) if block_dim == 1 else (triton.cdiv(rows, 128), n_tiles)
    if tuple(scale_inv.shape) != expected:
        raise ValueError(
            f"kernels.dequantize.{what}: scale_inv must have shape {expected} for data "
            f"{tuple(q.shape)} with block_dim={block_dim}, got {tuple(scale_inv.shape)}"
        )
    out = _dequantize_grouped(
        q, scale_inv.float(), dtype, group=128, row_group=1 if block_dim == 1 else 128,
        e8m0=False, what=what,
    )  # fmt: skip
    return out.reshape(q.shape)


# ---- the ops: reference calls, fakes, registration -----------------------------------------------
def _dequantize_ref(q: Tensor, scale_inv: Tensor, dtype: torch.dtype) -> Tensor:
    return reference.dequantize(q, scale_inv, dtype)


def _dequantize_cuda(q: Tensor, scale_inv: Tensor, dtype: torch.dtype) -> Tensor:
    return dequantize_triton(q, scale_inv, dtype)


def _dequantize_fake(q: Tensor, scale_inv: Tensor, dtype: torch.dtype) -> Tensor:
    return torch.empty_like(q, dtype=dtype)


def _mxfp8_dequantize_ref(q: Tensor, e8m0: Tensor, columnwise: bool, dtype: torch.dtype) -> Tensor:
    return reference.mxfp8_dequantize(q, e8m0, columnwise=columnwise, dtype=dtype)


def _mxfp8_dequantize_cuda(q: Tensor, e8m0: Tensor, columnwise: bool, dtype: torch.dtype) -> Tensor:
    return mxfp8_dequantize_triton(q, e8m0, columnwise=columnwise, dtype=dtype)


def _mxfp8_dequantize_fake(q: Tensor, e8m0: Tensor, columnwise: bool, dtype: torch.dtype) -> Tensor:
    # columnwise: the (rows, cols) matrix is the transpose of q's (cols, rows) layout
    out = q.new_empty(tuple(q.shape), dtype=dtype)
    return out.t() if columnwise else out


def _block_dequantize_ref(
    q: Tensor, scale_inv: Tensor, block_dim: int, dtype: torch.dtype
) -> Tensor:
    return reference.block_dequantize(q, scale_inv, block_dim=block_dim, dtype=dtype).contiguous()


def _block_dequantize_cuda(
    q: Tensor, scale_inv: Tensor, block_dim: int, dtype: torch.dtype
) -> Tensor:
    return block_dequantize_triton(q, scale_inv, block_dim=block_dim, dtype=dtype).contiguous()


def _block_dequantize_fake(
    q: Tensor, scale_inv: Tensor, block_dim: int, dtype: torch.dtype
) -> Tensor:
    return q.new_empty(q.shape, dtype=dtype)


_dequantize = register_op("dequantize", (), _dequantize_ref, _dequantize_cuda, _dequantize_fake)
_mxfp8_dequantize = register_op(
    "mxfp8_dequantize", (), _mxfp8_dequantize_ref, _mxfp8_dequantize_cuda, _mxfp8_dequantize_fake
)
_block_dequantize = register_op(
    "block_dequantize", (), _block_dequantize_ref, _block_dequantize_cuda, _block_dequantize_fake
)


# ---- public functions ----------------------------------------------------------------------------
def dequantize(q: Tensor, scale_inv: Tensor | float, dtype: torch.dtype = torch.float32) -> Tensor:
    """``reference.dequantize`` (a Python-float ``scale_inv`` becomes a tensor first)."""
    return _dequantize(q, as_scale(scale_inv, q), dtype)


def mxfp8_dequantize(
    q: Tensor, e8m0: Tensor, *, columnwise: bool = False, dtype: torch.dtype = torch.float32
) -> Tensor:
    """``reference.mxfp8_dequantize``."""
    return _mxfp8_dequantize(q, e8m0, bool(columnwise), dtype)


def block_dequantize(
    q: Tensor, scale_inv: Tensor, *, block_dim: int, dtype: torch.dtype = torch.float32
) -> Tensor:
    """``reference.block_dequantize``."""
    return _block_dequantize(q, scale_inv, block_dim, dtype)
