"""FP8 attention: the float64 definition the Triton flash-attention kernels follow (and the CPU path).

Unlike the casts (``reference.py``, bit for bit), attention's contract is a tolerance: the FP8
operands are exact casts, but a flash kernel sums QK^T, P V and the gradients' GEMMs tile by tile
inside the tensor cores in an unspecified order, so its output and gradients are compared with this
float64 computation on the same FP8 operands (``docs/fp8_attention.md`` states the tolerance and
why). Every FP8 rounding inside attention happens here exactly where the kernel does it, with the
same formula, so the tolerance covers accumulation order, fp32 ``exp2`` and the rare FP8 rounding
tie those flip, never a different rounding scheme.

Shapes: ``q`` (b, h, sq, d), ``k`` and ``v`` (b, hkv, sk, d) with ``hkv`` dividing ``h`` (grouped-query
attention: query head ``i`` reads KV head ``i // (h // hkv)``), all FP8 with a 1-element fp32
``scale_inv`` each (the dequantized value is ``q * q_scale_inv``). ``pad_mask``: None or bool,
broadcastable to (b, 1, sq, sk), True where a query may not see a key; ``causal`` masks keys after
the query (top-left aligned).

Forward (per query row; exponentials in base 2, ``c = q_si * k_si / sqrt(d) * log2(e)``):

    t_j = c * (q . k_j)                      (-inf where masked)
    M   = ceil(max_j t_j)                    (an integer; 0 for a fully masked row)
    p_j = exp2(t_j - M)                      in (0, 1]: the `s` slot quantizes this
    l   = sum_j p_j                          (unquantized)
    o   = s_si * v_si * sum_j cast_s(p_j * s_scale) v_j / l          (0 for a fully masked row)
    lse = M + log2(l)                        (+inf for a fully masked row)

Why ``M`` is an integer: a flash kernel sees the row max one tile at a time and rescales what it
has summed whenever the max grows. With an integer ``M`` every rescale is an exact power of two,
and FP8 rounding commutes with powers of two (outside the subnormal range), so quantizing
``exp2(t - M_running)`` tile by tile gives the same codes, times a power of two, as quantizing
``exp2(t - M)`` with the final max: the kernel's P rounding is this one, independent of tile order.
``p <= 1`` always, so a scale of at most ``fp8_max`` never saturates.

Backward (``do`` FP8 with its ``scale_inv``, ``out`` the forward's output):

    P_ij  = exp2(t_ij - lse_i)               (the softmax, normalised)
    dV    = sum_i cast_s(P_ij * s_scale) * s_si * dO_i
    dP_ij = dO_i . v_j                       (dequantized operands)
    D_i   = dO_i . out_i
    dS_ij = P_ij * (dP_ij - D_i)             the `dp` slot quantizes this
    dQ_i  = sum_j cast_dp(dS_ij * dp_scale) * dp_si * k_j / sqrt(d)
    dK_j  = sum_i cast_dp(dS_ij * dp_scale) * dp_si * q_i / sqrt(d)   (summed over a KV group)

``cast_x(y)`` is the contract's saturating cast (``y`` rounded to fp32, clamped, RNE to FP8):
torch's own cast. The forward also returns ``max_j p_j`` over the tensor, the backward ``max |dS|``:
the amaxes a delayed-scaling `s` / `dp` slot records.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
from dist_quant.kernels.reference import fp8_max
from torch import Tensor

LOG2E = 1.4426950408889634


class AttentionForward(NamedTuple):
    out: Tensor  # (b, h, sq, d) float64
    lse: Tensor  # (b, h, sq) float64, base 2
    s_amax: Tensor  # 0-dim float64: max of the unnormalised p


class AttentionBackward(NamedTuple):
    dq: Tensor  # (b, h, sq, d) float64
    dk: Tensor  # (b, hkv, sk, d)
    dv: Tensor  # (b, hkv, sk, d)
    dp_amax: Tensor  # 0-dim float64: max |dS|


def _cast(y: Tensor, scale: Tensor, fp8_dtype: torch.dtype) -> Tensor:
    """The contract's saturating cast of ``y * scale`` (in fp32), returned as exact float64 codes."""
    limit = fp8_max(fp8_dtype)
    return (y.float() * scale.float()).clamp(-limit, limit).to(fp8_dtype).double()


def _fp32_inverse(scale: Tensor) -> Tensor:
    """``1 / scale`` in fp32, as every kernel computes a scale inverse."""
    return (1.0 / scale.float()).double()


