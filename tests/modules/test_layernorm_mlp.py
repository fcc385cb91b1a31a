"""LayerNormMLP: two GEMM triples on their own slots, exact when disabled, FP8 as re-derived."""

import pytest
import torch
import torch.nn.functional as F
from module_ref import (
    DEVICE,
    assert_fp8_close,
    leaves,
    ref_activation,
    ref_linear,
    ref_norm,
)
from module_step import assert_recipes_agree_bit_for_bit, run
from recipe_cases import builtin_and_reference_factory

import dist_quant as dq
from dist_quant import factories
from dist_quant.forward import active_runtime
from dist_quant.modules import functional, layernorm_mlp

HIDDEN, FFN = 32, 48


def make(activation: str = "gelu", seed: int = 0, **kw) -> dq.LayerNormMLP:
    torch.manual_seed(seed)
    mod = dq.LayerNormMLP(HIDDEN, FFN, activation=activation, name="mlp", device=DEVICE, **kw)
    with torch.no_grad():
        mod.layer_norm_weight.uniform_(0.5, 1.5)
        mod.layer_norm_bias.uniform_(-0.5, 0.5)
    return mod


def inputs(seed: int = 0):
    torch.manual_seed(100 + seed)
    return torch.randn(6, 4, HIDDEN, device=DEVICE), torch.randn(6, 4, HIDDEN, device=DEVICE)


@pytest.mark.parametrize("activation", ["gelu", "swiglu"])
def test_disabled_autocast_is_plain_pytorch_math_bit_for_bit(activation):
    mod = make(activation)
    x, dy = inputs()
    got = run(mod, x, dy, enabled=False)

    x2, *params = leaves(x, *mod.parameters(), dtype=torch.float32)
    lw, lb, w1, b1, w2, b2 = params
    h = F.linear(F.layer_norm(x2, (HIDDEN,), lw, lb, 1e-5), w1, b1)
    if activation == "gelu":
        a = F.gelu(h, approximate="tanh")
    else:
        gate, up = h.chunk(2, -1)
        a = F.silu(gate) * up
    y = F.linear(a, w2, b2)
    y.backward(dy)
    for t, r in zip(got, [y, x2.grad] + [p.grad for p in params]):
        assert torch.equal(t, r)


def reference(
    mod, x, dy, activation: str, *, fp8: bool, fp8_fc1: bool = True, fp8_fc2: bool = True
):
    x64, *params = leaves(x, *mod.parameters())
    lw, lb, w1, b1, w2, b2 = params
    h = ref_linear(ref_norm(x64, lw, lb, "LayerNorm", 1e-5), w1, b1, fp8=fp8 and fp8_fc1)
    y = ref_linear(ref_activation(h, activation), w2, b2, fp8=fp8 and fp8_fc2)
    y.backward(dy.double())
    return [y, x64.grad] + [p.grad for p in params]


@pytest.mark.parametrize("activation", ["gelu", "swiglu"])
def test_current_scaling_matches_float64_rederivation(activation):
    mod = make(activation, seed=1)
    x, dy = inputs(1)
    got = run(mod, x, dy, dq.Float8CurrentScaling())
    names = ["output", "dgrad"] + [n for n, _ in mod.named_parameters()]
    ref8 = reference(mod, x, dy, activation, fp8=True)
    ref_hp = reference(mod, x, dy, activation, fp8=False)
    for name, a, r8, rhp in zip(names, got, ref8, ref_hp):
        assert_fp8_close(a, r8, rhp, name)


def test_fc1_and_fc2_use_their_own_slots():
    """fc2's roles in high precision, fc1's on current scaling: only fc1's GEMM triple rounds."""

    @dq.quantizer_factory(key="tests.fc1_only.v1")
    def fc1_only(role):
        if role is not None and role.name.endswith(".fc2"):
            return dq.IdentityQuantizer()
        return factories.current_scaling(role)

    mod = make(seed=2)
    x, dy = inputs(2)
    got = run(mod, x, dy, dq.CustomRecipe(fc1_only))
    names = ["output", "dgrad"] + [n for n, _ in mod.named_parameters()]
    ref8 = reference(mod, x, dy, "gelu", fp8=True, fp8_fc2=False)
    ref_hp = reference(mod, x, dy, "gelu", fp8=False)
    for name, a, r8, rhp in zip(names, got, ref8, ref_hp):
        assert_fp8_close(a, r8, rhp, name)
    fq = mod.quant_binding.runtime.fwd_quantizers
    assert [type(q).__name__ for q in fq] == [
        "Float8CurrentScalingQuantizer",
        "Float8CurrentScalingQuantizer",
        "IdentityQuantizer",
        "IdentityQuantizer",
        "IdentityQuantizer",
        "Float8CurrentScalingQuantizer",  # the output slot has no role: a bare role, not fc2's
    ]


