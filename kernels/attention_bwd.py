"""FP8 flash attention, backward kernels: delta; dV and dK per key block, one launch each (looping
over the query heads of its KV group); dQ per query block (``attention.py`` holds the launchers and
the overview)."""

from __future__ import annotations

from dist_quant.kernels._fp8_round import reciprocal
from dist_quant.kernels._triton import tl, triton
from dist_quant.kernels.attention_fwd import _to_fp8, _visible, key_tiles, store_rows


@triton.jit
def _bwd_delta_kernel(
    do_ptr, out_ptr, delta_ptr, do_si_ptr, H, SQ, do_sb, do_sh, do_ss, o_sb, o_sh, o_ss,
    D: tl.constexpr, BR: tl.constexpr,
):  # fmt: skip
    """delta_i = dO_i . out_i for rows BR-block ``program_id(1)`` of (batch, head)
    ``program_id(0)``, into (b, h, sq) ``delta``: the softmax backward's row term, read once by
    both backward kernels (dO and out in their own (b, h, s, d) strides)."""
    bh, rows = tl.program_id(0), tl.program_id(1) * BR + tl.arange(0, BR)
    b, h = (bh // H).to(tl.int64), (bh % H).to(tl.int64)
    r, dd, ok = rows[:, None].to(tl.int64), tl.arange(0, D)[None, :], rows[:, None] < SQ
    do = tl.load(do_ptr + b * do_sb + h * do_sh + r * do_ss + dd, mask=ok, other=0.0)
    out = tl.load(out_ptr + b * o_sb + h * o_sh + r * o_ss + dd, mask=ok, other=0.0)
    row_sum = tl.sum(do.to(tl.float32) * out.to(tl.float32), 1)
    tl.store(delta_ptr + bh.to(tl.int64) * SQ + rows, row_sum * tl.load(do_si_ptr), mask=rows < SQ)


@triton.jit
def _dkdv_tile(
    k, v, dk, dv, q_desc, qt_desc, do_desc, dot_desc, b, h, bh, lse_base, delta_base, start_m, cols,
    SQ, SK, qk_scale, dp_deq, s_scale, dp_scale,
    mask_ptr, m_sb, m_sq, m_sk,
    D: tl.constexpr, BM: tl.constexpr, CAUSAL: tl.constexpr, HAS_MASK: tl.constexpr,
    MASKED: tl.constexpr,
    S_MAX_BITS: tl.constexpr, S_MANT: tl.constexpr, S_MIN_EXP: tl.constexpr,
    DP_MAX_BITS: tl.constexpr, DP_MANT: tl.constexpr, DP_MIN_EXP: tl.constexpr, HW: tl.constexpr,
    DV: tl.constexpr,
):  # fmt: skip
    """One query tile of a dV (DV) or dK program (transposed: keys along dim 0). Keys out of range need
    no mask here (they only reach dK/dV rows that are never stored); MASKED: queries out of range,
    before the key (causal) or padding. Queries past the end load as zeros."""
    rows = start_m + tl.arange(0, BM)
    q = q_desc.load([b, h, start_m, 0]).reshape(BM, D)
    if MASKED:
        lse = tl.load(lse_base + rows, mask=rows < SQ, other=0.0)
    else:
        lse = tl.load(lse_base + rows)
    s_t = tl.dot(k, tl.trans(q)) * qk_scale  # (BN, BM): S^T
    p_t = tl.math.exp2(s_t - lse[None, :])
    if MASKED:
        ok = _visible(
            rows[None, :], cols[:, None], b, SQ, SK, mask_ptr, m_sb, m_sq, m_sk, CAUSAL, HAS_MASK
        )
        p_t = tl.where(ok, p_t, 0.0)
    if DV:
        do_t = dot_desc.load([bh, 0, start_m]).reshape(D, BM)
        p8 = _to_fp8(p_t * s_scale, S_MAX_BITS, S_MANT, S_MIN_EXP, HW)
        dv += tl.dot(p8, tl.trans(do_t))
    else:
        do = do_desc.load([b, h, start_m, 0]).reshape(BM, D)
        q_t = qt_desc.load([bh, 0, start_m]).reshape(D, BM)
        if MASKED:
            delta = tl.load(delta_base + rows, mask=rows < SQ, other=0.0)
        else:
            delta = tl.load(delta_base + rows)
        dp_t = tl.dot(v, tl.trans(do)) * dp_deq  # (BN, BM): dP^T
        ds = p_t * (dp_t - delta[None, :])
        ds8 = _to_fp8(ds * dp_scale, DP_MAX_BITS, DP_MANT, DP_MIN_EXP, HW)
        dk += tl.dot(ds8, tl.trans(q_t))
    return dk, dv


@triton.jit
def _bwd_dkdv_kernel(
    q_desc, qt_desc, k_desc, v_desc, do_desc, dot_desc, lse_ptr, delta_ptr, dk_ptr, dv_ptr,
    g_sb, g_sh, g_ss,
    q_si_ptr, k_si_ptr, v_si_ptr, do_si_ptr, s_scale_ptr, dp_scale_ptr,
    mask_ptr, m_sb, m_sq, m_sk,
    H, SQ, SK, c_log2, sm_scale,
    GROUP: tl.constexpr, D: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
    CAUSAL: tl.constexpr, HAS_MASK: tl.constexpr,
    S_MAX_BITS: tl.constexpr, S_MANT: tl.constexpr, S_MIN_EXP: tl.constexpr,
    DP_MAX_BITS: tl.constexpr, DP_MANT: tl.constexpr, DP_MIN_EXP: tl.constexpr, HW: tl.constexpr,
    DV: tl.constexpr,
):  # fmt: skip
    # One gradient per launch (DV: dV = P^T dO, else dK = dS^T Q): a program holding both
    # accumulators spills registers at every tile size (ptxas, sm90), and recomputing S^T in the
    # second launch costs less than the spills (BENCHMARKS.md).
    # KV heads along the grid's fast axis; under causal masking the first key blocks see the most
    # queries, and run first
    bkv, pid_n = tl.program_id(0), tl.program_id(1)
    hkv = H // GROUP
    b, hk = bkv // hkv, bkv % hkv
    cols = pid_n * BN + tl.arange(0, BN)  # this program's keys
    k = k_desc.load([b, hk, pid_n * BN, 0]).reshape(BN, D)  # keys past the end load as zeros
    v = v_desc.load([b, hk, pid_n * BN, 0]).reshape(BN, D)
    q_si = tl.load(q_si_ptr)
    qk_scale = q_si * tl.load(k_si_ptr) * c_log2
    dp_deq = tl.load(v_si_ptr) * tl.load(do_si_ptr)
    s_scale = tl.load(s_scale_ptr)
    dp_scale = tl.load(dp_scale_ptr)
    dk = tl.zeros([BN, D], tl.float32)
    dv = tl.zeros([BN, D], tl.float32)
    # query tiles: [lo, a) masked (the diagonal), [a, z) unmasked, [z, SQ) masked (the ragged end)
    lo = 0
    z = (SQ // BM) * BM
    a = 0
    if CAUSAL:
        lo = (pid_n * BN // BM) * BM
        a = tl.minimum(((pid_n * BN + BN - 1 + BM - 1) // BM) * BM, SQ)
    if HAS_MASK:
        a = SQ
    z = tl.maximum(z, a)
    for g in range(GROUP):
        h = hk * GROUP + g
        bh = b * H + h
        lse_base = lse_ptr + bh.to(tl.int64) * SQ
        delta_base = delta_ptr + bh.to(tl.int64) * SQ
        # the three ranges unrolled, so each tile's MASKED is a compile-time constant
        for part in tl.static_range(3):
            for start_m in range((lo, a, z)[part], (a, z, SQ)[part], BM):
                dk, dv = _dkdv_tile(
                    k, v, dk, dv, q_desc, qt_desc, do_desc, dot_desc, b, h, bh, lse_base,
                    delta_base, start_m, cols, SQ, SK, qk_scale, dp_deq, s_scale, dp_scale, mask_ptr,
                    m_sb, m_sq, m_sk, D, BM, CAUSAL, HAS_MASK, part != 1, S_MAX_BITS, S_MANT,
                    S_MIN_EXP, DP_MAX_BITS, DP_MANT, DP_MIN_EXP, HW, DV,
                )  # fmt: skip
    if DV:
        dv = dv * (reciprocal(s_scale) * tl.load(do_si_ptr))
        store_rows(dv_ptr, dv, b, hk, cols, SK, g_sb, g_sh, g_ss, D)
    else:
        dk = dk * (reciprocal(dp_scale) * q_si * sm_scale)
        store_rows(dk_ptr, dk, b, hk, cols, SK, g_sb, g_sh, g_ss, D)


@triton.jit
def _dq_tile(
    q, do, lse, delta, dq, ds_max, k_desc, kt_desc, v_desc, b, hk, bkv, start_n, rows, SQ, SK,
    qk_scale, dp_deq, dp_scale,
    mask_ptr, m_sb, m_sq, m_sk,
    D: tl.constexpr, BN: tl.constexpr, CAUSAL: tl.constexpr, HAS_MASK: tl.constexpr,
    MASKED: tl.constexpr,
    DP_MAX_BITS: tl.constexpr, DP_MANT: tl.constexpr, DP_MIN_EXP: tl.constexpr, HW: tl.constexpr,
):  # fmt: skip
    """One key tile of a dQ program (MASKED as in `_fwd_tile`; keys past the end load as zeros)."""
    cols = start_n + tl.arange(0, BN)
    k = k_desc.load([b, hk, start_n, 0]).reshape(BN, D)
    v = v_desc.load([b, hk, start_n, 0]).reshape(BN, D)
    k_t = kt_desc.load([bkv, 0, start_n]).reshape(D, BN)
    p = tl.math.exp2(tl.dot(q, tl.trans(k)) * qk_scale - lse[:, None])
    if MASKED:
        ok = _visible(
            rows[:, None], cols[None, :], b, SQ, SK, mask_ptr, m_sb, m_sq, m_sk, CAUSAL, HAS_MASK
        )
        p = tl.where(ok, p, 0.0)
    dp = tl.dot(do, tl.trans(v)) * dp_deq
    ds = p * (dp - delta[:, None])
    ds_max = tl.maximum(ds_max, tl.max(ds.to(tl.int32, bitcast=True) & 0x7FFFFFFF, 1))
    ds8 = _to_fp8(ds * dp_scale, DP_MAX_BITS, DP_MANT, DP_MIN_EXP, HW)
    dq += tl.dot(ds8, tl.trans(k_t))
    return dq, ds_max


@triton.jit
def _bwd_dq_kernel(
    q_desc, k_desc, kt_desc, v_desc, do_desc, lse_ptr, delta_ptr, dq_ptr, g_sb, g_sh, g_ss,
    q_si_ptr, k_si_ptr, v_si_ptr, do_si_ptr, dp_scale_ptr, dp_amax_ptr,
    mask_ptr, m_sb, m_sq, m_sk,
    H, SQ, SK, c_log2, sm_scale,
    GROUP: tl.constexpr, D: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
    CAUSAL: tl.constexpr, HAS_MASK: tl.constexpr,
    DP_MAX_BITS: tl.constexpr, DP_MANT: tl.constexpr, DP_MIN_EXP: tl.constexpr, HW: tl.constexpr,
):  # fmt: skip
    # heads along the grid's fast axis, so every head's block pid_m runs before any block
    # pid_m - 1; under causal masking the last query blocks see the most keys: they go first
    bh, pid_m = tl.program_id(0), tl.program_id(1)
    if CAUSAL:
        pid_m = tl.num_programs(1) - 1 - pid_m
    b = bh // H
    h = bh % H
    hk = h // GROUP
    bkv = b * (H // GROUP) + hk
    rows = pid_m * BM + tl.arange(0, BM)
    q = q_desc.load([b, h, pid_m * BM, 0]).reshape(BM, D)  # rows past the end load as zeros
    do = do_desc.load([b, h, pid_m * BM, 0]).reshape(BM, D)
    # rows out of range read lse = delta = 0: their P is finite and their dS 0 (dO is 0)
    lse = tl.load(lse_ptr + bh.to(tl.int64) * SQ + rows, mask=rows < SQ, other=0.0)
    delta = tl.load(delta_ptr + bh.to(tl.int64) * SQ + rows, mask=rows < SQ, other=0.0)
    k_si = tl.load(k_si_ptr)
    qk_scale = tl.load(q_si_ptr) * k_si * c_log2
    dp_deq = tl.load(v_si_ptr) * tl.load(do_si_ptr)
    dp_scale = tl.load(dp_scale_ptr)
    dq = tl.zeros([BM, D], tl.float32)
    ds_max = tl.zeros([BM], tl.int32)  # bits of max |dS| (non-negative fp32 bits order as values)
    full, hi = key_tiles(pid_m, SK, BM, BN, CAUSAL, HAS_MASK)
    for part in tl.static_range(2):  # unrolled: each tile's MASKED is a compile-time constant
        for start_n in range((0, full)[part], (full, hi)[part], BN):
            dq, ds_max = _dq_tile(
                q, do, lse, delta, dq, ds_max, k_desc, kt_desc, v_desc, b, hk, bkv, start_n, rows,
                SQ, SK, qk_scale, dp_deq, dp_scale, mask_ptr, m_sb, m_sq, m_sk, D, BN, CAUSAL,
                HAS_MASK, part == 1, DP_MAX_BITS, DP_MANT, DP_MIN_EXP, HW,
            )  # fmt: skip
    dq = dq * (reciprocal(dp_scale) * k_si * sm_scale)
    store_rows(dq_ptr, dq, b, h, rows, SQ, g_sb, g_sh, g_ss, D)
    tl.atomic_max(dp_amax_ptr, tl.max(ds_max, 0), sem="relaxed")
