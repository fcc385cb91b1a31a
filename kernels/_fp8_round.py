"""Shared Triton helpers: exact FP8 encode/decode on integer bits, amax bits and scale formulas, the
row-block tile of the block-scaled kernels (``row_block_tile``) and the fp32/bf16/fp16 result store
(``store_out``); and the launchers' plain-Python helpers.

Every kernel encodes with ``fp8_encode`` (clamp to +-max, round to nearest even, FP8 subnormals
included), in one of two ways:

- compiled for a GPU with native FP8 conversions (sm89+, ``hw_rounding``), the hardware converts
  the clamped fp32 value (``cvt.rn.satfinite``): the explicit path below is a dozen ALU ops per
  element, and the cast kernels were bound by instruction issue with it, not by memory (measured
  on H200, see BENCHMARKS.md);
- elsewhere the value is rounded explicitly on its fp32 bits and the byte packed with integer ops:
  under ``TRITON_INTERPRET=1``, whose float8 conversion truncates (drops the rounding carry) and
  turns NaN/inf into wrong codes (measured on Triton 3.9: 1+3*2**-8 -> 0x38, NaN -> 0x7C), and on
  older GPUs, where Triton has no E4M3 type and converts E5M2 in software, rounding toward zero.
Both are checked bit for bit against ``reference.py``: the CPU tests run the second, the GPU tests
the first, on every bf16 value and on every rounding tie of both formats
(``tests/kernels/test_triton_gpu.py``).

NaN becomes the byte 0x7F (a NaN in both formats). Its sign is not part of the contract: torch's own
CPU cast yields 0x7F or 0xFF for the same NaN depending on input dtype and vector width.

Division is ``tl.math.div_rn`` everywhere: Triton's ``/`` on fp32 is not IEEE-rounded on NVIDIA
GPUs, while the reference divides with IEEE round-to-nearest.
"""

from __future__ import annotations

import functools
import math
import os
import struct
from dataclasses import dataclass

import torch
from dist_quant.kernels._triton import tl, triton


@dataclass(frozen=True)
class Fp8Spec:
    """Constants a kernel needs to encode/decode one FP8 format (passed as constexprs)."""

    max: float  # largest finite value
    max_bits: int  # fp32 bits of ``max``
    mant_bits: int  # explicit mantissa bits
    min_exp: int  # unbiased exponent of the smallest normal
    has_inf: bool  # E5M2 has inf and several NaNs; E4M3FN has only S.1111.111 = NaN


@functools.cache
def _known_specs() -> dict[torch.dtype, Fp8Spec]:
    # built once: f32_bits goes through a torch tensor, too slow for every launch
    return {
        torch.float8_e4m3fn: Fp8Spec(448.0, f32_bits(448.0), 3, -6, False),
        torch.float8_e5m2: Fp8Spec(57344.0, f32_bits(57344.0), 2, -14, True),
    }


def fp8_spec(fp8_dtype: torch.dtype, where: str) -> Fp8Spec:
    """The ``Fp8Spec`` of ``fp8_dtype``; raises ``ValueError`` naming ``where`` otherwise."""
    spec = _known_specs().get(fp8_dtype)
    if spec is not None:
        return spec
    raise ValueError(
        f"{where}: fp8_dtype must be torch.float8_e4m3fn or torch.float8_e5m2, got {fp8_dtype!r}"
    )


def f32_bits(value: float) -> int:
    """The int32 bits of ``value`` rounded to fp32 as torch rounds it (overflow gives inf).

    Pure Python (no tensor, no ``.item()``): launchers call it on the host, also while a graph is
    captured or traced."""
    try:
        packed = struct.pack("<f", value)
    except OverflowError:  # beyond fp32 after rounding: torch gives +-inf
        packed = struct.pack("<f", math.copysign(math.inf, value))
    return struct.unpack("<i", packed)[0]


_INTERPRETED = tl.constexpr(
    os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")
)


