"""FP8 flash attention, forward kernel and the tile helpers the backward shares (``attention.py``
holds the launchers and the overview; ``attention_bwd.py`` the backward kernels)."""

from __future__ import annotations

from dist_quant.kernels._fp8_round import _INTERPRETED, fp8_encode, reciprocal
from dist_quant.kernels._triton import tl, triton


@triton.jit
def _pow2(e):
    """``2**e`` for integer-valued fp32 ``e <= 0`` (-inf -> 0), exact (no ``exp2`` rounding)."""
    e = tl.maximum(e, -127.0)
    return ((e.to(tl.int32) + 127) << 23).to(tl.float32, bitcast=True)


@triton.jit
def _to_fp8(x, MAX_BITS: tl.constexpr, MANT: tl.constexpr, MIN_EXP: tl.constexpr, HW: tl.constexpr):
    """fp32 -> FP8 tensor (E4M3 when MANT is 3, else E5M2) with the contract's saturating RNE.

    On sm89+ the conversion alone is the contract (``cvt.rn.satfinite``: round to nearest even,
    subnormals included, beyond +-max to +-max, NaN stays NaN), without ``fp8_encode``'s clamp and
    packing, a dozen integer ops per element in loops bound by elementwise work. Elsewhere (the
    interpreter) ``fp8_encode`` rounds on the bits."""
    if HW and not _INTERPRETED:
        if MANT == 3:
            return x.to(tl.float8e4nv, fp_downcast_rounding="rtne")
        else:
            return x.to(tl.float8e5, fp_downcast_rounding="rtne")
    else:
        code = fp8_encode(x, MAX_BITS, MANT, MIN_EXP, HW).to(tl.uint8)
        if MANT == 3:
            return code.to(tl.float8e4nv, bitcast=True)
        else:
            return code.to(tl.float8e5, bitcast=True)


@triton.jit
def _visible(
    rows, cols, b, SQ, SK, mask_ptr, m_sb, m_sq, m_sk, CAUSAL: tl.constexpr, HAS_MASK: tl.constexpr
):
    """Bool tile (rows x cols broadcast): in range, not after the query (causal), not padded."""
    ok = (rows < SQ) & (cols < SK)
    if CAUSAL:
        ok = ok & (cols <= rows)
    if HAS_MASK:
        padded = tl.load(mask_ptr + b * m_sb + rows * m_sq + cols * m_sk, mask=ok, other=1)
        ok = ok & (padded == 0)
    return ok


