"""FP8 attention through cuDNN's fused FP8 SDPA (``kernels/attention_cudnn.py``) against the float64
definition on the same FP8 operands, and `DotProductAttention` taking it under delayed scaling.

cuDNN rounds P against its own running row max (not the definition's integer one) and writes its
output and gradients in FP8 itself, so the checks are tolerances (docs/fp8_attention.md): the
output and each gradient, dequantized, within CUDNN_TOL relative Frobenius error of the
definition's value rounded through the same FP8 format and scale; lse within CUDNN_LSE_TOL; the
amaxes it reports within CUDNN_AMAX_TOL of the definition's. Skips where cuDNN does not run: no
GPU, no `cudnn` extra, cuDNN older than 9.14, a GPU before Hopper."""

from __future__ import annotations

import pytest
import torch
from attention_cases import E4M3, E5M2, operands, rel_err
from dist_quant.kernels import attention_cudnn
from dist_quant.kernels import reference_attention as ref
from dist_quant.kernels.attention_cudnn import (
    cudnn_runs,
    fp8_attention_bwd_cudnn,
    fp8_attention_fwd_cudnn,
)

import dist_quant as dq

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("cuDNN's FP8 attention needs a CUDA GPU", allow_module_level=True)
_probe = torch.zeros(1, 1, 1, 128, device="cuda")
_preferred = attention_cudnn.BACKEND
attention_cudnn.BACKEND = "cudnn"  # what runs here, whichever path the job prefers
_runs = cudnn_runs(_probe, _probe, None, E4M3)
attention_cudnn.BACKEND = _preferred
if not _runs:
    pytest.skip(
        "cuDNN's FP8 SDPA does not run here (the `cudnn` extra, cuDNN >= 9.14 and sm90+ needed)",
        allow_module_level=True,
    )

# Measured on the H200 (cuDNN 9.19, these operands: k drawn with std 2, a sharp softmax): dq
# 5.96e-2 from the rounded definition, and 5.97e-2 from the Triton path through the module (the
# Triton kernels are within 1.1e-2 of the unrounded one, test_triton_gpu_attention); 1.4-2.0e-2 with a unit-std k. The results
# are E5M2 (2 mantissa bits), so where cuDNN's value and the definition's fall either side of a
# rounding boundary the codes differ by a 25% step. Why this is wider than the Triton kernels'
# bound is not found yet; the path stays opt-in until it is (docs/fp8_attention.md).
CUDNN_TOL = 8e-2
CUDNN_LSE_TOL = 5e-3  # absolute, base-2 units (measured up to 1.4e-3)
CUDNN_AMAX_TOL = 5e-2  # relative

CASES = {
    # b, h, hkv, sq, sk, d
    "gqa": (1, 8, 2, 1031, 1031, 128),
    "mha": (2, 4, 4, 512, 512, 128),
}


def _fp8_round(x: torch.Tensor, scale: torch.Tensor, fp8_dtype: torch.dtype) -> torch.Tensor:
    """``x`` through a per-tensor FP8 cast with ``scale`` and back, in float64 (torch's cast)."""
    limit = torch.finfo(fp8_dtype).max
    codes = (x.float() * scale.cpu()).clamp(-limit, limit).to(fp8_dtype)
    return codes.double() / scale.cpu().double()


