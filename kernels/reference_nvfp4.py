"""The bit-level definition of NVFP4 (4-bit E2M1 data, E4M3 block scales, fp32 global scale).

Every NVFP4 kernel (``kernels/nvfp4.py``) must match these functions bit for bit. All math is fp32
with IEEE rounding and follows Transformer Engine's contract (DESIGN.md, "Numerics contract"):

- Global scales: ``S_enc = fp32(2688 / amax)`` (2688 = 448 * 6), capped at FLT_MAX, and 1 when
  ``amax`` or ``S_enc`` is 0 (amax 0 or inf). A NaN amax gives FLT_MAX: Transformer Engine caps
  with ``fminf``, which returns the non-NaN operand. ``S_dec = 1 / S_enc``.
- Blocks of 16 consecutive elements of a row (``block_2d``: 16x16 tiles): the decode scale
  ``s_b = e4m3(clamp(block_amax * (S_enc * fp32(1/6)), -448, 448))``, round to nearest even, NaN
  stays NaN; the encode factor ``enc = fmin(1 / (float(s_b) * S_dec), FLT_MAX)`` (``fminf`` again:
  a NaN or zero ``s_b`` gives FLT_MAX).
- Elements: ``v = x * enc``, ``E2M1_RNE(clamp(v, -6, 6))`` with ties to the even code
  (0.25->0, 0.75->1, 1.25->1, 1.75->2, 2.5->2, 3.5->4, 5->4); the sign bit is kept, so a small
  negative value encodes as -0 (code 8); NaN encodes as +6 (code 7), as the hardware's saturating
  conversion to a format without NaN does; such a block's scale is NaN, so it decodes to NaN.
- Packing: two codes per byte, the even element in the low nibble.
- Dequantize: ``(e2m1 * float(s_b)) * S_dec`` in fp32.
- Columnwise (the wgrad operand) is the rowwise cast of the transpose: callers pass ``x.t()``.

Stochastic rounding replaces round-to-nearest by rounding ``|v|`` up to the next E2M1 value with
probability ``(|v| - lo) / (hi - lo)`` (``lo <= |v| < hi`` its grid neighbours; values on the grid
and the clamped ones stay put). The random numbers come from Philox4x32-10 (Salmon et al., the
generator of ``tl.randint``/cuRAND) keyed by ``seed`` with counter ``(i mod 2**32, i >> 32,
offset mod 2**32, offset >> 32)`` for the element's row-major index ``i`` in the (M, K) matrix
being quantized: element ``i`` rounds up iff ``float(r >> 8) < frac * 2**24`` where ``r`` is the
first output word and ``frac = (|v| - lo) / (hi - lo)`` (exact in fp32). The same
``(seed, offset)`` gives the same bits on every device, so a recompute is exact.

The random Hadamard transform (RHT) acts on groups of 16 consecutive elements of the last dim:
``y = 0.25 * H16 @ (s * x)`` with ``H16`` the Sylvester Hadamard matrix (``H[i, j] =
(-1)**popcount(i & j)``), ``s`` the sign vector and 0.25 = 1/sqrt(16), which makes it orthonormal.
Its fp32 order is fixed so every implementation rounds alike: the signs multiply first (exact), then
four butterfly stages ``(a, b) -> (a + b, a - b)`` over index pairs differing in bit 0, then bit 1,
bit 2, bit 3 (pairs ``(i, i + h)`` for ``h = 1, 2, 4, 8``), then the product by 0.25.

The GEMM of two NVFP4 operands (``nvfp4_gemm``) is emulated: each 16-block term
``dot16(a, b) * (float(s_a) * float(s_b))`` is exact in fp32 (products of E2M1 values are
multiples of 1/4 below 36, a 16-term dot stays below 2**10; E4M3 products have 8 significant
bits), so the only roundings are the fp32 accumulation over the K/16 blocks and the final product by
``alpha = fp32(amax_a * amax_b) / 7225344`` (7225344 = 6**2 * 448**2). The reference accumulates
in ascending block order; another accumulation order (a tensor-core GEMM) is the stated tolerance.
When only one operand went through the RHT (``rht`` on one ``NVFP4Operand``), the other one's E2M1
values go through the same transform before the block products: ``a' . (b M) = a . b`` for the
orthogonal per-block ``M``, so the product is the one of the dequantized operands with the transform
undone, and it stays exact: transformed E2M1 values are multiples of 1/8 below 24 (exact in fp32),
a 16-term dot of them with E2M1 values a multiple of 1/16 below 2304 (16 significant bits), times an
E4M3 scale product (8 bits) still exact in fp32, so the same ordered accumulation defines it on every
device.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
from torch import Tensor

NVFP4_BLOCK = 16
FLT_MAX: float = torch.finfo(torch.float32).max
E2M1_MAX = 6.0
E4M3_MAX = 448.0
S_ENC_NUMERATOR = E4M3_MAX * E2M1_MAX  # 2688, exact in fp32
ALPHA_DIVISOR = E2M1_MAX**2 * E4M3_MAX**2  # 7225344 = 2**14 * 441, exact in fp32
NVFP4_RHT_SIGNS: tuple[int, ...] = (1, 1, 1, -1, 1, -1, -1, -1, -1, -1, -1, 1, -1, 1, -1, -1)
E2M1_VALUES: tuple[float, ...] = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
# |v| rounds past code k-1 when it is above (below ``_TIE_UP``: at or above) the k-th threshold:
# each threshold is the midpoint of codes k-1 and k, and a tie goes to the even code.
_THRESHOLDS = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)
_TIE_UP = (False, True, False, True, False, True, False)  # codes 1, 3, 5 are odd
_E2M1_NAN_CODE = 7  # +6: the saturating conversion's answer for NaN

PHILOX_ROUND = (0xD2511F53, 0xCD9E8D57)
PHILOX_KEY_STEP = (0x9E3779B9, 0xBB67AE85)
_U32 = 0xFFFFFFFF
_SR_BITS = 24  # random bits compared with the rounding fraction


class NVFP4Cast(NamedTuple):
    """One direction of an NVFP4 tensor, as ``quantize_nvfp4`` returns it."""

    data: Tensor  # uint8 (M, K // 2): E2M1 codes, even element in the low nibble
    scales: Tensor  # float8_e4m3fn (M, K // 16): decode scale of each element's block
    s_dec: Tensor  # fp32 0-dim: the global decode scale 1 / S_enc


class NVFP4Operand(NamedTuple):
    """A GEMM operand: K runs along the last dim of ``data`` and ``scales`` (a weight ``(N, K)``
    as stored; an activation ``(M, K)``). ``amax`` is the one its cast used: the GEMM's alpha is
    computed from the two amaxes, as Transformer Engine passes it to cuBLAS, not from ``S_dec``."""

    data: Tensor  # uint8 (rows, K // 2)
    scales: Tensor  # float8_e4m3fn (rows, K // 16)
    amax: Tensor  # fp32, one element
    rht: bool = False  # the values went through the random Hadamard transform along K


def nvfp4_global_scales(amax: Tensor | float) -> tuple[Tensor, Tensor]:
    """``(S_enc, S_dec)``, fp32 0-dim tensors, from a global amax (see the module docstring)."""
    a = _scalar_fp32(amax, "nvfp4_global_scales: amax")
    s_enc = torch.full_like(a, S_ENC_NUMERATOR) / a
    s_enc = torch.fmin(s_enc, torch.full_like(s_enc, FLT_MAX))  # fminf: NaN -> FLT_MAX
    s_enc = torch.where((a == 0) | (s_enc == 0), torch.ones_like(s_enc), s_enc)
    return s_enc, torch.ones_like(s_enc) / s_enc


def quantize_nvfp4(
    x_hp: Tensor,
    amax: Tensor | float,
    *,
    block_2d: bool = False,
    stochastic: bool = False,
    seed: int = 0,
    offset: int = 0,
) -> NVFP4Cast:
    """Rowwise NVFP4 cast of a 2-D ``(M, K)`` tensor, ``K % 16 == 0``, with the global ``amax``.

    ``block_2d``: one scale per 16x16 tile (the last row tile is short when ``M % 16 != 0``),
    stored expanded, one per row and 16 columns like the 1x16 layout, so every consumer reads one
    layout; the columnwise cast of a 2D-quantized tensor is then exactly its transpose.
    ``stochastic``: stochastic rounding of the elements with the counter-based generator keyed by
    ``seed`` and ``offset`` (non-negative, below 2**63).
    """
    m, k = _check_matrix(x_hp, "quantize_nvfp4")
    _check_rng(seed, offset, "quantize_nvfp4")
    s_enc, s_dec = nvfp4_global_scales(_scalar_fp32(amax, "quantize_nvfp4: amax", x_hp.device))
    blocks = x_hp.detach().float().reshape(m, k // NVFP4_BLOCK, NVFP4_BLOCK)
    block_amax = blocks.abs().amax(-1)  # (M, K/16); NaN propagates
    if block_2d:
        block_amax = _tile_rows_max(block_amax)
    sb = block_amax * (s_enc * torch.full_like(s_enc, 1.0 / 6.0))
    scales = sb.clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    enc = torch.ones_like(sb) / (scales.float() * s_dec)
    enc = torch.fmin(enc, torch.full_like(enc, FLT_MAX))  # fminf: NaN and inf -> FLT_MAX
    v = (blocks * enc.unsqueeze(-1)).reshape(m, k)
    if stochastic:
        codes = e2m1_stochastic_codes(
            v, philox_uniform24(m * k, seed, offset, x_hp.device).reshape(m, k)
        )
    else:
        codes = e2m1_codes(v)
    return NVFP4Cast(pack_e2m1(codes), scales.contiguous(), s_dec)


def random_hadamard_transform(
    x: Tensor, sign_vector: tuple[int, ...] | Tensor = NVFP4_RHT_SIGNS
) -> Tensor:
    """``0.25 * H16 @ (s * g)`` for every group ``g`` of 16 consecutive elements of the last dim,
    fp32, in ``x``'s shape, with the order of operations of the module docstring."""
    if x.dim() == 0 or x.shape[-1] % NVFP4_BLOCK:
        raise ValueError(
            f"random_hadamard_transform: the last dim must be a multiple of 16, got shape "
            f"{tuple(x.shape)}"
        )
    signs = torch.as_tensor(sign_vector, dtype=torch.float32, device=x.device)
    if signs.shape != (NVFP4_BLOCK,) or not bool(((signs == 1) | (signs == -1)).all()):
        raise ValueError(
            f"random_hadamard_transform: sign_vector must hold 16 values of +1/-1, got {signs}"
        )
    y = x.detach().float().reshape(-1, NVFP4_BLOCK) * signs
    for h in (1, 2, 4, 8):
        pairs = y.reshape(-1, NVFP4_BLOCK // (2 * h), 2, h)
        a, b = pairs[:, :, 0, :], pairs[:, :, 1, :]
        y = torch.stack((a + b, a - b), dim=2).reshape(-1, NVFP4_BLOCK)
    return (y * 0.25).reshape(x.shape)


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
) -> NVFP4Cast:
    """What the Triton cast computes in one pass: ``quantize_nvfp4`` of ``x`` (``columnwise``: of
    ``x.t()``), after the RHT when ``rht``. ``amax`` is the global amax of the tensor quantized
    (after the transform, when there is one)."""
    if x.dim() != 2:
        raise ValueError(f"nvfp4_cast: x must be 2-D (M, K), got shape {tuple(x.shape)}")
    src = x.t() if columnwise else x
    if rht:
        src = random_hadamard_transform(src)
    return quantize_nvfp4(
        src, amax, block_2d=block_2d, stochastic=stochastic, seed=seed, offset=offset
    )