@triton.jit
def fp8_encode(
    v,
    MAX_BITS: tl.constexpr,
    MANT_BITS: tl.constexpr,
    MIN_EXP: tl.constexpr,
    HW_ROUND: tl.constexpr,
):
    """fp32 ``v`` -> FP8 byte (int32 in [0, 255]): clamp to +-max, round half to even, NaN -> 0x7F.

    Clamping first equals the reference's ``clamp(-max, max).to(fp8)``: a value <= max rounds to a
    code <= max. With ``HW_ROUND`` (a GPU whose FP8 conversion is native, ``hw_rounding``) the
    hardware conversion rounds. Otherwise ``c = 2**(max(e, MIN_EXP) + 23 - MANT_BITS)`` has an
    fp32 ulp equal to the FP8 quantum at ``|v|`` (exponent ``e``; subnormals share MIN_EXP), so the
    fp32 add ``|v| + c`` rounds to the FP8 grid with ties to even and ``- c`` is exact; scaling by
    ``2**(bias - 127)`` (exact; FP8 subnormals become fp32 subnormals) then turns the fp32 exponent
    and top mantissa bits into the FP8 fields.
    """
    bits = v.to(tl.int32, bitcast=True)
    mag = bits & 0x7FFFFFFF
    is_nan = mag > 0x7F800000
    mag = tl.minimum(mag, MAX_BITS)  # integer order of magnitudes = float order; inf -> max
    if HW_ROUND and not _INTERPRETED:  # (the interpreter run on CUDA tensors still packs)
        # the clamped value with v's sign (bit ops keep -0); the hardware conversion rounds it to
        # nearest even (cvt.rn), subnormals included, which is the whole rounding of the contract
        on_grid = (mag | (bits & -0x80000000)).to(tl.float32, bitcast=True)
        if MANT_BITS == 3:
            q = on_grid.to(tl.float8e4nv, fp_downcast_rounding="rtne")
        else:
            q = on_grid.to(tl.float8e5, fp_downcast_rounding="rtne")
        return tl.where(is_nan, 0x7F, q.to(tl.uint8, bitcast=True).to(tl.int32))
    else:
        c_bits = tl.maximum(mag & 0x7F800000, (MIN_EXP + 127) << 23) + ((23 - MANT_BITS) << 23)
        c = c_bits.to(tl.float32, bitcast=True)
        r = (mag.to(tl.float32, bitcast=True) + c) - c
        code = (r * (2.0 ** (-126 - MIN_EXP))).to(tl.int32, bitcast=True) >> (23 - MANT_BITS)
        return tl.where(is_nan, 0x7F, code | ((bits >> 24) & 0x80))


@triton.jit
def fp8_decode(
    byte, MANT_BITS: tl.constexpr, MIN_EXP: tl.constexpr, HAS_INF: tl.constexpr
) -> tl.tensor:
    """FP8 byte (any integer type) -> exact fp32; NaN bits follow torch's own decode.

    The inverse of ``fp8_encode``'s packing: the FP8 fields shifted into fp32 position read as
    ``value * 2**(bias - 127)`` (an fp32 subnormal for FP8 subnormals); the multiply undoes that
    exactly.
    """
    code = byte.to(tl.int32) & 0xFF
    mag = code & 0x7F
    f = (mag << (23 - MANT_BITS)).to(tl.float32, bitcast=True) * (2.0 ** (126 + MIN_EXP))
    out = f.to(tl.int32, bitcast=True)
    if HAS_INF:  # E5M2: exponent all ones is inf (mantissa 0) or NaN
        mant = code & ((1 << MANT_BITS) - 1)
        special = tl.where(mant == 0, 0x7F800000, 0x7FC00000 | (mant << (23 - MANT_BITS)))
        out = tl.where(mag >= (0x7F >> MANT_BITS) << MANT_BITS, special, out)
    else:  # E4M3FN: only S.1111.111 is NaN
        out = tl.where(mag == 0x7F, 0x7FF00000, out)
    return (out | ((code & 0x80) << 24)).to(tl.float32, bitcast=True)


@triton.jit
def abs_bits(x):
    """``|x|`` of an fp32 tensor as int32 bits: their integer max is the float max, NaN on top."""
    return x.to(tl.int32, bitcast=True) & 0x7FFFFFFF


@triton.jit
def amax_from_bits(m):
    """Float value of a max of ``abs_bits``; any NaN becomes the canonical quiet NaN."""
    return tl.where(m > 0x7F800000, 0x7FC00000, m).to(tl.float32, bitcast=True)


