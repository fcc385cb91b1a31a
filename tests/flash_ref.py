"""Float64 re-derivation of FP8 attention on per-tensor FP8 slots (the flash path, the definition in
docs/fp8_attention.md), shared by the module tests; written from the formulas, not from
`kernels/reference_attention.py`.

`flash_attention(q, k, v, masked, slots)` takes q, k, v already rounded through the `qkv` slot
(the caller's round trip also rounds their gradients through `dqkv`), and returns the output before
the `o` slot (the caller rounds it, and the incoming gradient through `do`). Inside, `slots` rounds
what the kernels round:
- `slots.p(x)`: the forward's unnormalised P = exp2(t - M), M = ceil(row max of the base-2
  logits), and `slots.p_backward(x)` the backward's normalised P, both with the `s` scale;
- `slots.ds(x, bound)`: dS with the `dp` scale, `bound` = 2 max_i |dO_i| max_j |v_j| for current
  scaling (the amax is not known before dS is).
"""

from __future__ import annotations

import math
from typing import Any, Protocol

import torch


class InnerRounding(Protocol):
    def p(self, x: torch.Tensor) -> torch.Tensor: ...
    def p_backward(self, x: torch.Tensor) -> torch.Tensor: ...
    def ds(self, x: torch.Tensor, bound: torch.Tensor) -> torch.Tensor: ...


def _repeat(t: torch.Tensor, heads: int) -> torch.Tensor:
    return t.repeat_interleave(heads // t.shape[1], dim=1)


def _group_sum(t: torch.Tensor, kv_heads: int) -> torch.Tensor:
    b, h, s, d = t.shape
    return t.reshape(b, kv_heads, h // kv_heads, s, d).sum(2)


class _Flash(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, q, k, v, masked, slots: InnerRounding):
        h, d = q.shape[1], q.shape[-1]
        kk, vv = _repeat(k, h), _repeat(v, h)
        scores = q @ kk.transpose(-2, -1) / math.sqrt(d)
        if masked is not None:
            scores = scores.masked_fill(masked, float("-inf"))
        t = scores * (1.0 / math.log(2.0))
        m = torch.ceil(t.amax(-1, keepdim=True))
        p_unnormalised = torch.exp2(t - m)
        out = slots.p(p_unnormalised) @ vv / p_unnormalised.sum(-1, keepdim=True)
        ctx.save_for_backward(q, kk, vv, torch.softmax(scores, -1), out)
        ctx.slots, ctx.kv_heads = slots, k.shape[1]
        return out

    @staticmethod
    def backward(ctx: Any, do):
        q, kk, vv, p, out = ctx.saved_tensors
        d = q.shape[-1]
        dv = ctx.slots.p_backward(p).transpose(-2, -1) @ do
        dp = do @ vv.transpose(-2, -1)
        ds = p * (dp - (do * out).sum(-1, keepdim=True))
        bound = 2 * do.norm(dim=-1).amax() * vv.norm(dim=-1).amax()
        ds = ctx.slots.ds(ds, bound) / math.sqrt(d)
        dq = ds @ kk
        dk = ds.transpose(-2, -1) @ q
        return dq, _group_sum(dk, ctx.kv_heads), _group_sum(dv, ctx.kv_heads), None, None


def flash_attention(q, k, v, masked, slots: InnerRounding) -> torch.Tensor:
    """(b, h, s, d) queries, (b, g, s, d) keys and values (float64, on the FP8 grid)."""
    return _Flash.apply(q, k, v, masked, slots)


def cast(x: torch.Tensor, scale: torch.Tensor, fmt: torch.dtype) -> torch.Tensor:
    """torch's saturating cast of `x * scale` in fp32, dequantized as `q * (1 / scale)` in fp32."""
    limit = torch.finfo(fmt).max
    scale = scale.float()
    q = (x.detach().float() * scale).clamp(-limit, limit).to(fmt)
    return (q.float() * (1.0 / scale)).double()


class CurrentInner:
    """Current scaling (HYBRID): P with the scale of amax 1, dS with the scale of its bound."""

    def p(self, x: torch.Tensor) -> torch.Tensor:
        return cast(x, torch.tensor(448.0), torch.float8_e4m3fn)

    p_backward = p

    def ds(self, x: torch.Tensor, bound: torch.Tensor) -> torch.Tensor:
        return cast(x, torch.tensor(57344.0) / bound.float(), torch.float8_e5m2)
