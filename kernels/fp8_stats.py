"""FP8 cast telemetry in Triton: saturated, underflowed and non-zero counts and amax of one cast.

Matches ``reference.cast_stats`` exactly (integer counts, amax bit for bit). It is a separate read
of ``x``, launched only on telemetry steps (``dist_quant.telemetry``), instead of counters inside
the cast kernels: the casts stay untouched (and their torch.library registration with them), and
a step without telemetry runs no extra instruction at all. The price is one more read of each
quantized tensor on a stats step, measured by ``bench/bench_stats.py``.

Both tests are integer compares on the fp32 bits of ``v = x * scale`` (the cast's own product):

- saturated: ``max_bits < |v|_bits <= inf_bits`` (NaN bits lie above inf's and are excluded);
- underflowed: ``x != 0`` and ``|v|_bits <= bits(2**(MIN_EXP - MANT_BITS - 1))``, half the smallest
  FP8 subnormal: round-to-nearest-even sends exactly half to 0 (even) and anything above it up.

Each persistent program writes its own partial counts (int64) and amax bits (int32); the launcher
sums them with torch on the device, so the counts are exact and deterministic with no atomics.
"""

from __future__ import annotations

import torch
from dist_quant.kernels import reference
from dist_quant.kernels._fp8_round import (
    abs_bits,
    dense_flat,
    f32_bits,
    fp8_spec,
    is_gpu,
    scalar_fp32,
)
from dist_quant.kernels._op import as_scale, register_op
from dist_quant.kernels._triton import tl, triton

_INPUT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# GPU: BLOCK elements per loop step, PROGRAMS_PER_SM persistent programs per SM (the amax pass's
# configuration in current.py; bench/bench_stats.py measures the cost of a whole stats step).
GPU_STATS = {"BLOCK": 4096, "num_warps": 8, "PROGRAMS_PER_SM": 4}
_INF_BITS = 0x7F800000


@triton.jit
def _cast_stats_kernel(
    x_ptr,
    scale_ptr,
    counts_ptr,
    amax_ptr,
    n,
    iters,
    MAX_BITS: tl.constexpr,
    HALF_MIN_BITS: tl.constexpr,
    BLOCK: tl.constexpr,
):
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    scale = tl.load(scale_ptr)
    saturated = tl.zeros([BLOCK], dtype=tl.int64)
    underflowed = tl.zeros([BLOCK], dtype=tl.int64)
    nonzero = tl.zeros([BLOCK], dtype=tl.int64)
    amax_bits = tl.zeros([BLOCK], dtype=tl.int32)
    for i in range(0, iters):
        offs = (pid + i * nprog).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        x = tl.load(x_ptr + offs, mask=offs < n, other=0.0).to(tl.float32)
        x_mag = abs_bits(x)
        v_mag = abs_bits(x * scale)  # masked lanes: x = 0, v = 0, counted nowhere
        is_nonzero = x_mag != 0
        saturated += ((v_mag > MAX_BITS) & (v_mag <= 0x7F800000)).to(tl.int64)
        underflowed += (is_nonzero & (v_mag <= HALF_MIN_BITS)).to(tl.int64)
        nonzero += is_nonzero.to(tl.int64)
        amax_bits = tl.maximum(amax_bits, x_mag)
    tl.store(counts_ptr + pid * 3, tl.sum(saturated, axis=0))
    tl.store(counts_ptr + pid * 3 + 1, tl.sum(underflowed, axis=0))
    tl.store(counts_ptr + pid * 3 + 2, tl.sum(nonzero, axis=0))
    tl.store(amax_ptr + pid, tl.max(amax_bits, axis=0))


def _half_min_subnormal_bits(fp8_dtype: torch.dtype) -> int:
    spec = fp8_spec(fp8_dtype, "kernels.fp8_stats.cast_stats")
    return f32_bits(2.0 ** (spec.min_exp - spec.mant_bits - 1))


def cast_stats_triton(
    x: torch.Tensor, scale: torch.Tensor | float, fp8_dtype: torch.dtype
) -> reference.CastStats:
    """``reference.cast_stats`` in one launch plus a few tiny torch reductions; no host sync."""
    spec = fp8_spec(fp8_dtype, "kernels.fp8_stats.cast_stats")
    if x.dtype not in _INPUT_DTYPES:
        raise ValueError(f"kernels.fp8_stats.cast_stats: x must be fp32/bf16/fp16, got {x.dtype}")
    dev = x.device
    scale_t = scalar_fp32(scale, dev, "kernels.fp8_stats.cast_stats: scale")
    n = x.numel()
    if n == 0:
        zero = torch.zeros((), dtype=torch.int64, device=dev)
        return reference.CastStats(zero, zero.clone(), zero.clone(), reference.amax(x))
    x_flat = dense_flat(x.detach())
    if is_gpu(x):
        block, warps = GPU_STATS["BLOCK"], GPU_STATS["num_warps"]
        sms = torch.cuda.get_device_properties(dev).multi_processor_count
        programs = min(triton.cdiv(n, block), sms * GPU_STATS["PROGRAMS_PER_SM"])
    else:
        block, warps = 1 << 12, 1
        programs = min(triton.cdiv(n, block), 4)
    counts = torch.empty((programs, 3), dtype=torch.int64, device=dev)
    amax_bits = torch.empty(programs, dtype=torch.int32, device=dev)
    iters = triton.cdiv(triton.cdiv(n, block), programs)
    _cast_stats_kernel[(programs,)](
        x_flat, scale_t, counts, amax_bits, n, iters,
        MAX_BITS=spec.max_bits, HALF_MIN_BITS=_half_min_subnormal_bits(fp8_dtype), BLOCK=block,
        num_warps=warps,
    )  # fmt: skip
    total = counts.sum(0)
    top = amax_bits.max()
    # bits above inf are a NaN: the canonical quiet NaN, as reference.amax's NaN
    amax = torch.where(top > _INF_BITS, torch.full_like(top, 0x7FC00000), top).view(torch.float32)
    return reference.CastStats(total[0], total[1], total[2], amax)


# ---- the op: reference call, fake, registration ------------------------------------------------
def _cast_stats_ref(
    x: torch.Tensor, scale: torch.Tensor, fp8_dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    return tuple(reference.cast_stats(x, scale, fp8_dtype))


def _cast_stats_cuda(
    x: torch.Tensor, scale: torch.Tensor, fp8_dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    return tuple(cast_stats_triton(x, scale, fp8_dtype))


def _cast_stats_fake(
    x: torch.Tensor, scale: torch.Tensor, fp8_dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    counts = [x.new_empty((), dtype=torch.int64) for _ in range(3)]
    return (*counts, x.new_empty((), dtype=torch.float32))


# opaque under compile: the launcher launches through Triton's JIT, not `_launch`
_cast_stats = register_op(
    "cast_stats", (), _cast_stats_ref, _cast_stats_cuda, _cast_stats_fake, traceable=False,
    eager_cuda=cast_stats_triton, pack=lambda out: reference.CastStats(*out),
)  # fmt: skip


def cast_stats(
    x: torch.Tensor, scale: torch.Tensor | float, fp8_dtype: torch.dtype
) -> reference.CastStats:
    """``reference.cast_stats``: Triton for CUDA tensors, the reference elsewhere."""
    return _cast_stats(x, as_scale(scale, x), fp8_dtype)
