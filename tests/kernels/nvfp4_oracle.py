"""An independent float64 re-derivation of the NVFP4 contract (DESIGN.md), for the tests.

Written from the contract's text, not from ``kernels/reference_nvfp4.py``: numpy float64, rounded to
fp32 after each step the contract rounds (for +, *, / of fp32 operands, computing in float64 and
rounding once gives the correctly rounded fp32 result); E4M3 and E2M1 rounding by nearest grid value
with ties to the even code, found by searching the value tables.
"""

from __future__ import annotations

import numpy as np
import torch
from fp8_oracle import E4M3, decode_all

F32 = np.float32
FLT_MAX = float(np.finfo(np.float32).max)
E2M1_GRID = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
E4M3_GRID = np.array(decode_all(E4M3)[:127])  # codes 0..126 from their bit fields: 0 .. 448


def r32(x) -> np.ndarray:
    with np.errstate(over="ignore"):  # beyond FLT_MAX rounds to inf, as fp32 arithmetic does
        return np.asarray(x, dtype=np.float64).astype(np.float32).astype(np.float64)


def global_scales(amax: float) -> tuple[float, float]:
    a = float(np.float32(amax))
    if a == 0:
        s = 1.0
    else:
        with np.errstate(all="ignore"):
            s = float(r32(2688.0 / a))
        if np.isnan(s) or s > FLT_MAX:  # fminf(s, FLT_MAX) returns the non-NaN operand
            s = FLT_MAX
        if s == 0:
            s = 1.0
    return s, float(r32(1.0 / s))


def nearest_even(mag: np.ndarray, grid: np.ndarray) -> np.ndarray:
    """Index of the grid value nearest to each ``mag`` (finite, within the grid), ties to even."""
    dist = np.abs(mag[..., None] - grid)
    best = dist.min(-1, keepdims=True)
    candidates = dist == best
    idx = np.argmax(candidates, -1)
    tie = candidates.sum(-1) > 1
    return np.where(tie & (idx % 2 == 1), idx + 1, idx)


def e4m3(v: np.ndarray) -> np.ndarray:
    """Saturating RNE to E4M3 (float64 values; NaN stays NaN)."""
    mag = np.minimum(np.abs(np.nan_to_num(v, nan=0.0)), 448.0)
    out = np.copysign(E4M3_GRID[nearest_even(mag, E4M3_GRID)], v)
    return np.where(np.isnan(v), np.nan, out)


def e2m1_codes(v: np.ndarray) -> np.ndarray:
    mag = np.minimum(np.abs(np.nan_to_num(v, nan=0.0)), 6.0)
    code = nearest_even(mag, E2M1_GRID) | (np.signbit(v).astype(np.int64) << 3)
    return np.where(np.isnan(v), 7, code)


def quantize(x: torch.Tensor, amax: float, block_2d: bool = False):
    """``(packed bytes, scales as float64, s_dec)`` of the rowwise cast of a 2-D (M, K) ``x``."""
    xv = x.double().numpy()
    m, k = xv.shape
    s_enc, s_dec = global_scales(amax)
    blocks = xv.reshape(m, k // 16, 16)
    with np.errstate(invalid="ignore", divide="ignore"):
        bamax = np.abs(blocks).max(-1)
        bamax = np.where(np.isnan(blocks).any(-1), np.nan, bamax)
        if block_2d:
            for r0 in range(0, m, 16):
                bamax[r0 : r0 + 16] = bamax[r0 : r0 + 16].max(0, initial=-1.0)
                nan_cols = np.isnan(bamax[r0 : r0 + 16]).any(0)
                bamax[r0 : r0 + 16, nan_cols] = np.nan
        sb = e4m3(r32(bamax * r32(s_enc * float(r32(1 / 6)))))
        enc = r32(1.0 / r32(sb * s_dec))
        enc = np.where(np.isnan(enc) | (enc > FLT_MAX), FLT_MAX, enc)
        v = r32(blocks * enc[..., None]).reshape(m, k)
    codes = e2m1_codes(v)
    packed = (codes[:, 0::2] | (codes[:, 1::2] << 4)).astype(np.uint8)
    return packed, sb, s_dec
