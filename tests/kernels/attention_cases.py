"""FP8 attention operands and the tolerance checks shared by the kernel tests of
``kernels/attention.py`` (interpreter and GPU) against ``kernels/reference_attention.py``.

The tolerances are the contract's (docs/fp8_attention.md), in two parts.

`check_forward_and_backward`, for operands whose logits the kernel computes to fp32 precision (any
operands in the interpreter; on a GPU, `operands(exact=True)`, whose QK^T and dO V^T are small
integers a tensor core sums exactly): the gradients within a relative Frobenius error of the
float64 reference, the output within a bound for every row (`forward_row_bounds`). The forward's P
codes may differ from the definition's in two known places, each confined to a few elements of a
row: where a kernel rounds P against a running row max smaller than the final one and the
definition's value is subnormal in E4M3 (the kernel's grid is finer there), and where an fp32 logit
or ``exp2`` lands within rounding of an FP8 midpoint (the code flips). A Frobenius tolerance over
the tensor cannot tell those from a missing rounding; a row bound can: it allows those elements
their rounding step, plus P V's accumulation, and nothing else, so a kernel that skipped P's
rounding exceeds the bound on most rows (`test_reference_attention.py` checks that it does).

`check_within_hardware_tolerance`, for random operands on a GPU: Hopper's FP8 MMA sums products
with ~2**-12 relative error of their absolute sum (the H200 measured: logits off by up to 5e-3 in
base-2 units, against 1e-6 for exact operands), which moves many P and dS values across an FP8
midpoint; the result is then within `HARDWARE_TOL` of the definition, a coarse check (wrong masks,
head mapping or scales) that the exact cases sharpen.
"""

from __future__ import annotations

import math

import torch
from dist_quant.kernels import reference_attention as ref
from dist_quant.kernels.attention import attention_bwd_triton, attention_fwd_triton

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
GRAD_TOL = 1e-3
# a P value whose distance to an FP8 midpoint is below this fraction of its code step may take
# either code: fp32 logits (FP8 products summed in fp32), the fp32 product with the log2-scaled
# softmax scale and the GPU's exp2 (2 ulp) put p within ~2**-20 relative of the float64 value
MIDPOINT_WINDOW = 2.0**-16
# P V on an FP8 tensor core, relative to sum_j |c_j v_j| / l: Hopper's MMA keeps ~13 bits of its
# partial sums (with exact logits the H200's rows came within 4.6e-4 of the definition, one d64
# row within 1.05x of a 2**-10 allowance plus bf16 rounding: 2**-9 leaves room)
ACCUMULATION_NOISE = 2.0**-9
# random operands on Hopper: relative Frobenius error of the output and each gradient (the H200
# measured 5.8e-3 to 1.1e-2 at the GPU test's shapes)
HARDWARE_TOL = 3e-2
LSE_TOL = 1e-4  # absolute, base-2 units


