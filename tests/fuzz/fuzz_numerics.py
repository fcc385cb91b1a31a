"""Float64 re-derivations of the numerics contract (DESIGN.md, docs/INTERNALS.md) for the tensor
fuzz suites, written from the contract's text with torch's own FP8 casts, never with the kernels.

fp32 values come from float64 math rounded once to fp32: for one division of fp32 inputs the
float64 quotient rounded to fp32 equals the IEEE fp32 quotient (double rounding is innocuous when
the wider format has at least 2p + 2 bits: 53 >= 2 * 24 + 2).

GEMM check: the operands the module multiplies are FP8 values times power-of-two scales (MXFP8,
power-of-two block scales) or per-tensor scales; the test re-derives them, multiplies in float64
and allows the fp32 accumulation error bound `(K + 4) * 2**-24 * sum_k |a_k b_k|` (recursive
summation in any order, the final bias add, and the fp32 rounding of `q * scale_inv` where a
per-tensor scale is not a power of two). A misplaced block or a wrong scale moves an
element by a whole FP8 step (2**-4 relative in E4M3), far outside that bound.
"""

from __future__ import annotations

import math

import torch

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
FP8_MAX = {E4M3: 448.0, E5M2: 57344.0}
FLT_MAX = float(torch.finfo(torch.float32).max)
U = 2.0**-24  # fp32 unit roundoff


def f32(x: float) -> float:
    """`x` rounded to fp32 (inf on overflow)."""
    return float(torch.tensor(x, dtype=torch.float64).float())


def amax(t: torch.Tensor) -> float:
    """max |t| as a float; NaN if any element is NaN; 0 for an empty tensor."""
    if t.numel() == 0:
        return 0.0
    a = t.detach().double().abs()
    return math.nan if bool(a.isnan().any()) else float(a.max())


def scale_from_amax(a: float, fp8_max: float, *, margin: int = 0) -> float | None:
    """`fp8_max / a / 2**margin` in fp32 (inf -> FLT_MAX); None where the contract has no scale
    (amax 0, inf or NaN: delayed keeps the previous one, current and block use 1)."""
    if not math.isfinite(a) or a <= 0:
        return None
    s = f32(f32(fp8_max / a) / 2.0**margin)
    return FLT_MAX if math.isinf(s) else s


def floor_pow2(s: float) -> float:
    mantissa, exponent = math.frexp(s)  # s = mantissa * 2**exponent, mantissa in [0.5, 1)
    return math.ldexp(0.5, exponent)


def cast(x: torch.Tensor, scale: float, dtype: torch.dtype) -> torch.Tensor:
    """saturate(round(x * scale)) to `dtype` with torch's own cast; returned dequantized in
    float64 (`q / scale`, exact for the power-of-two and per-tensor scales used here)."""
    s = torch.tensor(scale, dtype=torch.float32)
    q = (x.detach().float() * s).clamp(-FP8_MAX[dtype], FP8_MAX[dtype]).to(dtype)
    return q.double() * (1.0 / s).double()


def current_qdq(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Current scaling: scale 1 when the tensor's amax is 0, inf or NaN."""
    s = scale_from_amax(amax(x), FP8_MAX[dtype])
    return cast(x, 1.0 if s is None else s, dtype)


def mxfp8_qdq(x2d: torch.Tensor) -> torch.Tensor:
    """MXFP8 E4M3 along the last dim of a 2D tensor: blocks of 32 (a short ragged tail), shared
    scale 2**(127 - E) with E the RCEIL exponent of `amax / 448` (0 for an all-zero block)."""
    out = torch.empty(x2d.shape, dtype=torch.float64)
    for start in range(0, x2d.shape[1], 32):
        block = x2d[:, start : start + 32]
        for r in range(x2d.shape[0]):
            v = f32(amax(block[r]) / 448.0)
            if not math.isfinite(v):
                out[r, start : start + 32] = math.nan  # E8M0 code 255
                continue
            if v == 0.0:
                e = 0
            else:
                mantissa, exponent = math.frexp(v)  # v = mantissa * 2**exponent
                e = 127 + exponent - (1 if mantissa == 0.5 else 0)  # smallest 2**(e-127) >= v
                e = min(max(e, 0), 254)
            out[r, start : start + 32] = cast(block[r], 2.0 ** (127 - e), E4M3)
    return out


def block_qdq(x2d: torch.Tensor, rows_per_tile: int) -> torch.Tensor:
    """Float8 block scaling (E4M3, power-of-two scales): tiles of `rows_per_tile` x 128, scale
    `floor_pow2(448 / amax_tile)`, 1 for an all-zero tile."""
    out = torch.empty(x2d.shape, dtype=torch.float64)
    for r0 in range(0, x2d.shape[0], rows_per_tile):
        for c0 in range(0, x2d.shape[1], 128):
            tile = x2d[r0 : r0 + rows_per_tile, c0 : c0 + 128]
            s = scale_from_amax(amax(tile), 448.0)
            out[r0 : r0 + rows_per_tile, c0 : c0 + 128] = cast(
                tile, 1.0 if s is None else floor_pow2(s), E4M3
            )
    return out


def within_gemm_bound(
    got: torch.Tensor, a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None = None
) -> bool:
    """`got` (fp32) is `a @ b.T (+ bias)` of float64 operands up to fp32 accumulation error."""
    exact = a @ b.T
    size = a.abs() @ b.abs().T
    if bias is not None:
        exact = exact + bias.double()
        size = size + bias.double().abs()
    # plus an absolute term: results and scale_inv values in the fp32 subnormal range round to
    # a multiple of 2**-149, not relative to their size
    bound = (a.shape[1] + 4) * (U * size + 2.0**-149)
    # where the sum of magnitudes nears FLT_MAX, fp32 may overflow (huge values times saturated ones)
    ok = ((got.double() - exact).abs() <= bound) | (size > FLT_MAX / 2)
    return got.shape == exact.shape and bool(ok.all())