def _dequantized(x: Tensor, scale_inv: Tensor, heads: int) -> Tensor:
    """(b, hx, s, d) FP8 -> float64 values, KV heads repeated to ``heads`` query heads."""
    x = x.double() * scale_inv.double()
    group = heads // x.shape[1]
    return x if group == 1 else x.repeat_interleave(group, dim=1)


def masked_positions(
    sq: int, sk: int, pad_mask: Tensor | None, causal: bool, device: torch.device
) -> Tensor | None:
    """Bool (.., sq, sk), True where a query may not see a key; None when nothing is masked."""
    masked = None if pad_mask is None else pad_mask.to(device=device, dtype=torch.bool)
    if causal:
        upper = torch.ones(sq, sk, dtype=torch.bool, device=device).triu(1)
        masked = upper if masked is None else masked | upper
    return masked


def _logits(q, k, q_si, k_si, pad_mask, causal) -> Tensor:
    """t = c * q k^T in float64 (base-2 logits), -inf where masked: (b, h, sq, sk)."""
    h, sq, d = q.shape[1], q.shape[2], q.shape[3]
    qd, kd = _dequantized(q, q_si, h), _dequantized(k, k_si, h)
    t = (qd @ kd.transpose(-2, -1)) * (LOG2E / math.sqrt(d))
    masked = masked_positions(sq, k.shape[2], pad_mask, causal, q.device)
    return t if masked is None else t.masked_fill(masked, float("-inf"))


def _group_sum(x: Tensor, kv_heads: int) -> Tensor:
    """(b, h, s, d) -> (b, kv_heads, s, d): each KV head's gradient summed over its query group."""
    b, h, s, d = x.shape
    return x.reshape(b, kv_heads, h // kv_heads, s, d).sum(2)


def attention_fwd(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    q_scale_inv: Tensor,
    k_scale_inv: Tensor,
    v_scale_inv: Tensor,
    s_scale: Tensor,
    s_dtype: torch.dtype,
    pad_mask: Tensor | None,
    causal: bool,
) -> AttentionForward:
    """The forward above, in float64."""
    h = q.shape[1]
    t = _logits(q, k, q_scale_inv, k_scale_inv, pad_mask, causal)
    row_max = t.amax(-1, keepdim=True)
    m = torch.where(torch.isinf(row_max), torch.zeros_like(row_max), torch.ceil(row_max))
    p = torch.exp2(t - m)  # (b, h, sq, sk); masked -> 0
    row_sum = p.sum(-1, keepdim=True)
    pq = _cast(p, s_scale, s_dtype)
    vd = _dequantized(v, v_scale_inv, h)
    num = (pq @ vd) * _fp32_inverse(s_scale)
    out = torch.where(row_sum > 0, num / row_sum.clamp_min(torch.finfo(torch.float64).tiny), 0.0)
    lse = torch.where(row_sum > 0, m + torch.log2(row_sum), float("inf")).squeeze(-1)
    s_amax = p.amax() if p.numel() else p.new_zeros(())
    return AttentionForward(out, lse, s_amax)


def attention_bwd(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    out: Tensor,
    do: Tensor,
    q_scale_inv: Tensor,
    k_scale_inv: Tensor,
    v_scale_inv: Tensor,
    do_scale_inv: Tensor,
    lse: Tensor,
    s_scale: Tensor,
    s_dtype: torch.dtype,
    dp_scale: Tensor,
    dp_dtype: torch.dtype,
    pad_mask: Tensor | None,
    causal: bool,
) -> AttentionBackward:
    """The backward above, in float64 (``lse`` as the forward returned it)."""
    h, hkv, d = q.shape[1], k.shape[1], q.shape[3]
    t = _logits(q, k, q_scale_inv, k_scale_inv, pad_mask, causal)
    p = torch.exp2(t - lse.double().unsqueeze(-1))  # (b, h, sq, sk); masked rows/keys -> 0
    dod = do.double() * do_scale_inv.double()  # (b, h, sq, d)
    pq = _cast(p, s_scale, s_dtype) * _fp32_inverse(s_scale)
    dv = pq.transpose(-2, -1) @ dod
    dp = dod @ _dequantized(v, v_scale_inv, h).transpose(-2, -1)
    delta = (dod * out.double()).sum(-1, keepdim=True)
    ds = p * (dp - delta)
    dsq = _cast(ds, dp_scale, dp_dtype) * (_fp32_inverse(dp_scale) / math.sqrt(d))
    dq = dsq @ _dequantized(k, k_scale_inv, h)
    dk = dsq.transpose(-2, -1) @ _dequantized(q, q_scale_inv, h)
    dp_amax = ds.abs().amax() if ds.numel() else ds.new_zeros(())
    return AttentionBackward(dq, _group_sum(dk, hkv), _group_sum(dv, hkv), dp_amax)
