"""Linear under autocast: exact high precision when disabled, FP8 numerics re-derived in float64."""

import pytest
import torch
import torch.nn.functional as F
from recipe_cases import builtin_and_reference_factory

import dist_quant as dq

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
MAX = {E4M3: 448.0, E5M2: 57344.0}


def current_qdq(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Current scaling re-derived: fp32 scale = max / amax, torch's saturating cast, float64 out."""
    amax = x.detach().abs().max().float()
    scale = torch.tensor(MAX[dtype], dtype=torch.float32) / amax
    q = (x.detach().float() * scale).clamp(-MAX[dtype], MAX[dtype]).to(dtype)
    return q.double() * (1.0 / scale).double()


def bound(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """fp32 emulation error bound for a @ b.T: dequantize rounding (2^-24 per operand) plus fp32
    accumulation over K terms, relative to the sum of |terms|."""
    k = a.shape[-1]
    return (a.abs() @ b.abs().t()) * (k + 4) * 2.0**-24


def make(seed: int = 0, in_f: int = 48, out_f: int = 40, tokens: int = 24):
    torch.manual_seed(seed)
    lin = dq.Linear(in_f, out_f, name="fc")
    x = torch.randn(2, tokens // 2, in_f, requires_grad=True)
    return lin, x


def run(lin, x, recipe=None, enabled=True, **kw):
    x = x.detach().clone().requires_grad_(True)
    lin.zero_grad(set_to_none=True)
    with dq.autocast(enabled=enabled, recipe=recipe):
        y = lin(x, **kw)
    dy = torch.linspace(-1, 1, y.numel()).reshape(y.shape)
    y.backward(dy)
    return y.detach(), x.grad, lin.weight.grad, lin.bias.grad, dy


def test_disabled_autocast_is_plain_linear_bit_for_bit():
    lin, x = make()
    y, dx, dw, db, dy = run(lin, x, enabled=False)
    x2 = x.detach().clone().requires_grad_(True)
    w2 = lin.weight.detach().clone().requires_grad_(True)
    b2 = lin.bias.detach().clone().requires_grad_(True)
    y2 = F.linear(x2, w2, b2)
    y2.backward(dy)
    assert torch.equal(y, y2) and torch.equal(dx, x2.grad)
    assert torch.equal(dw, w2.grad) and torch.equal(db, b2.grad)


def test_current_scaling_matches_float64_rederivation():
    lin, x = make(1)
    y, dx, dw, db, dy = run(lin, x, recipe=dq.Float8CurrentScaling())
    x2d = x.detach().reshape(-1, x.shape[-1])
    xq, wq = current_qdq(x2d, E4M3), current_qdq(lin.weight, E4M3)
    y_ref = xq @ wq.t() + lin.bias.detach().double()
    torch.testing.assert_close(
        y.reshape(-1, y.shape[-1]).double(), y_ref, rtol=0, atol=bound(xq, wq).max().item() + 1e-6
    )
    dyq = current_qdq(dy.reshape(-1, dy.shape[-1]), E5M2)  # HYBRID: gradients in E5M2
    dx_ref = dyq @ wq
    torch.testing.assert_close(dx.reshape(dx_ref.shape).double(), dx_ref, rtol=0, atol=1e-4)
    dw_ref = dyq.t() @ xq
    torch.testing.assert_close(dw.double(), dw_ref, rtol=0, atol=1e-4)
    torch.testing.assert_close(
        db.double(), dy.reshape(-1, dy.shape[-1]).double().sum(0), rtol=1e-6, atol=1e-6
    )


@builtin_and_reference_factory
def test_custom_recipe_of_reference_factory_equals_builtin_bit_for_bit(builtin, factory):
    a, x = make(2)
    b, _ = make(2)
    for step in range(3):  # several steps so delayed scaling's history and scale take part
        ra = run(a, x * (step + 1), recipe=builtin)
        rb = run(b, x * (step + 1), recipe=dq.CustomRecipe(factory))
        for ta, tb in zip(ra, rb):
            assert torch.equal(ta, tb)


class _CurrentSubclass(dq.Float8CurrentScalingQuantizer):
    """Quantizes exactly like its base; being a subclass, it sends the GEMM down the general
    path (the per-tensor path takes only the built-in classes, whose `quantize` it knows)."""


@dq.quantizer_factory(key="test-linear-current-subclass")
def _current_subclass(role):
    fmt = E5M2 if role is not None and role.tensor_type == "grad_output" else E4M3
    return _CurrentSubclass(fmt)


@pytest.mark.parametrize("shape", [(24, 48), (2, 12, 48)], ids=["2d", "3d"])
@pytest.mark.parametrize("needs", ["all", "frozen_weight", "no_input_grad"])
def test_per_tensor_path_equals_the_general_path_bit_for_bit(shape, needs):
    # built-in per-tensor quantizers take the per-tensor linear path, a subclass the general
    # one: same outputs and gradients, for 2D and 3D inputs, a frozen weight, an input without
    # gradient
    results = []
    for recipe in (dq.Float8CurrentScaling(), dq.CustomRecipe(_current_subclass)):
        torch.manual_seed(5)
        lin = dq.Linear(48, 40, name="fc")
        lin.weight.requires_grad_(needs != "frozen_weight")
        x = torch.randn(*shape, requires_grad=needs != "no_input_grad")
        with dq.autocast(recipe=recipe):
            y = lin(x)
        y.backward(torch.linspace(-1, 1, y.numel()).reshape(y.shape))
        results.append((y.detach(), x.grad, lin.weight.grad, lin.bias.grad))
    for name, a, b in zip(("y", "dx", "dw", "db"), *results):
        assert (a is None) == (b is None), name
        assert a is None or torch.equal(a, b), name


def test_high_precision_recipe_equals_disabled_bit_for_bit():
    lin, x = make(3)
    ra = run(lin, x, enabled=False)
    rb = run(lin, x, recipe=dq.recipe_from_dict("bf16"))
    for ta, tb in zip(ra, rb):
        assert torch.equal(ta, tb)


def test_weight_cache_reused_across_microbatches_and_dropped_on_update_or_recipe_change():
    lin, x = make(4)
    recipe = dq.Float8CurrentScaling()
    with dq.autocast(recipe=recipe):
        lin(x, is_first_microbatch=True)
    wq_first = lin.quant_binding.cached_weight("weight")
    with dq.autocast(recipe=recipe):
        lin(x, is_first_microbatch=False)
    assert lin.quant_binding.cached_weight("weight") is wq_first, (
        "second microbatch must reuse the FP8 weight"
    )
    with torch.no_grad():
        lin.weight.add_(1.0)  # optimizer step: new weight version
    with dq.autocast(recipe=recipe):
        lin(x, is_first_microbatch=False)
    wq_after_update = lin.quant_binding.cached_weight("weight")
    assert wq_after_update is not wq_first
    expected = current_qdq(lin.weight, E4M3).float()
    assert torch.equal(wq_after_update.dequantize(torch.float32), expected)
    dq.apply_recipe(lin, dq.MXFP8BlockScaling())
    assert lin.quant_binding.cached_weight("weight") is None, (
        "a committed recipe change drops the cached weight"
    )


def test_linear_roles_follow_transformer_engine_slot_order():
    lin = dq.Linear(8, 8, name="blocks.0.fc")
    fwd = lin.get_quantizer_roles(fwd=True, num_quantizers=3)
    bwd = lin.get_quantizer_roles(fwd=False, num_quantizers=2)
    assert [(r.module_type, r.tensor_type, r.name) for r in fwd[:2]] == [
        ("linear", "input", "blocks.0.fc"),
        ("linear", "weight", "blocks.0.fc"),
    ]
    assert fwd[2] is None and bwd[1] is None
    assert (bwd[0].tensor_type, bwd[0].name) == ("grad_output", "blocks.0.fc")
    with pytest.raises(ValueError, match="3 forward quantizer slots"):
        lin.get_quantizer_roles(fwd=True, num_quantizers=2)
