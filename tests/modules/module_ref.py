"""Float64 re-derivations shared by the module tests.

`current_qdq` re-derives per-tensor current scaling with torch's own casts: fp32 amax, fp32 IEEE
scale `fp8_max / amax`, saturating cast, dequantized exactly in float64. `qdq` puts it in an
autograd graph as a straight-through pair: the forward rounds the value, the backward rounds the
incoming gradient (HYBRID: E4M3 forward, E5M2 backward). The references below are float64
PyTorch math with `qdq` where the modules quantize; `fp8=False` gives the unquantized math.

`assert_fp8_close` is the tolerance, justified once here. The module and the reference quantize
the same operands with the same formula, so they differ only by fp32 arithmetic (GEMM
accumulation, norm, softmax, activation), about 1e-7 relative, except where such a difference
moves a value across an FP8 rounding boundary: that element then differs by one FP8 step (up to
1/8 of its value in E4M3). For generic values such crossings are rare (about one per 2^17
elements); attention outputs built from few on-grid terms sit on ties more often, but still only
isolated elements cross (in these tests at most 2% of the noise below). FP8 rounding noise, in
contrast, is on every element. The criterion: the Frobenius error relative to the FP8 reference
is at most a quarter of the relative distance between the FP8 and the unquantized reference
(which must be visible, > 1e-3). A missing quantization, a wrong format or a wrong scale produces
an error of the order of the noise and fails it.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from flash_ref import CurrentInner, flash_attention
from torch.nn.attention import SDPBackend, sdpa_kernel

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
_MAX = {E4M3: 448.0, E5M2: 57344.0}


def current_qdq(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Per-tensor current scaling of `x` (rounded to fp32 first, as the modules see it),
    dequantized as the numerics contract says: `q * scale_inv` in fp32."""
    x32 = x.detach().float()
    scale = torch.tensor(_MAX[dtype], dtype=torch.float32, device=x.device) / x32.abs().max()
    q = (x32 * scale).clamp(-_MAX[dtype], _MAX[dtype]).to(dtype)
    return (q.float() * (1.0 / scale)).double()


class _RoundTrip(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, fwd: torch.dtype | None, bwd: torch.dtype | None):
        ctx.bwd = bwd
        return current_qdq(x, fwd) if fwd is not None else x.clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor):
        return (current_qdq(grad, ctx.bwd) if ctx.bwd is not None else grad), None, None


def qdq(
    x: torch.Tensor,
    fwd: torch.dtype | None = None,
    bwd: torch.dtype | None = None,
    *,
    fp8: bool = True,
):
    """Round `x` forward through `fwd` and its gradient through `bwd` (None: pass through)."""
    return _RoundTrip.apply(x, fwd, bwd) if fp8 else x


def ref_linear(
    x, w, b, *, fp8: bool = True, out: torch.dtype | None = None, grad_in: torch.dtype | None = None
):
    """`x @ w.T + b`: input and weight E4M3, output gradient E5M2; `out` / `grad_in` round the
    output / input gradient at an FP8 boundary."""
    x = qdq(x, None, grad_in, fp8=fp8)
    y = qdq(qdq(x, E4M3, fp8=fp8) @ qdq(w, E4M3, fp8=fp8).t(), None, E5M2, fp8=fp8)
    y = y if b is None else y + b
    return qdq(y, out, fp8=fp8)


def ref_norm(x, weight, bias, normalization: str, eps: float):
    if normalization == "LayerNorm":
        mean = x.mean(-1, keepdim=True)
        var = ((x - mean) ** 2).mean(-1, keepdim=True)
        return (x - mean) / torch.sqrt(var + eps) * weight + bias
    return x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps) * weight


def ref_activation(h, activation: str):
    if activation == "gelu":
        return 0.5 * h * (1 + torch.tanh(math.sqrt(2 / math.pi) * (h + 0.044715 * h**3)))
    gate, up = h.chunk(2, -1)
    return gate * torch.sigmoid(gate) * up


def ref_attention(q, k, v, masked, *, fp8: bool = True):
    """(b, h, s, d) attention under per-tensor current scaling (`flash_ref.py`): q/k/v E4M3 (grads
    E5M2), P and dS rounded inside attention, the output E4M3 (grad E5M2)."""
    if not fp8:
        scores = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])
        if masked is not None:
            scores = scores.masked_fill(masked, float("-inf"))
        return torch.softmax(scores, -1) @ v
    q, k, v = (qdq(t, E4M3, E5M2) for t in (q, k, v))
    return qdq(flash_attention(q, k, v, masked, CurrentInner()), E4M3, E5M2)


def math_sdpa():
    """Pin SDPA to its math backend: on CUDA the fused backends may accumulate a backward pass in
    a run-dependent order, which would break bit-for-bit comparisons of two identical calls."""
    return sdpa_kernel(SDPBackend.MATH)


def sdpa_plain(q, k, v, attn_mask_type: str, attention_mask=None):
    """PyTorch's SDPA on (s, b, h, d) tensors, as the plain reference of attention."""
    q, k, v = (t.permute(1, 2, 0, 3) for t in (q, k, v))
    if attn_mask_type == "causal":
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    else:
        out = F.scaled_dot_product_attention(
            q, k, v, attn_mask=None if attention_mask is None else ~attention_mask
        )
    out = out.permute(2, 0, 1, 3)
    return out.reshape(*out.shape[:2], -1)


def leaves(*tensors: torch.Tensor, dtype: torch.dtype = torch.float64) -> list[torch.Tensor]:
    return [t.detach().to(dtype).clone().requires_grad_(True) for t in tensors]


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def assert_fp8_close(
    actual: torch.Tensor, ref_fp8: torch.Tensor, ref_hp: torch.Tensor, what: str
) -> None:
    """`actual` matches the FP8 re-derivation well inside FP8 rounding noise (module docstring).
    A quantity no FP8 rounding reaches (a bias gradient: the sum of the unrounded output gradient)
    has no noise and must match to fp32 accuracy."""
    assert actual.shape == ref_fp8.shape, (
        f"{what}: shape {tuple(actual.shape)} != {tuple(ref_fp8.shape)}"
    )
    noise = rel_err(ref_hp, ref_fp8)
    err = rel_err(actual, ref_fp8)
    if noise == 0.0:
        assert err <= 1e-6, f"{what}: error {err:.2e} on a path FP8 does not touch"
        return
    assert noise > 1e-3, (
        f"{what}: FP8 rounding is invisible (noise {noise:.2e}); the test has no power"
    )
    assert err <= noise / 4, f"{what}: error {err:.2e} vs the FP8 reference, FP8 noise {noise:.2e}"