@triton.jit
def _transpose_kernel(
    x_ptr, out_ptr, H, S, S_PADDED, x_sb, x_sh, x_ss, D: tl.constexpr, BR: tl.constexpr
):  # fmt: skip
    """(b, H, S, D) ``x`` of strides (x_sb, x_sh, x_ss, 1) -> (b * H, D, S_PADDED) contiguous: rows
    BR-block ``program_id(1)`` of head ``program_id(0)``, the bytes moved as they are (the K-major
    copies of FP8 operands; torch's strided copy of one byte per element runs at a fraction of the
    bandwidth)."""
    bh, rows = tl.program_id(0), tl.program_id(1) * BR + tl.arange(0, BR)
    b, h = (bh // H).to(tl.int64), (bh % H).to(tl.int64)
    dd = tl.arange(0, D)
    x_ptrs = x_ptr + b * x_sb + h * x_sh + rows[:, None].to(tl.int64) * x_ss + dd[None, :]
    x = tl.load(x_ptrs, mask=rows[:, None] < S)
    t_ptrs = out_ptr + bh.to(tl.int64) * D * S_PADDED + dd[:, None] * S_PADDED + rows[None, :]
    tl.store(t_ptrs, tl.trans(x), mask=rows[None, :] < S)


@triton.jit
def store_rows(
    ptr, x, b, h, rows, SQ, s_b, s_h, s_s, D: tl.constexpr
):  # fmt: skip
    """Rows ``rows`` (< SQ) of head ``h`` of batch ``b`` of a (b, h, s, D) tensor of strides
    (s_b, s_h, s_s, 1) in ``ptr``'s element type."""
    base = ptr + b.to(tl.int64) * s_b + h.to(tl.int64) * s_h
    ptrs = base + rows[:, None].to(tl.int64) * s_s + tl.arange(0, D)[None, :]
    tl.store(ptrs, x.to(ptr.dtype.element_ty), mask=rows[:, None] < SQ)


@triton.jit
def key_tiles(pid_m, SK, BM: tl.constexpr, BN: tl.constexpr, CAUSAL: tl.constexpr,
              HAS_MASK: tl.constexpr):  # fmt: skip
    """(full, hi) for query block ``pid_m``: key tiles [0, full) need no mask (in range and, causal,
    not after any query of the block); [full, hi) are masked; keys from hi on are never seen."""
    hi = SK
    full = 0
    if CAUSAL:
        hi = tl.minimum(SK, (pid_m + 1) * BM)
        if not HAS_MASK:
            full = (tl.minimum(pid_m * BM + 1, SK) // BN) * BN
    elif not HAS_MASK:
        full = (SK // BN) * BN
    return full, hi


@triton.jit
def _fwd_tile(
    q, k_desc, vt_desc, b, hk, bkv, start_n, rows, SQ, SK, qk_scale, s_scale,
    m_i, l_i, p_max, acc,
    mask_ptr, m_sb, m_sq, m_sk,
    D: tl.constexpr, BN: tl.constexpr, CAUSAL: tl.constexpr, HAS_MASK: tl.constexpr,
    MASKED: tl.constexpr,
    S_MAX_BITS: tl.constexpr, S_MANT: tl.constexpr, S_MIN_EXP: tl.constexpr, HW: tl.constexpr,
):  # fmt: skip
    """One key tile of the forward: the online softmax update and P V (MASKED: the tile may hold
    keys out of range, after the query or padded; keys past the end load as zeros)."""
    cols = start_n + tl.arange(0, BN)
    k = k_desc.load([b, hk, start_n, 0]).reshape(BN, D)
    vt = vt_desc.load([bkv, 0, start_n]).reshape(D, BN)
    s = tl.dot(q, tl.trans(k)) * qk_scale  # (BM, BN) fp32, base-2 logits
    if MASKED:
        ok = _visible(
            rows[:, None], cols[None, :], b, SQ, SK, mask_ptr, m_sb, m_sq, m_sk, CAUSAL, HAS_MASK
        )
        s = tl.where(ok, s, float("-inf"))
    s_max = tl.max(s, 1)
    m_new = tl.maximum(m_i, tl.math.ceil(s_max))
    m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = _pow2(m_i - m_use)  # exact: both integers
    p = tl.math.exp2(s - m_use[:, None])  # <= 1; masked -> 0
    l_i = l_i * alpha + tl.sum(p, 1)
    # the tile's max P is exp2 of its max logit (exp2 is monotonic): no second pass over the tile
    p_max = tl.maximum(p_max * alpha, tl.math.exp2(s_max - m_use))
    p8 = _to_fp8(p * s_scale, S_MAX_BITS, S_MANT, S_MIN_EXP, HW)
    acc = acc * alpha[:, None] + tl.dot(p8, tl.trans(vt))
    return m_new, l_i, p_max, acc


@triton.jit
def _fwd_kernel(
    q_desc, k_desc, vt_desc, out_ptr, o_sb, o_sh, o_ss, lse_ptr,
    q_si_ptr, k_si_ptr, v_si_ptr, s_scale_ptr, s_amax_ptr,
    mask_ptr, m_sb, m_sq, m_sk,
    H, SQ, SK, c_log2,
    GROUP: tl.constexpr, D: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
    CAUSAL: tl.constexpr, HAS_MASK: tl.constexpr,
    S_MAX_BITS: tl.constexpr, S_MANT: tl.constexpr, S_MIN_EXP: tl.constexpr, HW: tl.constexpr,
):  # fmt: skip
    # heads along the grid's fast axis, so every head's block pid_m runs before any block
    # pid_m - 1; under causal masking the last query blocks see the most keys: they go first
    bh, pid_m = tl.program_id(0), tl.program_id(1)
    if CAUSAL:
        pid_m = tl.num_programs(1) - 1 - pid_m
    b, h = bh // H, bh % H
    hk = h // GROUP
    bkv = b * (H // GROUP) + hk
    rows = pid_m * BM + tl.arange(0, BM)
    q = q_desc.load([b, h, pid_m * BM, 0]).reshape(BM, D)  # rows past the end load as zeros
    qk_scale = tl.load(q_si_ptr) * tl.load(k_si_ptr) * c_log2
    s_scale = tl.load(s_scale_ptr)

    m_i = tl.full([BM], float("-inf"), tl.float32)  # integer running max (base-2 logits)
    l_i = tl.zeros([BM], tl.float32)
    p_max = tl.zeros([BM], tl.float32)
    acc = tl.zeros([BM, D], tl.float32)
    full, hi = key_tiles(pid_m, SK, BM, BN, CAUSAL, HAS_MASK)
    for part in tl.static_range(2):  # unrolled: each tile's MASKED is a compile-time constant
        for start_n in range((0, full)[part], (full, hi)[part], BN):
            m_i, l_i, p_max, acc = _fwd_tile(
                q, k_desc, vt_desc, b, hk, bkv, start_n, rows, SQ, SK, qk_scale, s_scale,
                m_i, l_i, p_max, acc, mask_ptr, m_sb, m_sq, m_sk,
                D, BN, CAUSAL, HAS_MASK, part == 1, S_MAX_BITS, S_MANT, S_MIN_EXP, HW,
            )  # fmt: skip

    m_use = tl.where(m_i == float("-inf"), 0.0, m_i)
    s_inv = reciprocal(s_scale)
    has = l_i > 0.0
    out = acc * (s_inv * tl.load(v_si_ptr)) / tl.where(has, l_i, 1.0)[:, None]
    store_rows(out_ptr, out, b, h, rows, SQ, o_sb, o_sh, o_ss, D)
    lse = tl.where(has, m_use + tl.math.log2(tl.where(has, l_i, 1.0)), float("inf"))
    tl.store(lse_ptr + bh.to(tl.int64) * SQ + rows, lse, mask=rows < SQ)
    p_max = tl.where(rows < SQ, p_max, 0.0)
    tl.atomic_max(s_amax_ptr, tl.max(p_max.to(tl.int32, bitcast=True), 0), sem="relaxed")