def _scale_for(amax: torch.Tensor, fp8_dtype: torch.dtype) -> torch.Tensor:
    return torch.tensor([torch.finfo(fp8_dtype).max / float(amax)], device="cuda")


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
@pytest.mark.parametrize("case", list(CASES))
def test_cudnn_fp8_attention_matches_the_float64_definition(case, causal):
    ops = operands(*CASES[case], device="cuda", seed=len(case), causal=causal)
    cpu = {k: (v.cpu() if isinstance(v, torch.Tensor) else v) for k, v in ops.items()}
    fwd_keys = ("q", "k", "v", "q_scale_inv", "k_scale_inv", "v_scale_inv", "s_scale")
    r = ref.attention_fwd(*(cpu[k] for k in fwd_keys), E4M3, None, causal)
    o_scale = _scale_for(r.out.abs().max(), E4M3)
    s_amax, o_amax = torch.zeros(1, device="cuda"), torch.zeros(1, device="cuda")
    out8, lse, _, o_si = fp8_attention_fwd_cudnn(
        *(ops[k] for k in fwd_keys), s_amax, o_scale, o_amax, E4M3, causal
    )
    assert out8.dtype == E4M3 and out8.shape == ops["q"].shape
    out = out8.double() * o_si.double()
    assert rel_err(out, _fp8_round(r.out, o_scale, E4M3)) <= CUDNN_TOL
    assert (lse.cpu().double() - r.lse).abs().max().item() <= CUDNN_LSE_TOL
    assert abs(o_amax.item() / r.out.abs().max().item() - 1) <= CUDNN_AMAX_TOL
    assert s_amax.item() == 1.0  # the max of what cuDNN rounds: exp(logit - row max)

    scale_keys = ("q_scale_inv", "k_scale_inv", "v_scale_inv", "do_scale_inv")
    rb = ref.attention_bwd(
        cpu["q"], cpu["k"], cpu["v"], out.cpu(), cpu["do"], *(cpu[k] for k in scale_keys),
        lse.cpu(), cpu["s_scale"], E4M3, cpu["dp_scale"], E5M2, None, causal,
    )  # fmt: skip
    grad_amax_ref = max(g.abs().max() for g in rb[:3])
    grad_scale = _scale_for(grad_amax_ref, E5M2)
    dp_amax, grad_amax = torch.zeros(1, device="cuda"), torch.zeros(1, device="cuda")
    grads8 = fp8_attention_bwd_cudnn(
        ops["q"], ops["k"], ops["v"], out8, o_si, ops["do"], *(ops[k] for k in scale_keys), lse,
        ops["s_scale"], ops["dp_scale"], dp_amax, grad_scale, grad_amax, E5M2, causal,
    )  # fmt: skip
    for name, g8, exp in zip(("dq", "dk", "dv"), grads8, rb[:3]):
        assert g8.dtype == E5M2 and g8.shape == exp.shape, name
        got = g8.double().cpu() / grad_scale.double().cpu()
        err = rel_err(got, _fp8_round(exp, grad_scale, E5M2))
        assert err <= CUDNN_TOL, f"{name}: {err:.2e}"
    assert abs(grad_amax.item() / grad_amax_ref.item() - 1) <= CUDNN_AMAX_TOL
    assert abs(dp_amax.item() / rb.dp_amax.item() - 1) <= CUDNN_AMAX_TOL


def test_dot_product_attention_runs_cudnn_under_delayed_scaling(monkeypatch):
    """`DotProductAttention` (GQA, causal, head dim 128) under `DelayedScaling(fp8_dpa=True)`:
    cuDNN's kernels run, the output lies on the `o` slot's FP8 grid, and the output and gradients
    are within CUDNN_TOL of the Triton path's on the same inputs."""
    torch.manual_seed(0)
    b, s, h, hkv, d = 2, 256, 8, 2, 128
    q = torch.randn(b, s, h * d, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(b, s, hkv * d, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(b, s, hkv * d, device="cuda", dtype=torch.bfloat16)
    grad = torch.randn(b, s, h * d, device="cuda", dtype=torch.bfloat16) * 1e-2

    def step():
        dpa = dq.DotProductAttention(
            h, d, num_gqa_groups=hkv, attn_mask_type="causal", qkv_format="bshd", name="attn",
            device="cuda",
        )  # fmt: skip
        leaves = [t.clone().requires_grad_(True) for t in (q, k, v)]
        with dq.autocast(recipe=dq.DelayedScaling(fp8_dpa=True)):
            out = dpa(*(t.view(b, s, -1, d) for t in leaves))
        out.backward(grad)
        return [out.detach()] + [t.grad for t in leaves]

    monkeypatch.setattr(attention_cudnn, "BACKEND", "cudnn")
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        on_cudnn = step()
    names = [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    assert any("cudnn" in n.lower() or "sdpa" in n.lower() for n in names), sorted(set(names))
    monkeypatch.setattr(attention_cudnn, "BACKEND", "triton")
    on_triton = step()
    for name, a, t in zip(("out", "dq", "dk", "dv"), on_cudnn, on_triton):
        assert rel_err(a, t) <= CUDNN_TOL, f"{name}: {rel_err(a, t):.2e}"