def cast(x: torch.Tensor, fp8_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-tensor current scaling with torch's own cast: (FP8 data, (1,) fp32 scale_inv)."""
    limit = torch.finfo(fp8_dtype).max
    scale = (limit / x.abs().amax().float()).reshape(1)
    return (x.float() * scale).clamp(-limit, limit).to(fp8_dtype), 1.0 / scale


def _small_codes(g, shape, fp8_dtype, scale_inv, device):
    """FP8 codes drawn from {0, +-1, +-2, +-4} with a power-of-two ``scale_inv``."""
    values = torch.tensor([0.0, 1.0, -1.0, 2.0, -2.0, 4.0, -4.0])
    codes = values[torch.randint(len(values), shape, generator=g)].to(fp8_dtype)
    return codes.to(device), torch.tensor([scale_inv], device=device)


def operands(b, h, hkv, sq, sk, d, *, device, seed=0, pad=False, causal=True, exact=False):
    """Everything a forward and backward call takes (keys as the kernel launchers name them).

    ``exact``: every q, k, v and dO code is 0, +-1, +-2 or +-4, so QK^T and dO V^T are integers
    below 2**12 that any FP8 tensor core sums exactly; otherwise random normal operands cast with
    current scaling, whose products a Hopper FP8 MMA sums with ~2**-12 relative error."""
    g = torch.Generator().manual_seed(seed)

    def randn(*shape, std=1.0):
        return (torch.randn(*shape, generator=g) * std).to(device)

    if exact:
        q, q_si = _small_codes(g, (b, h, sq, d), E4M3, 2.0**-1, device)
        k, k_si = _small_codes(g, (b, hkv, sk, d), E4M3, 2.0**-1, device)
        v, v_si = _small_codes(g, (b, hkv, sk, d), E4M3, 2.0**-2, device)
        do, do_si = _small_codes(g, (b, h, sq, d), E5M2, 2.0**-12, device)
    else:
        q, q_si = cast(randn(b, h, sq, d), E4M3)
        k, k_si = cast(randn(b, hkv, sk, d, std=2.0), E4M3)  # sharper softmax than unit scores
        v, v_si = cast(randn(b, hkv, sk, d), E4M3)
        do, do_si = cast(randn(b, h, sq, d, std=1e-3), E5M2)
    pad_mask = None
    if pad:
        pad_mask = torch.zeros(b, 1, 1, sk, dtype=torch.bool, device=device)
        pad_mask[-1, ..., sk - sk // 3 :] = True  # the last sequence: a third of its keys padded
    return {
        "q": q, "k": k, "v": v, "do": do,
        "q_scale_inv": q_si, "k_scale_inv": k_si, "v_scale_inv": v_si, "do_scale_inv": do_si,
        "s_scale": torch.tensor([448.0], device=device), "s_dtype": E4M3,
        "dp_scale": torch.tensor([2.0**20], device=device), "dp_dtype": E5M2,
        "pad_mask": pad_mask, "causal": causal,
    }  # fmt: skip


def _values(x: torch.Tensor, scale_inv: torch.Tensor, heads: int) -> torch.Tensor:
    """FP8 (b, hx, s, d) -> float64 values, KV heads repeated for their query heads."""
    x = x.double() * scale_inv.double()
    return x.repeat_interleave(heads // x.shape[1], dim=1)


def forward_row_bounds(ops: dict, out_dtype: torch.dtype) -> torch.Tensor:
    """(b, h, sq) float64: how far each output row (its 2-norm over d) may lie from the definition.

    With ``y = p * s_scale`` the definition's value before P's cast (``reference_attention``):
    an element with ``y`` subnormal in the `s` format may take any code within one subnormal step
    (the kernel rounded ``y * 2**k`` on a finer grid, then scaled by ``2**-k`` exactly); one within
    ``MIDPOINT_WINDOW`` of a midpoint may take the neighbouring code (one step). The row's error is
    then at most ``s_si * v_si * ||sum_j allowance_j |v_j| || / l`` plus fp32 accumulation noise
    and, for a bf16 output, its rounding (2**-9 of each element)."""
    cpu = {x: (t.cpu() if isinstance(t, torch.Tensor) else t) for x, t in ops.items()}
    h, d = cpu["q"].shape[1], cpu["q"].shape[3]
    s_scale, s_dtype = cpu["s_scale"].double(), cpu["s_dtype"]
    qd, kd, vd = (
        _values(cpu[x], cpu[f"{x}_scale_inv"], h) for x in ("q", "k", "v")
    )  # fmt: skip
    t = (qd @ kd.transpose(-2, -1)) * (ref.LOG2E / math.sqrt(d))
    hidden = torch.zeros(t.shape[-2:], dtype=torch.bool)
    if cpu["causal"]:
        hidden = torch.ones_like(hidden).triu(1)
    if cpu["pad_mask"] is not None:
        hidden = hidden | cpu["pad_mask"]
    t = t.masked_fill(hidden, float("-inf"))
    row_max = t.amax(-1, keepdim=True)
    m = torch.where(torch.isinf(row_max), torch.zeros_like(row_max), torch.ceil(row_max))
    p = torch.exp2(t - m)
    y = p * s_scale
    limit = torch.finfo(s_dtype).max
    codes = (p.float() * cpu["s_scale"]).clamp(-limit, limit).to(s_dtype).double()
    info = torch.finfo(s_dtype)
    mant_bits = {torch.float8_e4m3fn: 3, torch.float8_e5m2: 2}[s_dtype]
    subnormal_step = info.smallest_normal * 2.0**-mant_bits
    exponent = torch.floor(torch.log2(y.clamp_min(info.smallest_normal)))
    step = torch.where(y < info.smallest_normal, subnormal_step, torch.exp2(exponent - mant_bits))
    frac = y / step - torch.floor(y / step)
    near_midpoint = (frac - 0.5).abs() < MIDPOINT_WINDOW
    allowance = torch.where((y > 0) & (y < info.smallest_normal), subnormal_step, 0.0)
    allowance = torch.where(near_midpoint & (y > 0), step, allowance)
    s_inv = (1.0 / cpu["s_scale"].float()).double()
    row_sum = p.sum(-1).clamp_min(torch.finfo(torch.float64).tiny)
    moved = (allowance @ vd.abs()).norm(dim=-1) * s_inv / row_sum
    magnitude = (codes @ vd.abs()).norm(dim=-1) * s_inv / row_sum  # >= ||out_i||
    noise = ACCUMULATION_NOISE * magnitude
    rounding = 2.0**-9 * magnitude if out_dtype == torch.bfloat16 else 0.0
    return moved + noise + rounding


def rel_err(actual: torch.Tensor, expected: torch.Tensor) -> float:
    a, e = actual.detach().double().cpu(), expected.detach().double().cpu()
    return ((a - e).norm() / e.norm()).item()


def in_sbhd_storage(ops: dict, *, fused: bool = False) -> dict:
    """``ops`` with q, k, v and dO as (b, h, s, d) views of (s, b, h, d) storage, the layout of
    activations in `sbhd` format; ``fused``: q, k and v are column blocks of one
    (s, b, (h + 2 hkv) d) buffer, as a fused QKV projection's output split into heads."""
    out = dict(ops)
    q, k, v = ops["q"], ops["k"], ops["v"]
    if fused:
        b, h, s, d = q.shape
        hkv = k.shape[1]
        mixed = torch.cat([t.permute(2, 0, 1, 3).reshape(s, b, -1) for t in (q, k, v)], dim=-1)
        parts = mixed.split([h * d, hkv * d, hkv * d], dim=-1)
        views = [t.view(s, b, -1, d).permute(1, 2, 0, 3) for t in parts]
        out["q"], out["k"], out["v"] = views
    else:
        for name in ("q", "k", "v"):
            out[name] = ops[name].permute(2, 0, 1, 3).contiguous().permute(1, 2, 0, 3)
    out["do"] = ops["do"].permute(2, 0, 1, 3).contiguous().permute(1, 2, 0, 3)
    return out


def check_layouts(ops: dict, out_dtype: torch.dtype) -> None:
    """The kernels' outputs keep their operands' storage order: out and dq q's strides (dense),
    dk and dv k's, so a caller in `sbhd` gets its layout back without a copy."""
    (out, _, _, grads, _), _, _ = _run(ops, out_dtype)
    dense_q = torch.empty_like(ops["q"]).stride()
    dense_k = torch.empty_like(ops["k"]).stride()
    assert out.stride() == dense_q and grads[0].stride() == dense_q, (out.stride(), dense_q)
    assert grads[1].stride() == dense_k and grads[2].stride() == dense_k, grads[1].stride()


def _run(ops: dict, out_dtype: torch.dtype):
    """The launchers and the float64 reference on ``ops``: (out, lse, s_amax, grads, dp_amax) of
    the kernels, then the reference's forward and backward (``out`` and ``lse`` the kernel's)."""
    dev = ops["q"].device
    cpu = {k: (v.cpu() if isinstance(v, torch.Tensor) else v) for k, v in ops.items()}
    s_amax, dp_amax = torch.zeros(1, device=dev), torch.zeros(1, device=dev)
    fwd_keys = ("q", "k", "v", "q_scale_inv", "k_scale_inv", "v_scale_inv", "s_scale")
    out, lse = attention_fwd_triton(
        *(ops[k] for k in fwd_keys), s_amax, ops["s_dtype"], ops["pad_mask"], ops["causal"],
        out_dtype,
    )  # fmt: skip
    r = ref.attention_fwd(
        *(cpu[k] for k in fwd_keys), cpu["s_dtype"], cpu["pad_mask"], cpu["causal"]
    )
    bwd_keys = ("q", "k", "v")
    scale_keys = ("q_scale_inv", "k_scale_inv", "v_scale_inv", "do_scale_inv")
    grads = attention_bwd_triton(
        *(ops[k] for k in bwd_keys), out, ops["do"], *(ops[k] for k in scale_keys), lse,
        ops["s_scale"], ops["s_dtype"], ops["dp_scale"], dp_amax, ops["dp_dtype"],
        ops["pad_mask"], ops["causal"],
    )  # fmt: skip
    rb = ref.attention_bwd(
        *(cpu[k] for k in bwd_keys), out.cpu(), cpu["do"], *(cpu[k] for k in scale_keys),
        lse.cpu(), cpu["s_scale"], cpu["s_dtype"], cpu["dp_scale"], cpu["dp_dtype"],
        cpu["pad_mask"], cpu["causal"],
    )  # fmt: skip
    assert out.dtype == out_dtype and out.shape == ops["q"].shape
    for name, got, exp in zip(("dq", "dk", "dv"), grads, rb[:3]):
        assert got.shape == exp.shape, f"{name}: shape {tuple(got.shape)}"
    return (out, lse, s_amax, grads, dp_amax), r, rb


def check_forward_and_backward(ops: dict, out_dtype: torch.dtype) -> None:
    """The launchers against the reference where the kernel's logits are exact (module doc)."""
    (out, lse, s_amax, grads, dp_amax), r, rb = _run(ops, out_dtype)
    row_err = (out.cpu().double() - r.out).norm(dim=-1)
    bound = forward_row_bounds(ops, out_dtype)
    worst = (row_err / bound.clamp_min(1e-300)).max().item()
    assert bool((row_err <= bound).all()), f"out: a row's error is {worst:.2f}x its bound"
    finite = torch.isfinite(r.lse)
    assert torch.equal(torch.isfinite(lse.cpu()), finite), "lse: fully masked rows differ"
    lse_err = (lse.cpu().double() - r.lse)[finite].abs().max().item()
    assert lse_err <= LSE_TOL, f"lse: {lse_err:.2e}"
    assert abs(s_amax.item() - r.s_amax.item()) <= 1e-6, (s_amax.item(), r.s_amax.item())
    for name, got, exp in zip(("dq", "dk", "dv"), grads, rb[:3]):
        assert rel_err(got, exp) <= GRAD_TOL, f"{name}: {rel_err(got, exp):.2e}"
    amax_err = abs(dp_amax.item() - rb.dp_amax.item()) / rb.dp_amax.item()
    assert amax_err <= 1e-4, (dp_amax.item(), rb.dp_amax.item())


def check_within_hardware_tolerance(ops: dict, out_dtype: torch.dtype) -> None:
    """The launchers against the reference for random operands on a GPU (module doc)."""
    (out, _, _, grads, _), r, rb = _run(ops, out_dtype)
    for name, got, exp in zip(("out", "dq", "dk", "dv"), (out, *grads), (r.out, *rb[:3])):
        assert rel_err(got, exp) <= HARDWARE_TOL, f"{name}: {rel_err(got, exp):.2e}"
