"""NVFP4 cast: the Triton kernels, their launcher and the op ``nvfp4_cast`` (``_op.py``).

Matches ``reference_nvfp4.nvfp4_cast`` bit for bit: one pass over ``x`` writes the packed E2M1
codes ``(R, K // 2)``, the E4M3 block scales ``(R, K // 16)`` and ``S_dec``, where ``(R, K)`` is
``x``'s shape, or ``x.t()``'s for ``columnwise``; the columnwise casts read ``x`` in place (no
transposed copy). Two kernels:

- ``_nvfp4_cast_kernel``: rowwise, and every RHT cast. Each program's tile is ``[BM, NB, 16]`` in
  output coordinates (rows, 16-blocks, elements); a columnwise RHT cast passes ``x``'s strides
  swapped. The 16-element axis is explicit, so block amaxes are one reduction, 16x16 tiles
  (``BLOCK_2D``, ``BM`` a multiple of 16 with tiles aligned to it) one more, and the RHT a fixed
  sequence of butterflies on it.
- ``_nvfp4_columnwise_kernel``: the columnwise cast without RHT, on ``[NB, 16, BN]`` tiles in
  ``x``'s orientation (the MXFP8 columnwise kernel's shape). The first kernel with swapped strides
  computed it too, but compiled by Triton 3.6 for the H200 it wrote wrong block scales (every one
  the same byte, data independent) under three of four launch configurations tried, and a variant
  with the nibble-pair axis explicit (``[BM, NB, 8, 2]``) under one of four, while the interpreter
  ran both exactly; this layout gave the reference's bytes under every configuration swept
  (BENCHMARKS.md, "NVFP4 cast and emulated GEMM").

Exactness on GPU and in the interpreter alike: every operation is an IEEE fp32 add, multiply or
``div_rn`` of the reference's, in its order, or integer arithmetic on bits. The E4M3 block scale
goes through ``fp8_encode`` (DESIGN.md: the interpreter's float8 conversion is wrong, so it rounds
on the bits there; compiled for sm89+ the hardware conversion rounds). E2M1 codes come from
comparisons with the exact rounding thresholds, and the magnitude they compare is taken from the
fp32 bits of ``x * enc``, so the compiler cannot fuse that product into a later subtraction
(stochastic rounding's ``|v| - lo``) as an FMA, which would skip the product's rounding.

Stochastic rounding draws Philox4x32-10 per element (``reference_nvfp4``'s counter layout), written
out here with ``tl.umulhi`` rather than through ``tl.randint``, so the bits do not depend on how a
Triton release spells its generator. The seed and offset words are not specialised on (a new step's
offset must not compile a new kernel).
"""

from __future__ import annotations

import torch
from dist_quant.kernels import reference_nvfp4 as ref
from dist_quant.kernels._fp8_round import (
    abs_bits,
    amax_from_bits,
    cdiv,
    fp8_decode,
    fp8_encode,
    hw_rounding,
    is_gpu,
    next_pow2,
    reciprocal,
    row_block_tile,
)
from dist_quant.kernels._launch import FastLaunch
from dist_quant.kernels._op import register_op
from dist_quant.kernels._triton import tl, triton
from torch import Tensor

_INPUT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_SIGN_MASK = sum(1 << i for i, s in enumerate(ref.NVFP4_RHT_SIGNS) if s < 0)

# GPU launch configurations (bench/bench_nvfp4.py --sweep; H200, 8192x8192 bf16, BENCHMARKS.md):
# rowwise 122.5 us (32x4: 127.0, 8x16: 123.7); columnwise 207.3 us (NB 4 x BN 32: 202.5, within
# noise; 1x128: 221.2); columnwise RHT + SR 420.2 us (128x1: 414.8, 32x4: 417.2).
GPU_ROWWISE = {"BM": 16, "NB": 8, "num_warps": 4}
GPU_COLUMNWISE = {"NB": 2, "BN": 64, "num_warps": 4}  # _nvfp4_columnwise_kernel
GPU_COLUMNWISE_RHT = {"BM": 64, "NB": 2, "num_warps": 4}


