"""An independent FP8 oracle for the tests: decodes bytes from their bit fields in Python floats and
encodes by searching the decoded table (round to nearest, ties to the even code, saturate).

Nothing here calls torch's float8 casts or the code under test, so the tests can pin both.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class Fp8Format:
    name: str
    exponent_bits: int
    mantissa_bits: int
    bias: int
    has_inf: (
        bool  # E5M2 follows IEEE (inf, NaN at exponent all ones); E4M3FN has only NaN S.1111.111
    )

    @property
    def max(self) -> float:
        return max(v for v in decode_all(self) if math.isfinite(v))

    @property
    def min_normal_exponent(self) -> int:
        return 1 - self.bias


E4M3 = Fp8Format("e4m3fn", 4, 3, 7, has_inf=False)
E5M2 = Fp8Format("e5m2", 5, 2, 15, has_inf=True)


def decode(fmt: Fp8Format, byte: int) -> float:
    """Value of one byte, from sign, exponent and mantissa fields."""
    sign = -1.0 if byte & 0x80 else 1.0
    exp_field = (byte >> fmt.mantissa_bits) & ((1 << fmt.exponent_bits) - 1)
    mant_field = byte & ((1 << fmt.mantissa_bits) - 1)
    exp_all_ones = exp_field == (1 << fmt.exponent_bits) - 1
    if fmt.has_inf and exp_all_ones:
        return sign * math.inf if mant_field == 0 else math.nan
    if not fmt.has_inf and exp_all_ones and mant_field == (1 << fmt.mantissa_bits) - 1:
        return math.nan
    frac = mant_field / (1 << fmt.mantissa_bits)
    if exp_field == 0:  # subnormal: no implicit 1, exponent pinned at the minimum
        return sign * frac * 2.0 ** (1 - fmt.bias)
    return sign * (1.0 + frac) * 2.0 ** (exp_field - fmt.bias)


def decode_all(fmt: Fp8Format) -> list[float]:
    return [decode(fmt, b) for b in range(256)]


def positive_codes(fmt: Fp8Format) -> tuple[np.ndarray, np.ndarray]:
    """(values, codes) of every finite non-negative code, sorted by value."""
    pairs = sorted(
        (v, b)
        for b, v in enumerate(decode_all(fmt))
        if b < 0x80 and math.isfinite(v) and not math.isnan(v)
    )
    return np.array([v for v, _ in pairs]), np.array([b for _, b in pairs])


def encode(fmt: Fp8Format, values: np.ndarray) -> np.ndarray:
    """Bytes for float64 ``values``: round to nearest, ties to even code, saturate to +-max.

    NaN inputs give 0xFF (callers compare NaN positions, not NaN bytes).
    """
    table, codes = positive_codes(fmt)
    flat = np.asarray(values, dtype=np.float64).reshape(-1)
    out = np.empty(flat.shape, dtype=np.uint8)
    for i, v in enumerate(flat):
        if math.isnan(v):
            out[i] = 0xFF
            continue
        mag = min(abs(v), table[-1])
        hi = int(np.searchsorted(table, mag, side="left"))
        if table[hi] == mag:
            code = codes[hi]
        else:
            lo_v, hi_v = table[hi - 1], table[hi]
            if mag - lo_v < hi_v - mag:
                code = codes[hi - 1]
            elif mag - lo_v > hi_v - mag:
                code = codes[hi]
            else:  # tie: the code with an even mantissa, i.e. an even byte
                code = codes[hi - 1] if codes[hi - 1] % 2 == 0 else codes[hi]
        out[i] = code | (0x80 if math.copysign(1.0, v) < 0 else 0)
    return out.reshape(np.shape(values))


def decode_bytes(fmt: Fp8Format, data: np.ndarray) -> np.ndarray:
    table = np.array(decode_all(fmt))
    return table[np.asarray(data, dtype=np.uint8)]


def f32(x: float | np.ndarray) -> np.ndarray:
    """Round float64 to fp32 (RNE), returned as float64. A float64 quotient or product of fp32
    inputs rounded this way equals the fp32 IEEE result (53 >= 2 * 24 + 2 bits: no double-rounding
    error)."""
    with np.errstate(over="ignore"):
        return np.asarray(x, dtype=np.float64).astype(np.float32).astype(np.float64)


def ulp(fmt: Fp8Format, y: float) -> float:
    """Spacing of the FP8 grid at |y| (subnormal spacing below the normal range)."""
    e = (
        max(math.frexp(abs(y))[1] - 1, fmt.min_normal_exponent)
        if y != 0
        else fmt.min_normal_exponent
    )
    return 2.0 ** (e - fmt.mantissa_bits)


def floor_pow2(s: float) -> float:
    """Largest power of two <= s (s positive, finite)."""
    mantissa, exponent = math.frexp(s)  # s = mantissa * 2**exponent, mantissa in [0.5, 1)
    return 2.0 ** (exponent - 1)