@builtin_and_reference_factory
def test_custom_recipe_of_reference_factory_equals_builtin_bit_for_bit(builtin, factory):
    a, b = make("swiglu", seed=3), make("swiglu", seed=3)
    x, dy = inputs(3)
    assert_recipes_agree_bit_for_bit(a, b, x, dy, builtin, dq.CustomRecipe(factory))


def test_high_precision_recipe_equals_disabled_bit_for_bit():
    mod = make(seed=4)
    x, dy = inputs(4)
    for ta, tb in zip(run(mod, x, dy, enabled=False), run(mod, x, dy, dq.recipe_from_dict("bf16"))):
        assert torch.equal(ta, tb)


def test_roles_follow_transformer_engine_slot_order():
    mod = dq.LayerNormMLP(8, 16, name="layers.2.mlp")
    mod.output_quantizer_role = out = dq.QuantizerRole("linear", "input", "head")
    mod.grad_input_quantizer_role = gin = dq.QuantizerRole("linear", "grad_output", "prev")
    fwd = mod.get_quantizer_roles(fwd=True, num_quantizers=6)
    bwd = mod.get_quantizer_roles(fwd=False, num_quantizers=4)
    fc1, fc2 = "layers.2.mlp.fc1", "layers.2.mlp.fc2"
    assert fwd == [
        dq.QuantizerRole("linear", "input", fc1),
        dq.QuantizerRole("linear", "weight", fc1),
        dq.QuantizerRole("linear", "input", fc2),
        dq.QuantizerRole("linear", "input", fc2),
        dq.QuantizerRole("linear", "weight", fc2),
        out,
    ]
    assert bwd == [
        dq.QuantizerRole("linear", "grad_output", fc1),
        gin,
        dq.QuantizerRole("linear", "grad_output", fc2),
        dq.QuantizerRole("linear", "grad_output", fc1),
    ]
    with pytest.raises(ValueError, match="4 backward quantizer slots"):
        mod.get_quantizer_roles(fwd=False, num_quantizers=2)
    with pytest.raises(ValueError, match="activation"):
        dq.LayerNormMLP(8, 16, activation="relu")


def test_delayed_scaling_buffers_survive_an_output_role_change():
    mod = make(seed=5)
    x, dy = inputs(5)
    run(mod, x, dy, dq.DelayedScaling())
    groups = mod.quant_binding.runtime.fwd_state.delayed_groups()
    old = [(g.scale, g.amax_history, g.scale.clone(), g.amax_history.clone()) for g in groups]
    assert old[0][2].ne(1).any(), "one step must have moved the scales off their initial 1"
    mod.output_quantizer_role = dq.QuantizerRole("linear", "input", "head")
    with dq.autocast(recipe=dq.DelayedScaling()):
        runtime = active_runtime(mod)
    assert runtime.fwd_roles[5] == dq.QuantizerRole("linear", "input", "head")
    for g, (scale, hist, scale_val, hist_val) in zip(runtime.fwd_state.delayed_groups(), old):
        assert g.scale is scale and g.amax_history is hist
        assert torch.equal(g.scale, scale_val) and torch.equal(g.amax_history, hist_val)


def test_weight_cache_keeps_one_entry_per_gemm():
    mod = make(seed=6)
    x, _ = inputs(6)
    recipe = dq.Float8CurrentScaling()
    with dq.autocast(recipe=recipe):
        mod(x, is_first_microbatch=True)
    first = mod.quant_binding.cached_weights()
    assert sorted(first) == ["fc1_weight", "fc2_weight"]
    with dq.autocast(recipe=recipe):
        mod(x, is_first_microbatch=False)
    assert all(mod.quant_binding.cached_weight(k) is v for k, v in first.items())