def dequantize_nvfp4(
    q_packed: Tensor, block_scales: Tensor, s_dec: Tensor | float, *, dtype: torch.dtype
) -> Tensor:
    """``(e2m1 * float(s_b)) * S_dec`` in fp32, cast to ``dtype``: a ``(M, K)`` tensor."""
    m, k = _check_packed(q_packed, block_scales, "dequantize_nvfp4")
    s = _scalar_fp32(s_dec, "dequantize_nvfp4: s_dec", q_packed.device)
    values = e2m1_decode(q_packed).reshape(m, k // NVFP4_BLOCK, NVFP4_BLOCK)
    out = (values * block_scales.float().unsqueeze(-1)) * s
    return out.reshape(m, k).to(dtype)


def nvfp4_gemm(a: NVFP4Operand | tuple, b: NVFP4Operand | tuple, *, ordered: bool = True) -> Tensor:
    """``a @ b.T`` of two NVFP4 operands sharing K, fp32 ``(M, N)``, per the module docstring:
    exact 16-block terms accumulated in fp32, times alpha.

    ``ordered`` (the definition): the terms are added in ascending block order, one small matmul
    per block. ``ordered=False``: one fp32 matmul of the block-scaled values ``e2m1 * float(s_b)``
    (exact in fp32 and in TF32: at most 6 significant bits), the same exact products accumulated in
    the matmul's own order: the stated tolerance, at the cost of one GEMM (what an emulation on a
    GPU without FP4 tensor cores runs).

    Operands whose ``rht`` differ: the untransformed one's E2M1 values are transformed first
    (exactly; the module docstring), so either order still adds exact terms (with ``ordered=False``
    a transformed value times its scale has up to 12 significant bits: exact in fp32, not TF32)."""
    a, b = NVFP4Operand(*a), NVFP4Operand(*b)
    m, k = _check_packed(a.data, a.scales, "nvfp4_gemm: a")
    n, kb = _check_packed(b.data, b.scales, "nvfp4_gemm: b")
    if k != kb:
        raise ValueError(f"nvfp4_gemm: a has K = {k} and b has K = {kb}")
    dev = a.data.device
    amax_a = _scalar_fp32(a.amax, "nvfp4_gemm: a.amax").to(dev)
    product = amax_a * _scalar_fp32(b.amax, "nvfp4_gemm: b.amax").to(dev)
    alpha = product / torch.full_like(product, ALPHA_DIVISOR)  # a tensor: IEEE division on CUDA
    a_val, b_val = e2m1_decode(a.data), e2m1_decode(b.data)  # (M, K), (N, K)
    if a.rht and not b.rht:
        b_val = random_hadamard_transform(b_val)
    elif b.rht and not a.rht:
        a_val = random_hadamard_transform(a_val)
    a_val = a_val.reshape(m, k // NVFP4_BLOCK, NVFP4_BLOCK)
    b_val = b_val.reshape(n, k // NVFP4_BLOCK, NVFP4_BLOCK)
    sa, sb = a.scales.float(), b.scales.float()
    if not ordered:
        a_scaled = (a_val * sa.unsqueeze(-1)).reshape(m, k)
        b_scaled = (b_val * sb.unsqueeze(-1)).reshape(n, k)
        return (a_scaled @ b_scaled.t()) * alpha
    acc = torch.zeros((m, n), dtype=torch.float32, device=dev)
    for blk in range(k // NVFP4_BLOCK):
        dot = a_val[:, blk, :] @ b_val[:, blk, :].t()  # exact in any summation order
        acc = acc + dot * (sa[:, blk, None] * sb[None, :, blk])
    return acc * alpha


# ---- E2M1 codes ---------------------------------------------------------------------------------
def e2m1_codes(v: Tensor) -> Tensor:
    """fp32 ``v`` -> E2M1 codes (uint8 in [0, 15]): saturate to +-6, round half to even, sign kept,
    NaN -> 7."""
    mag = v.abs()
    code = torch.zeros(v.shape, dtype=torch.uint8, device=v.device)
    for t, up in zip(_THRESHOLDS, _TIE_UP):
        code += ((mag >= t) if up else (mag > t)).to(torch.uint8)
    return _with_sign(code, v)


def e2m1_stochastic_codes(v: Tensor, u24: Tensor) -> Tensor:
    """fp32 ``v`` -> E2M1 codes rounding ``|v|`` up with probability ``frac`` (module docstring),
    ``u24`` the element's 24 random bits (int64); saturation, sign and NaN as ``e2m1_codes``."""
    mag = v.abs()
    floor_code = torch.zeros(v.shape, dtype=torch.uint8, device=v.device)
    for value in E2M1_VALUES[1:]:
        floor_code += (mag >= value).to(torch.uint8)
    grid = torch.tensor(E2M1_VALUES, dtype=torch.float32, device=v.device)
    lo = grid[floor_code.long()]
    inv_step = torch.where(floor_code < 4, 2.0, torch.where(floor_code < 6, 1.0, 0.5))
    frac = (mag - lo) * inv_step  # exact: |v| and lo are within a factor of two (or lo is 0)
    up = (u24.float() < frac * float(2**_SR_BITS)) & (floor_code < 7)
    code = floor_code + up.to(torch.uint8)
    code = torch.where(mag.isnan(), torch.full_like(code, _E2M1_NAN_CODE), code)
    return _with_sign(code, v)


def _with_sign(code: Tensor, v: Tensor) -> Tensor:
    code = torch.where(v.isnan(), torch.full_like(code, _E2M1_NAN_CODE), code)
    negative = (v.view(torch.int32) < 0) & ~v.isnan()  # the sign bit, -0.0 included
    return code | (negative.to(torch.uint8) << 3)


def pack_e2m1(codes: Tensor) -> Tensor:
    """``(M, K)`` codes -> ``(M, K // 2)`` bytes, the even element in the low nibble."""
    return (codes[:, 0::2] | (codes[:, 1::2] << 4)).contiguous()


def unpack_e2m1(q_packed: Tensor) -> Tensor:
    """``(M, K // 2)`` bytes -> ``(M, K)`` codes (uint8)."""
    return torch.stack((q_packed & 0xF, q_packed >> 4), dim=-1).reshape(q_packed.shape[0], -1)


def e2m1_decode(q_packed: Tensor) -> Tensor:
    """``(M, K // 2)`` bytes -> the ``(M, K)`` fp32 E2M1 values (exact)."""
    table = torch.tensor(E2M1_VALUES + tuple(-v for v in E2M1_VALUES), device=q_packed.device)
    return table[unpack_e2m1(q_packed).long()]


# ---- Philox4x32-10 ------------------------------------------------------------------------------
def philox4x32(
    c0: Tensor, c1: Tensor, c2: Tensor, c3: Tensor, k0: int, k1: int, rounds: int = 10
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Philox4x32 on int64 tensors holding uint32 values (exact: products are split in 16-bit
    halves so no int64 overflows); returns the four output words."""
    for _ in range(rounds):
        hi0, lo0 = _mulhilo(PHILOX_ROUND[0], c0)
        hi1, lo1 = _mulhilo(PHILOX_ROUND[1], c2)
        c0, c1, c2, c3 = hi1 ^ c1 ^ k0, lo1, hi0 ^ c3 ^ k1, lo0
        k0, k1 = (k0 + PHILOX_KEY_STEP[0]) & _U32, (k1 + PHILOX_KEY_STEP[1]) & _U32
    return c0, c1, c2, c3


def philox_uniform24(n: int, seed: int, offset: int, device: torch.device | str = "cpu") -> Tensor:
    """The 24 random bits (int64) of elements ``0 .. n-1`` for ``(seed, offset)``: the top 24
    bits of Philox4x32-10's first word at counter ``(i lo, i hi, offset lo, offset hi)``."""
    i = torch.arange(n, dtype=torch.int64, device=device)
    c2 = torch.full_like(i, offset & _U32)
    c3 = torch.full_like(i, offset >> 32)
    r0 = philox4x32(i & _U32, i >> 32, c2, c3, seed & _U32, seed >> 32)[0]
    return r0 >> (32 - _SR_BITS)


def _mulhilo(multiplier: int, c: Tensor) -> tuple[Tensor, Tensor]:
    lo_part = (c & 0xFFFF) * multiplier  # < 2**48
    hi_part = (c >> 16) * multiplier  # < 2**48
    hi = (hi_part + (lo_part >> 16)) >> 16
    lo = (lo_part + ((hi_part & 0xFFFF) << 16)) & _U32
    return hi, lo


# ---- checks and helpers -------------------------------------------------------------------------
def _check_matrix(x: Tensor, what: str) -> tuple[int, int]:
    if x.dim() != 2 or x.shape[1] % NVFP4_BLOCK:
        raise ValueError(
            f"{what}: needs a 2-D (M, K) tensor with K a multiple of 16, got shape {tuple(x.shape)}"
        )
    if not x.dtype.is_floating_point or x.dtype.itemsize == 1:
        raise ValueError(f"{what}: x must be fp32/bf16/fp16, got {x.dtype}")
    return x.shape[0], x.shape[1]


def _check_rng(seed: int, offset: int, what: str) -> None:
    for name, value in (("seed", seed), ("offset", offset)):
        if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value < 2**63:
            raise ValueError(f"{what}: {name} must be an int in [0, 2**63), got {value!r}")


def _check_packed(q: Tensor, scales: Tensor, what: str) -> tuple[int, int]:
    if q.dim() != 2 or q.dtype != torch.uint8:
        raise ValueError(
            f"{what}: data must be 2-D uint8 (M, K // 2), got {q.dtype} {tuple(q.shape)}"
        )
    m, k = q.shape[0], 2 * q.shape[1]
    expected = (m, k // NVFP4_BLOCK)
    if k % NVFP4_BLOCK or scales.dtype != torch.float8_e4m3fn or tuple(scales.shape) != expected:
        raise ValueError(
            f"{what}: data {tuple(q.shape)} needs K = {k} a multiple of 16 and float8_e4m3fn "
            f"scales of shape {expected}, got {scales.dtype} {tuple(scales.shape)}"
        )
    return m, k


def _tile_rows_max(block_amax: Tensor) -> Tensor:
    """``(M, K/16)`` block amaxes -> the max over each 16-row tile, repeated on its rows."""
    m = block_amax.shape[0]
    tiles = math.ceil(m / NVFP4_BLOCK)
    padded = torch.nn.functional.pad(block_amax, (0, 0, 0, tiles * NVFP4_BLOCK - m))
    tile_max = padded.reshape(tiles, NVFP4_BLOCK, -1).amax(1)  # NaN propagates
    return tile_max.repeat_interleave(NVFP4_BLOCK, dim=0)[:m]


def _scalar_fp32(value: Tensor | float, what: str, device: torch.device | None = None) -> Tensor:
    t = torch.as_tensor(value, dtype=torch.float32, device=device)
    if t.numel() != 1:
        raise ValueError(f"{what} must hold exactly one value, got shape {tuple(t.shape)}")
    return t.reshape(())