@triton.jit
def is_finite(a):
    return (a.to(tl.int32, bitcast=True) & 0x7FFFFFFF) < 0x7F800000


@triton.jit
def is_inf(a):
    return (a.to(tl.int32, bitcast=True) & 0x7FFFFFFF) == 0x7F800000


@triton.jit
def scale_from_amax(a, FP8_MAX: tl.constexpr, POW2: tl.constexpr):
    """``FP8_MAX / a`` in fp32; ``a`` <= 0, inf or NaN -> 1; inf -> FLT_MAX; POW2 rounds down."""
    s = tl.math.div_rn(tl.zeros_like(a) + FP8_MAX, a)
    s = tl.where(is_inf(s), 3.4028234663852886e38, s)
    s = tl.where(is_finite(a) & (a > 0.0), s, 1.0)
    if POW2:
        # Zeroing the mantissa rounds a positive normal float down to a power of two.
        s = (s.to(tl.int32, bitcast=True) & 0x7F800000).to(tl.float32, bitcast=True)
    return s


@triton.jit
def current_scale_from_amax(a, eps, FP8_MAX: tl.constexpr, POW2: tl.constexpr):
    """Current scaling: floor ``a`` at ``eps`` (NaN kept), then ``scale_from_amax``. ``eps`` is
    rounded to fp32 here: Triton's launcher passes a Python float as fp32, inductor's as fp64."""
    eps = tl.cast(eps, tl.float32)
    a = tl.where(a < eps, eps, a)
    return scale_from_amax(a, FP8_MAX, POW2)


@triton.jit
def reciprocal(s):
    """``1 / s`` with IEEE rounding."""
    return tl.math.div_rn(tl.zeros_like(s) + 1.0, s)


@triton.jit
def to_bf16_bits(f):
    """fp32 -> bfloat16 bits (int16) with round-to-nearest-even (the interpreter truncates)."""
    bits = f.to(tl.int32, bitcast=True)
    mag = bits & 0x7FFFFFFF
    rounded = (mag + 0x7FFF + ((mag >> 16) & 1)) >> 16  # no overflow: finite mag <= 0x7F7FFFFF
    rounded = tl.where(mag > 0x7F800000, 0x7FC0, rounded)
    return (rounded | ((bits >> 16) & 0x8000)).to(tl.int16)