@triton.jit
def _butterfly(y, G: tl.constexpr, H: tl.constexpr):
    """One RHT stage on ``[G, 16]``: ``(y[i], y[i + H]) -> (y[i] + y[i + H], y[i] - y[i + H])`` for
    every ``i`` with bit ``H`` clear (the pair axis moved last so ``tl.split`` can take it)."""
    t = tl.permute(tl.reshape(y, [G, 8 // H, 2, H]), (0, 1, 3, 2))
    a, b = tl.split(t)
    t = tl.permute(tl.join(a + b, a - b), (0, 1, 3, 2))
    return tl.reshape(t, [G, 16])


@triton.jit
def _rht16(x, BM: tl.constexpr, NB: tl.constexpr, SIGN_MASK: tl.constexpr):
    """``0.25 * H16 @ (s * x)`` on the last axis of ``[BM, NB, 16]``, in the reference's order."""
    lane = tl.arange(0, 16)
    signs = tl.where(((SIGN_MASK >> lane) & 1) == 1, -1.0, 1.0)
    y = tl.reshape(x * signs[None, None, :], [BM * NB, 16])
    y = _butterfly(y, BM * NB, 1)
    y = _butterfly(y, BM * NB, 2)
    y = _butterfly(y, BM * NB, 4)
    y = _butterfly(y, BM * NB, 8)
    return tl.reshape(y, [BM, NB, 16]) * 0.25


@triton.jit
def _philox_word0(c0, c1, c2, c3, k0, k1):
    """First output word of Philox4x32-10 on uint32 tensors (``reference_nvfp4.philox4x32``)."""
    for _ in tl.static_range(10):
        hi0 = tl.umulhi(c0, 0xD2511F53)
        lo0 = c0 * 0xD2511F53
        hi1 = tl.umulhi(c2, 0xCD9E8D57)
        lo1 = c2 * 0xCD9E8D57
        c0, c1, c2, c3 = hi1 ^ c1 ^ k0, lo1, hi0 ^ c3 ^ k1, lo0
        k0 = k0 + 0x9E3779B9
        k1 = k1 + 0xBB67AE85
    return c0


@triton.jit
def _e2m1_codes(v, u24, STOCHASTIC: tl.constexpr):
    """E2M1 codes (int32) of fp32 ``v``: ``reference_nvfp4.e2m1_codes`` or, with ``STOCHASTIC``,
    ``e2m1_stochastic_codes`` with the element's random bits ``u24``."""
    bits = v.to(tl.int32, bitcast=True)
    mag_bits = bits & 0x7FFFFFFF
    mag = mag_bits.to(tl.float32, bitcast=True)
    if STOCHASTIC:
        fc = (
            (mag >= 0.5).to(tl.int32) + (mag >= 1.0).to(tl.int32) + (mag >= 1.5).to(tl.int32)
            + (mag >= 2.0).to(tl.int32) + (mag >= 3.0).to(tl.int32) + (mag >= 4.0).to(tl.int32)
            + (mag >= 6.0).to(tl.int32)
        )  # fmt: skip
        fcf = fc.to(tl.float32)
        lo = tl.where(fc < 4, fcf * 0.5, tl.where(fc < 6, fcf - 2.0, tl.where(fc == 6, 4.0, 6.0)))
        inv_step = tl.where(fc < 4, 2.0, tl.where(fc < 6, 1.0, 0.5))
        frac = (mag - lo) * inv_step
        up = (u24.to(tl.float32) < frac * 16777216.0) & (fc < 7)
        code = fc + up.to(tl.int32)
    else:
        code = (
            (mag > 0.25).to(tl.int32) + (mag >= 0.75).to(tl.int32) + (mag > 1.25).to(tl.int32)
            + (mag >= 1.75).to(tl.int32) + (mag > 2.5).to(tl.int32) + (mag >= 3.5).to(tl.int32)
            + (mag > 5.0).to(tl.int32)
        )  # fmt: skip
    is_nan = mag_bits > 0x7F800000
    code = code | ((bits >> 28) & 8)  # the sign bit
    return tl.where(is_nan, 7, code)


@triton.jit
def _global_scales(amax_ptr, s_dec_ptr, pid):
    """``(S_enc, S_dec)`` from the global amax (``reference_nvfp4.nvfp4_global_scales``); program 0
    also stores ``S_dec``."""
    a = tl.load(amax_ptr)
    s_enc = tl.math.div_rn(tl.zeros_like(a) + 2688.0, a)
    s_enc = tl.where(s_enc <= 3.4028234663852886e38, s_enc, 3.4028234663852886e38)  # fminf
    s_enc = tl.where((a == 0.0) | (s_enc == 0.0), 1.0, s_enc)
    s_dec = reciprocal(s_enc)
    if pid == 0:
        tl.store(s_dec_ptr, s_dec)
    return s_enc, s_dec


@triton.jit
def _block_scale(m, s_enc, s_dec, HW_ROUND: tl.constexpr):
    """Block amax bits -> (the E4M3 byte of ``s_b``, the encode factor ``enc``)."""
    sb = amax_from_bits(m) * (s_enc * 0.16666666666666666)
    sb_code = fp8_encode(sb, 0x43E00000, 3, -6, HW_ROUND)  # 448 = 0x43E00000
    enc = reciprocal(fp8_decode(sb_code, 3, -6, False) * s_dec)
    enc = tl.where(enc <= 3.4028234663852886e38, enc, 3.4028234663852886e38)  # fminf
    return sb_code, enc


@triton.jit
def _random_bits(i, seed_lo, seed_hi, offset_lo, offset_hi):
    """The 24 random bits (int32) of the elements of row-major index ``i`` (int64)."""
    k0 = seed_lo.to(tl.uint32, bitcast=True)
    k1 = seed_hi.to(tl.uint32, bitcast=True)
    c2 = tl.zeros_like(i).to(tl.uint32) + offset_lo.to(tl.uint32, bitcast=True)
    c3 = tl.zeros_like(i).to(tl.uint32) + offset_hi.to(tl.uint32, bitcast=True)
    word = _philox_word0(i.to(tl.uint32), (i >> 32).to(tl.uint32), c2, c3, k0, k1)
    return (word >> 8).to(tl.int32)


@triton.jit(do_not_specialize=["seed_lo", "seed_hi", "offset_lo", "offset_hi"])
def _nvfp4_cast_kernel(
    x_ptr,
    q_ptr,  # uint8 (R, K // 2)
    s_ptr,  # uint8 (R, K // 16): E4M3 bytes
    amax_ptr,  # fp32 (1,): the global amax
    s_dec_ptr,  # fp32 (1,): written by program 0
    rows,  # R
    cols,  # K
    stride_r,  # x's stride along the output's rows (x's column stride when columnwise)
    stride_k,  # x's stride along the output's columns
    seed_lo,
    seed_hi,
    offset_lo,
    offset_hi,
    BM: tl.constexpr,
    NB: tl.constexpr,
    BLOCK_2D: tl.constexpr,
    RHT: tl.constexpr,
    STOCHASTIC: tl.constexpr,
    SIGN_MASK: tl.constexpr,
    HW_ROUND: tl.constexpr,
):
    pid = tl.program_id(0)
    n_blocks = cols // 16
    r, b, r3, c3, mask = row_block_tile(pid, rows, cols, n_blocks, BM, NB, 16)
    x = tl.load(x_ptr + r3 * stride_r + c3 * stride_k, mask=mask, other=0.0).to(tl.float32)
    if RHT:
        x = _rht16(x, BM, NB, SIGN_MASK)

    s_enc, s_dec = _global_scales(amax_ptr, s_dec_ptr, pid)
    m = tl.max(abs_bits(x), axis=2)  # [BM, NB]
    if BLOCK_2D:
        m = tl.max(tl.reshape(m, [BM // 16, 16, NB]), axis=1)
        m = tl.reshape(tl.broadcast_to(m[:, None, :], [BM // 16, 16, NB]), [BM, NB])
    sb_code, enc = _block_scale(m, s_enc, s_dec, HW_ROUND)
    v = x * enc[:, :, None]
    if STOCHASTIC:
        u24 = _random_bits(r3 * cols + c3, seed_lo, seed_hi, offset_lo, offset_hi)
        code = _e2m1_codes(v, u24, True)
    else:
        code = _e2m1_codes(v, 0, False)

    lo, hi = tl.split(tl.reshape(code, [BM, NB, 8, 2]))
    byte = (lo | (hi << 4)).to(tl.uint8)
    p = (b[:, None] * 8 + tl.arange(0, 8)[None, :]).to(tl.int64)  # [NB, 8]
    p_mask = (r[:, None, None] < rows) & (p[None, :, :] < cols // 2)
    tl.store(q_ptr + r[:, None, None] * (cols // 2) + p[None, :, :], byte, mask=p_mask)
    s_mask = (r < rows)[:, None] & (b < n_blocks)[None, :]
    tl.store(s_ptr + r[:, None] * n_blocks + b[None, :], sb_code.to(tl.uint8), mask=s_mask)


@triton.jit(do_not_specialize=["seed_lo", "seed_hi", "offset_lo", "offset_hi"])
def _nvfp4_columnwise_kernel(
    x_ptr,
    q_ptr,  # uint8 (R, K // 2) with (R, K) = x.t()'s shape
    s_ptr,  # uint8 (R, K // 16)
    amax_ptr,
    s_dec_ptr,
    rows,  # R = x.shape[1]
    cols,  # K = x.shape[0]
    stride_xr,
    stride_xc,
    seed_lo,
    seed_hi,
    offset_lo,
    offset_hi,
    NB: tl.constexpr,
    BN: tl.constexpr,
    BLOCK_2D: tl.constexpr,
    STOCHASTIC: tl.constexpr,
    HW_ROUND: tl.constexpr,
):
    """The columnwise cast without RHT, on ``[NB, 16, BN]`` tiles in ``x``'s own orientation (16-blocks
    down x's rows, BN of x's columns), the tile shape of the MXFP8 columnwise kernel."""
    pid = tl.program_id(0)
    n_blocks = cols // 16
    n_o_tiles = tl.cdiv(rows, BN)
    b = (pid // n_o_tiles) * NB + tl.arange(0, NB)
    k = (b[:, None] * 16 + tl.arange(0, 16)[None, :]).to(tl.int64)  # [NB, 16]: x's rows
    o = ((pid % n_o_tiles) * BN + tl.arange(0, BN)).to(tl.int64)  # x's columns: output rows
    k3 = k[:, :, None]
    o3 = o[None, None, :]
    mask = (k3 < cols) & (o3 < rows)
    x = tl.load(x_ptr + k3 * stride_xr + o3 * stride_xc, mask=mask, other=0.0).to(tl.float32)
    s_enc, s_dec = _global_scales(amax_ptr, s_dec_ptr, pid)
    m = tl.max(abs_bits(x), axis=1)  # [NB, BN]
    if BLOCK_2D:
        m = tl.max(tl.reshape(m, [NB, BN // 16, 16]), axis=2)
        m = tl.reshape(tl.broadcast_to(m[:, :, None], [NB, BN // 16, 16]), [NB, BN])
    sb_code, enc = _block_scale(m, s_enc, s_dec, HW_ROUND)
    v = x * enc[:, None, :]
    if STOCHASTIC:
        u24 = _random_bits(o3 * cols + k3, seed_lo, seed_hi, offset_lo, offset_hi)
        code = _e2m1_codes(v, u24, True)
    else:
        code = _e2m1_codes(v, 0, False)
    # pairs along the block axis: even element in the low nibble (the sum adds disjoint bits)
    shift = tl.arange(0, 2) * 4
    byte = tl.sum(tl.reshape(code, [NB, 8, 2, BN]) << shift[None, None, :, None], axis=2)
    p = (b[:, None] * 8 + tl.arange(0, 8)[None, :]).to(tl.int64)  # [NB, 8]
    p_mask = (p[:, :, None] < cols // 2) & (o3 < rows)
    tl.store(q_ptr + o3 * (cols // 2) + p[:, :, None], byte.to(tl.uint8), mask=p_mask)
    s_mask = (b < n_blocks)[:, None] & (o < rows)[None, :]
    tl.store(s_ptr + o[None, :] * n_blocks + b[:, None], sb_code.to(tl.uint8), mask=s_mask)


_launch_cast = FastLaunch(_nvfp4_cast_kernel)
_launch_columnwise = FastLaunch(_nvfp4_columnwise_kernel)


def _i32_words(value: int) -> tuple[int, int]:
    """The low and high 32-bit words of ``value`` as signed int32 bit patterns (one kernel type)."""
    lo, hi = value & 0xFFFFFFFF, value >> 32
    return lo - (lo >> 31 << 32), hi - (hi >> 31 << 32)


def nvfp4_cast_triton(
    x: Tensor,
    amax: Tensor,
    *,
    columnwise: bool = False,
    block_2d: bool = False,
    rht: bool = False,
    stochastic: bool = False,
    seed: int = 0,
    offset: int = 0,
) -> ref.NVFP4Cast:
    """``reference_nvfp4.nvfp4_cast``: ``(data, scales, s_dec)``, all contiguous."""
    what = "kernels.nvfp4.nvfp4_cast"
    if x.dim() != 2 or x.dtype not in _INPUT_DTYPES:
        raise ValueError(
            f"{what}: x must be a 2-D fp32/bf16/fp16 tensor, got {x.dtype} {tuple(x.shape)}"
        )
    rows, cols = (x.shape[1], x.shape[0]) if columnwise else tuple(x.shape)
    if cols % ref.NVFP4_BLOCK:
        side = "x.shape[0] (columnwise)" if columnwise else "x.shape[1]"
        raise ValueError(f"{what}: {side} must be a multiple of 16, got shape {tuple(x.shape)}")
    if amax.numel() != 1 or amax.dtype != torch.float32 or amax.device != x.device:
        raise ValueError(
            f"{what}: amax must be one fp32 value on {x.device}, got {amax.dtype} "
            f"{tuple(amax.shape)} on {amax.device}"
        )
    ref._check_rng(seed, offset, what)
    dev = x.device
    data = torch.empty((rows, cols // 2), dtype=torch.uint8, device=dev)
    scales = torch.empty((rows, cols // 16), dtype=torch.float8_e4m3fn, device=dev)
    if data.numel() == 0:
        return ref.NVFP4Cast(data, scales, ref.nvfp4_global_scales(amax)[1])
    s_dec = torch.empty((1,), dtype=torch.float32, device=dev)
    gpu = is_gpu(x)
    args = (x, data, scales.view(torch.uint8), amax.reshape(1), s_dec, rows, cols)
    rng = (*_i32_words(seed), *_i32_words(offset))
    consts = {
        "BLOCK_2D": bool(block_2d),
        "STOCHASTIC": bool(stochastic),
        "HW_ROUND": hw_rounding(x),
    }
    n_blocks = cols // 16
    if columnwise and not rht:
        if gpu:
            cfg = GPU_COLUMNWISE
        else:  # interpreter: ~4K-element tiles
            nb = min(next_pow2(n_blocks), 4)
            cfg = {"NB": nb, "BN": max(16, min(next_pow2(rows), 256 // nb)), "num_warps": 1}
        grid = (cdiv(n_blocks, cfg["NB"]) * cdiv(rows, cfg["BN"]),)
        _launch_columnwise.launch(
            grid, (*args, *x.stride(), *rng), {**consts, **cfg}, interpreted=not gpu
        )
        return ref.NVFP4Cast(data, scales, s_dec.reshape(()))
    # rowwise, and the RHT (either way): tiles in output coordinates, x's strides swapped
    # for the columnwise one
    strides = (x.stride(1), x.stride(0)) if columnwise else x.stride()
    if gpu:
        cfg = GPU_COLUMNWISE_RHT if columnwise else GPU_ROWWISE
    else:
        nb = min(next_pow2(n_blocks), 16)
        cfg = {"BM": max(16, min(next_pow2(rows), 256 // nb)), "NB": nb, "num_warps": 1}
    grid = (cdiv(rows, cfg["BM"]) * cdiv(n_blocks, cfg["NB"]),)
    consts = {**consts, "RHT": bool(rht), "SIGN_MASK": _SIGN_MASK}
    _launch_cast.launch(grid, (*args, *strides, *rng), {**consts, **cfg}, interpreted=not gpu)
    return ref.NVFP4Cast(data, scales, s_dec.reshape(()))


# ---- the op: reference call, fake, registration ------------------------------------------------
def _nvfp4_cast_ref(
    x: Tensor, amax: Tensor, columnwise: bool, block_2d: bool, rht: bool, stochastic: bool,
    seed: int, offset: int,
) -> tuple[Tensor, Tensor, Tensor]:  # fmt: skip
    out = ref.nvfp4_cast(
        x, amax, columnwise=columnwise, block_2d=block_2d, rht=rht, stochastic=stochastic,
        seed=seed, offset=offset,
    )  # fmt: skip
    return out.data.contiguous(), out.scales.contiguous(), out.s_dec.clone()


def _nvfp4_cast_cuda(
    x: Tensor, amax: Tensor, columnwise: bool, block_2d: bool, rht: bool, stochastic: bool,
    seed: int, offset: int,
) -> tuple[Tensor, Tensor, Tensor]:  # fmt: skip
    return tuple(nvfp4_cast_triton(
        x, amax, columnwise=columnwise, block_2d=block_2d, rht=rht, stochastic=stochastic,
        seed=seed, offset=offset,
    ))  # fmt: skip


def _nvfp4_cast_fake(
    x: Tensor, amax: Tensor, columnwise: bool, block_2d: bool, rht: bool, stochastic: bool,
    seed: int, offset: int,
) -> tuple[Tensor, Tensor, Tensor]:  # fmt: skip
    rows, cols = (x.shape[1], x.shape[0]) if columnwise else (x.shape[0], x.shape[1])
    return (
        x.new_empty((rows, cols // 2), dtype=torch.uint8),
        x.new_empty((rows, cols // 16), dtype=torch.float8_e4m3fn),
        x.new_empty((), dtype=torch.float32),
    )


nvfp4_cast_op = register_op("nvfp4_cast", (), _nvfp4_cast_ref, _nvfp4_cast_cuda, _nvfp4_cast_fake)


def nvfp4_cast(
    x: Tensor,
    amax: Tensor | float,
    *,
    columnwise: bool = False,
    block_2d: bool = False,
    rht: bool = False,
    stochastic: bool = False,
    seed: int = 0,
    offset: int = 0,
) -> ref.NVFP4Cast:
    """``reference_nvfp4.nvfp4_cast``: one Triton pass on CUDA (the columnwise cast reads ``x`` in
    place), the reference elsewhere. ``amax`` may stay on the device: nothing is synchronised
    with the host."""
    amax_t = torch.as_tensor(amax, dtype=torch.float32, device=x.device).reshape(1)
    return ref.NVFP4Cast(
        *nvfp4_cast_op(
            x, amax_t.detach(), bool(columnwise), bool(block_2d), bool(rht), bool(stochastic),
            int(seed), int(offset),
        )
    )  # fmt: skip