class _UnfusedMLP(torch.nn.Module):
    """LayerNormMLP(activation="swiglu") written as the public pieces it fuses: LayerNormLinear,
    then torch's own `F.silu(gate) * up` in high precision, then Linear."""

    def __init__(self, mlp: dq.LayerNormMLP, dtype: torch.dtype) -> None:
        super().__init__()
        hidden, ffn = mlp.hidden_size, mlp.ffn_hidden_size
        kw = dict(device=DEVICE, params_dtype=dtype, bias=mlp.fc1_bias is not None)
        self.fc1 = dq.LayerNormLinear(hidden, 2 * ffn, name="unfused.fc1", **kw)
        self.fc2 = dq.Linear(ffn, hidden, name="unfused.fc2", **kw)
        with torch.no_grad():
            for dst, src in zip(self.parameters(), mlp.parameters(), strict=True):
                dst.copy_(src)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.fc1(x).chunk(2, dim=-1)
        return self.fc2(F.silu(gate) * up)


@pytest.mark.parametrize("bias", [True, False], ids=["bias", "no_bias"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    "recipe",
    [dq.DelayedScaling(amax_history_len=4), dq.Float8CurrentScaling()],
    ids=["delayed", "current"],
)
def test_swiglu_fused_into_fc2_cast_gives_the_unfused_bits_and_amaxes(
    monkeypatch, recipe, dtype, bias
):
    """Per-tensor fc2 inputs take the fused SwiGLU -> cast (the high-precision activation is
    never formed: `activate` must not run) and give, over three steps whose growing input moves
    delayed scaling's scales by the recorded amaxes, the bits of the unfused pieces; delayed
    scaling's amax history of fc2's input equals the unfused Linear's, row for row. Without a
    bias the backward fuses too (SwiGLU's gradient cast straight to fc1's grad-output FP8, the
    high-precision gradient never formed: `swiglu_backward` must not run) and fc1's grad-output
    amax history equals the unfused LayerNormLinear's; with fc1's bias (its gradient sums the
    high-precision gradient) it does not."""
    mod = make("swiglu", seed=7, params_dtype=dtype, bias=bias)
    unfused = _UnfusedMLP(mod, dtype)
    x, dy = (t.to(dtype) for t in inputs(7))
    fused_bwd = []

    def not_called(*args):
        raise AssertionError("an unfused SwiGLU op ran")

    def counted(self, dy, h, *, transpose):
        fused_bwd.append(transpose)
        return cast_swiglu_backward[type(self)](self, dy, h, transpose=transpose)

    quantizers = (dq.Float8Quantizer, dq.Float8CurrentScalingQuantizer)
    cast_swiglu_backward = {q: q.cast_swiglu_backward for q in quantizers}
    for step in range(3):
        with monkeypatch.context() as patch:
            patch.setattr(layernorm_mlp, "activate", not_called)
            if not bias:
                patch.setattr(functional, "swiglu_backward", not_called)
            for q in quantizers:
                patch.setattr(q, "cast_swiglu_backward", counted)
            got = run(mod, x * (step + 1), dy, recipe)
        want = run(unfused, x * (step + 1), dy, recipe)
        for a, b in zip(got, want, strict=True):
            assert a.dtype == b.dtype and torch.equal(a, b)
    assert fused_bwd == ([] if bias else [True] * 3)  # the weight gradient needs the transpose
    if isinstance(recipe, dq.DelayedScaling):
        (fused,) = mod.quant_binding.runtime.fwd_state.delayed_groups()
        (fc2,) = unfused.fc2.quant_binding.runtime.fwd_state.delayed_groups()
        # fc2's input is the module's slot 3, Linear's slot 0; three steps' amaxes, all > 0
        assert fused.amax_history[1:, 3].gt(0).all()
        assert torch.equal(fused.amax_history[:, 3], fc2.amax_history[:, 0])
        assert torch.equal(fused.scale[3], fc2.scale[0])
        # fc1's grad output: the module's backward slot 0, LayerNormLinear's backward slot 0
        (fused,) = mod.quant_binding.runtime.bwd_state.delayed_groups()
        (fc1,) = unfused.fc1.quant_binding.runtime.bwd_state.delayed_groups()
        assert fused.amax_history[1:, 0].gt(0).all()
        assert torch.equal(fused.amax_history[:, 0], fc1.amax_history[:, 0])
        assert torch.equal(fused.scale[0], fc1.scale[0])


def test_swiglu_is_not_fused_where_fc2_input_is_not_per_tensor(monkeypatch):
    """MXFP8 (a per-block fc2 input) keeps the unfused activation: `activate` runs once."""
    mod = make("swiglu", seed=8)
    x, dy = inputs(8)
    calls = []

    def counted(h, activation):
        calls.append(activation)
        return layernorm_mlp.SwiGLU.apply(h)

    monkeypatch.setattr(layernorm_mlp, "activate", counted)
    run(mod, x, dy, dq.MXFP8BlockScaling())
    assert calls == ["swiglu"]
