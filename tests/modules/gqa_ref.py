"""Float64 re-derivations for the grouped-query attention tests, with per-slot FP8 scaling state.

`Scaling` re-derives the per-tensor FP8 casts of the numerics contract slot by slot, so one
reference serves current scaling (every cast its own amax) and delayed scaling (a slot casts with
`fp8_max / max(amax history)`, 1 before its first update; the history holds every amax the slot
saw in earlier steps, `step()` closing a step). Casts are torch's own saturating float8
conversions of `x * scale` in fp32, dequantized as `q * (1 / scale)` in fp32. A slot is named by
the test (`"qkv.input"`, `"dpa.dqkv"`...): one name per quantizer of the module under test, so a
quantizer shared by several tensors (attention's qkv slot rounds q, k and v) shares one name.

`gqa_attention` is softmax attention on (batch, heads, seq, head_dim) tensors with k and v
holding fewer (KV) heads, each repeated for its group of consecutive query heads; in FP8 it is
`flash_ref.flash_attention` with q/k/v rounded at their own (KV) shape, before the repeat (so dk
and dv are rounded once summed over their query group), P and dS rounded inside with the `s` /
`dp` slots' scales, the output and its gradient rounded outside.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from flash_ref import cast, flash_attention

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
FP8_MAX = {E4M3: 448.0, E5M2: 57344.0}
FWD, BWD = E4M3, E5M2  # HYBRID, the default format of both recipes under test


class Scaling:
    def __init__(self, kind: str) -> None:
        if kind not in ("none", "current", "delayed"):
            raise ValueError(f"unknown scaling {kind!r}")
        self.kind = kind
        self.history: dict[str, torch.Tensor] = {}  # slot -> max amax of earlier steps (fp32)
        self.this_step: dict[str, torch.Tensor] = {}

    def cast(self, x: torch.Tensor, slot: str, fmt: torch.dtype) -> torch.Tensor:
        x32 = x.detach().float()
        amax = x32.abs().max()
        fp8_max = torch.tensor(FP8_MAX[fmt], dtype=torch.float32)
        if self.kind == "current":
            scale = fp8_max / amax
        else:
            seen = self.history.get(slot)
            scale = torch.tensor(1.0) if seen is None else fp8_max / seen
            prev = self.this_step.get(slot, torch.tensor(0.0))
            self.this_step[slot] = torch.maximum(prev, amax)
        q = (x32 * scale).clamp(-FP8_MAX[fmt], FP8_MAX[fmt]).to(fmt)
        return (q.float() * (1.0 / scale)).double()

    def step(self) -> None:
        for slot, amax in self.this_step.items():
            self.history[slot] = torch.maximum(self.history.get(slot, amax), amax)
        self.this_step.clear()

    def qdq(self, x: torch.Tensor, fwd: str | None, bwd: str | None) -> torch.Tensor:
        """Round `x` through slot `fwd` (E4M3) and its gradient through slot `bwd` (E5M2)."""
        if self.kind == "none" or (fwd is None and bwd is None):
            return x
        return _RoundTrip.apply(x, self, fwd, bwd)


class _RoundTrip(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, sc: Scaling, fwd: str | None, bwd: str | None):
        ctx.sc, ctx.bwd = sc, bwd
        return sc.cast(x, fwd, FWD) if fwd is not None else x.clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor):
        if ctx.bwd is not None:
            grad = ctx.sc.cast(grad, ctx.bwd, BWD)
        return grad, None, None, None


def gqa_attention(q, k, v, masked, sc: Scaling, *, fp8: bool = True) -> torch.Tensor:
    """(b, h, s, d) queries, (b, g, s, d) keys and values; `fp8=False`: no rounding at all."""
    if not fp8 or sc.kind == "none":
        group = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        scores = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])
        if masked is not None:
            scores = scores.masked_fill(masked, float("-inf"))
        return torch.softmax(scores, -1) @ v
    q, k, v = (sc.qdq(t, "dpa.qkv", "dpa.dqkv") for t in (q, k, v))
    return sc.qdq(flash_attention(q, k, v, masked, _Inner(sc)), "dpa.o", "dpa.do")


class _Inner:
    """What the `s` and `dp` slots round inside FP8 attention (`flash_ref.py`), with `sc`'s state:
    current scaling, the scale of P's bound 1 and of dS's bound; delayed scaling, the slot's
    history (and the amax recorded for the next step)."""

    def __init__(self, sc: Scaling) -> None:
        self.sc = sc
        self.p_scale = None

    def _scale(self, x: torch.Tensor, slot: str, fmt: torch.dtype, bound) -> torch.Tensor:
        fp8_max = torch.tensor(FP8_MAX[fmt], dtype=torch.float32)
        if self.sc.kind == "current":
            return fp8_max / torch.as_tensor(bound).float()
        prev = self.sc.this_step.get(slot, torch.tensor(0.0))
        self.sc.this_step[slot] = torch.maximum(prev, x.detach().abs().max().float())
        seen = self.sc.history.get(slot)
        return torch.tensor(1.0) if seen is None else fp8_max / seen

    def p(self, x: torch.Tensor) -> torch.Tensor:
        self.p_scale = self._scale(x, "dpa.s", FWD, 1.0)
        return cast(x, self.p_scale, FWD)

    def p_backward(self, x: torch.Tensor) -> torch.Tensor:
        return cast(x, self.p_scale, FWD)

    def ds(self, x: torch.Tensor, bound: torch.Tensor) -> torch.Tensor:
        return cast(x, self._scale(x, "dpa.dp", BWD, bound), BWD)


def linear(x, w, b, sc: Scaling, name: str) -> torch.Tensor:
    """`x @ w.T + b` with the input, weight (E4M3) and output-gradient (E5M2) slots of `name`;
    the bias gradient is the sum of the unrounded output gradient, as in the modules."""
    y = sc.qdq(
        sc.qdq(x, f"{name}.input", None) @ sc.qdq(w, f"{name}.weight", None).t(),
        None,
        f"{name}.grad_output",
    )
    return y if b is None else y + b


def layer_norm(x, weight, bias, eps: float = 1e-5) -> torch.Tensor:
    mean = x.mean(-1, keepdim=True)
    var = ((x - mean) ** 2).mean(-1, keepdim=True)
    return (x - mean) / torch.sqrt(var + eps) * weight + bias
