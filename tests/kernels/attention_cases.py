"""FP8 attention operands and the tolerance check shared by the kernel tests of
``kernels/attention.py`` (interpreter and GPU) against ``kernels/reference_attention.py``.

The tolerances are the contract's (docs/fp8_attention.md): relative Frobenius error against the
float64 reference on the same FP8 operands. The kernel differs from it by fp32 accumulation in an
unspecified tile order, the GPU's ``exp2``/division and Hopper's FP8 accumulator, and by the rare
FP8 rounding tie of P or dS that those flip; a bf16 output adds its own rounding (2**-9 relative).
A wrong scale, mask or missing rounding moves the result by far more: P's E4M3 rounding alone
changes the output by ~1e-2 (``test_reference_attention.py`` pins that noise floor).
"""

from __future__ import annotations

import torch
from dist_quant.kernels import reference_attention as ref
from dist_quant.kernels.attention import attention_bwd_triton, attention_fwd_triton

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
OUT_TOL = {torch.float32: 1e-4, torch.bfloat16: 4e-3}
GRAD_TOL = 1e-3
LSE_TOL = 1e-4  # absolute, base-2 units


def cast(x: torch.Tensor, fp8_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-tensor current scaling with torch's own cast: (FP8 data, (1,) fp32 scale_inv)."""
    limit = torch.finfo(fp8_dtype).max
    scale = (limit / x.abs().amax().float()).reshape(1)
    return (x.float() * scale).clamp(-limit, limit).to(fp8_dtype), 1.0 / scale


def operands(b, h, hkv, sq, sk, d, *, device, seed=0, pad=False, causal=True):
    """Everything a forward and backward call takes (keys as the kernel launchers name them)."""
    g = torch.Generator().manual_seed(seed)

    def randn(*shape, std=1.0):
        return (torch.randn(*shape, generator=g) * std).to(device)

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


def rel_err(actual: torch.Tensor, expected: torch.Tensor) -> float:
    a, e = actual.detach().double().cpu(), expected.detach().double().cpu()
    return ((a - e).norm() / e.norm()).item()


def check_forward_and_backward(ops: dict, out_dtype: torch.dtype) -> None:
    """Run the launchers on ``ops`` and compare with the reference (on the CPU, float64)."""
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
    assert out.dtype == out_dtype and out.shape == ops["q"].shape
    assert rel_err(out, r.out) <= OUT_TOL[out_dtype], f"out: {rel_err(out, r.out):.2e}"
    finite = torch.isfinite(r.lse)
    assert torch.equal(torch.isfinite(lse.cpu()), finite), "lse: fully masked rows differ"
    lse_err = (lse.cpu().double() - r.lse)[finite].abs().max().item()
    assert lse_err <= LSE_TOL, f"lse: {lse_err:.2e}"
    assert abs(s_amax.item() - r.s_amax.item()) <= 1e-6, (s_amax.item(), r.s_amax.item())

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
    for name, got, exp in zip(("dq", "dk", "dv"), grads, rb[:3]):
        assert got.shape == exp.shape, f"{name}: shape {tuple(got.shape)}"
        assert rel_err(got, exp) <= GRAD_TOL, f"{name}: {rel_err(got, exp):.2e}"
    amax_err = abs(dp_amax.item() - rb.dp_amax.item()) / rb.dp_amax.item()
    assert amax_err <= 1e-4, (dp_amax.item(), rb.dp_amax.item())
