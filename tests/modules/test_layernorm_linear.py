"""LayerNormLinear: plain PyTorch math when autocast is off, FP8 GEMM after a high-precision norm."""

import pytest
import torch
import torch.nn.functional as F
from module_ref import DEVICE, assert_fp8_close, leaves, ref_linear, ref_norm

import dist_quant as dq


def make(normalization: str, seed: int = 0, **kw) -> dq.LayerNormLinear:
    torch.manual_seed(seed)
    mod = dq.LayerNormLinear(48, 40, normalization=normalization, eps=1e-5, device=DEVICE, **kw)
    with torch.no_grad():  # a non-trivial affine norm
        mod.layer_norm_weight.uniform_(0.5, 1.5)
        if mod.layer_norm_bias is not None:
            mod.layer_norm_bias.uniform_(-0.5, 0.5)
    return mod


def grads(mod: torch.nn.Module) -> list[torch.Tensor]:
    return [p.grad for p in mod.parameters()]


@pytest.mark.parametrize("normalization", ["LayerNorm", "RMSNorm"])
def test_disabled_autocast_is_plain_norm_then_linear_bit_for_bit(normalization):
    mod = make(normalization, return_layernorm_output=True)
    x = torch.randn(6, 2, 48, device=DEVICE, requires_grad=True)
    with dq.autocast(enabled=False):
        y, ln_out = mod(x)
    (y.sum() + ln_out.square().sum()).backward()

    x2, lw, w, b = leaves(x, mod.layer_norm_weight, mod.weight, mod.bias, dtype=torch.float32)
    if normalization == "LayerNorm":
        (lb,) = leaves(mod.layer_norm_bias, dtype=torch.float32)
        ln_ref = F.layer_norm(x2, (48,), lw, lb, 1e-5)
        params = [lw, lb, w, b]
    else:
        ln_ref = F.rms_norm(x2, (48,), lw, 1e-5)
        params = [lw, w, b]
    y_ref = F.linear(ln_ref, w, b)
    (y_ref.sum() + ln_ref.square().sum()).backward()
    assert torch.equal(y, y_ref) and torch.equal(ln_out, ln_ref)
    assert torch.equal(x.grad, x2.grad)
    for got, ref in zip(grads(mod), params):
        assert torch.equal(got, ref.grad)


@pytest.mark.parametrize("normalization", ["LayerNorm", "RMSNorm"])
def test_current_scaling_matches_float64_rederivation(normalization):
    mod = make(normalization, seed=1)
    x = torch.randn(8, 4, 48, device=DEVICE, requires_grad=True)
    dy = torch.randn(8, 4, 40, device=DEVICE)
    with dq.autocast(recipe=dq.Float8CurrentScaling()):
        y = mod(x)
    y.backward(dy)
    got = [y, x.grad, *grads(mod)]

    def reference(fp8: bool) -> list[torch.Tensor]:
        params = leaves(*mod.parameters())
        lw, *rest = params
        lb = rest.pop(0) if normalization == "LayerNorm" else None
        w, b = rest
        (x64,) = leaves(x)
        y64 = ref_linear(ref_norm(x64, lw, lb, normalization, 1e-5), w, b, fp8=fp8)
        y64.backward(dy.double())
        return [y64, x64.grad, *(p.grad for p in params)]

    names = ["output", "dgrad"] + [n for n, _ in mod.named_parameters()]
    for name, a, r8, rhp in zip(names, got, reference(True), reference(False)):
        assert_fp8_close(a, r8, rhp, name)


def test_fp8_output_rounds_the_output_through_the_output_role_slot():
    mod = make("LayerNorm", seed=2)
    mod.output_quantizer_role = dq.QuantizerRole("dpa", "qkv", "attn")
    x = torch.randn(16, 48, device=DEVICE)
    with dq.autocast(recipe=dq.Float8CurrentScaling()):
        plain = mod(x)
        rounded = mod(x, fp8_output=True)
    # the output slot is current scaling E4M3: rounding the unrounded output re-derives it
    e4m3 = torch.float8_e4m3fn
    scale = torch.tensor(448.0, device=DEVICE) / plain.detach().abs().max()
    expected = (plain.detach() * scale).clamp(-448, 448).to(e4m3).float() * (1.0 / scale)
    assert torch.equal(rounded.detach(), expected)
    assert mod.quant_binding.runtime.fwd_roles[2] == dq.QuantizerRole("dpa", "qkv", "attn")


def test_roles_are_linear_roles_and_constructor_rejects_bad_arguments():
    mod = dq.LayerNormLinear(8, 8, name="blocks.0.qkv")
    roles = mod.get_quantizer_roles(fwd=True, num_quantizers=3)
    assert [(r.module_type, r.tensor_type, r.name) for r in roles[:2]] == [
        ("linear", "input", "blocks.0.qkv"),
        ("linear", "weight", "blocks.0.qkv"),
    ]
    assert mod.get_quantizer_roles(fwd=False, num_quantizers=2)[0].tensor_type == "grad_output"
    with pytest.raises(ValueError, match="normalization"):
        dq.LayerNormLinear(8, 8, normalization="BatchNorm")
    with pytest.raises(ValueError, match="eps"):
        dq.LayerNormLinear(8, 8, eps=-1.0)
    with pytest.raises(ValueError, match="parallel_mode must be one of None, 'column'"):
        dq.LayerNormLinear(8, 8, parallel_mode="row")  # the norm needs whole rows