@triton.jit
def row_block_tile(pid, rows, cols, n_blocks, BM: tl.constexpr, NB: tl.constexpr, G: tl.constexpr):
    """Program ``pid``'s ``[BM, NB, G]`` tile of a ``(rows, cols)`` matrix whose rows are cut into
    ``n_blocks`` blocks of ``G`` (the last may be short), the blocks' axis explicit so a kernel
    reduces each block with one ``tl.max(..., axis=2)`` and no reshape. Returns the tile's rows
    ``r`` ``[BM]`` and blocks ``b`` ``[NB]`` (int64 rows), the broadcastable row and column
    indices ``r3`` ``[BM, 1, 1]`` and ``c3`` ``[1, NB, G]``, and the in-bounds ``mask``. Inlined
    into each kernel: the same instructions as writing it out."""
    n_col_tiles = tl.cdiv(n_blocks, NB)
    r = ((pid // n_col_tiles) * BM + tl.arange(0, BM)).to(tl.int64)
    b = (pid % n_col_tiles) * NB + tl.arange(0, NB)
    c = (b[:, None] * G + tl.arange(0, G)[None, :]).to(tl.int64)  # [NB, G]
    r3 = r[:, None, None]
    c3 = c[None, :, :]
    return r, b, r3, c3, (r3 < rows) & (c3 < cols)


@triton.jit
def store_out(ptr, val, mask, OUT_KIND: tl.constexpr):
    """Store an fp32 result as the output dtype ``OUT_KINDS`` numbers: fp32, bf16 (``ptr`` is the
    int16 view from ``store_view``; explicit round-to-nearest-even, since the interpreter's bf16
    conversion truncates) or fp16 (``.to`` rounds to nearest even on both backends)."""
    if OUT_KIND == 0:
        tl.store(ptr, val, mask=mask)
    elif OUT_KIND == 1:
        tl.store(ptr, to_bf16_bits(val), mask=mask)
    else:
        tl.store(ptr, val.to(tl.float16), mask=mask)


# ---- launcher-side helpers (plain Python) ----------------------------------------------------


def scalar_fp32(value: torch.Tensor | float, device: torch.device, what: str) -> torch.Tensor:
    """A 1-element fp32 tensor on ``device`` (no copy when it already is one)."""
    if (
        isinstance(value, torch.Tensor)
        and value.dtype == torch.float32
        and value.shape == (1,)
        and value.device == device
    ):
        return value  # a recipe state's scale: every delayed cast passes one
    t = torch.as_tensor(value, dtype=torch.float32, device=device)
    if t.numel() != 1:
        raise ValueError(f"{what} must hold exactly one value, got shape {tuple(t.shape)}")
    return t.reshape(1)


def rows_cols(x: torch.Tensor, what: str) -> tuple[int, int]:
    """The 2D view ``(prod(shape[:-1]), shape[-1])`` that transpose/MXFP8/block casts work on."""
    if x.dim() == 0:
        raise ValueError(f"{what}: needs a tensor of rank >= 1 to view as (rows, cols), got 0-dim")
    return math.prod(x.shape[:-1]), x.shape[-1]


def flat_pair(
    x: torch.Tensor, out_dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(x_flat, out, out_flat)`` for an elementwise op whose output follows torch's layout rule.

    ``out`` is ``empty_like(x)`` (torch's elementwise ops give the same strides, permuted layouts
    included), and both tensors are read as their dense storage span, so a transposed input costs
    no copy; an input with gaps is first copied into ``out``'s layout.
    """
    out = torch.empty_like(x, dtype=out_dtype)
    if x.stride() != out.stride():
        x = torch.empty_like(out, dtype=x.dtype).copy_(x)
    n = x.numel()
    return x.as_strided((n,), (1,)), out, out.as_strided((n,), (1,))


def dense_flat(x: torch.Tensor) -> torch.Tensor:
    """All of ``x``'s elements as a 1D tensor, in storage order (no copy for a dense layout)."""
    if x.is_contiguous() or x.stride() == torch.empty_like(x, device="meta").stride():
        return x.as_strided((x.numel(),), (1,))
    return x.reshape(-1)


def cdiv(a: int, b: int) -> int:
    """``triton.cdiv`` in plain Python: Triton 3.6's is a constexpr function costing ~10 us a call."""
    return -(-a // b)


def next_pow2(n: int) -> int:
    """``triton.next_power_of_2`` for ``n >= 1`` (1 for ``n <= 1``), in plain Python."""
    return 1 if n <= 1 else 1 << (n - 1).bit_length()


@functools.cache
def _native_fp8(device: torch.device) -> bool:
    return torch.cuda.get_device_capability(device) >= (8, 9)


def hw_rounding(x: torch.Tensor) -> bool:
    """Whether kernels on ``x``'s device may leave the FP8 rounding to the hardware conversion:
    compiled for a GPU with native FP8 conversions (sm89+: Triton emits ``cvt.rn.satfinite``).
    For sm80 Triton has no E4M3 type and converts E5M2 through ``cvt.rz.f16x2.f32`` (round toward
    zero; read in the PTX Triton 3.9 generates), so older GPUs pack the byte themselves."""
    return x.device.type == "cuda" and _native_fp8(x.device)


def is_gpu(x: torch.Tensor) -> bool:
    """Launchers size blocks for the GPU, or for the CPU interpreter (few, large programs)."""
    return x.device.type == "cuda"


# The output dtypes of kernels that write a high-precision result through ``store_out``.
OUT_KINDS = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}


def out_kind(dtype: torch.dtype, what: str, arg: str = "dtype") -> int:
    """``store_out``'s ``OUT_KIND`` for ``dtype``; ``ValueError`` naming ``what`` and ``arg`` for
    any other dtype."""
    if dtype not in OUT_KINDS:
        raise ValueError(f"{what}: {arg} must be fp32/bf16/fp16, got {dtype}")
    return OUT_KINDS[dtype]


def store_view(out: torch.Tensor) -> torch.Tensor:
    """What ``store_out`` writes through: a bf16 output as its int16 bits (rounded in the
    kernel), any other as it is."""
    return out.view(torch.int16) if out.dtype == torch.bfloat16 else out
