"""TransformerLayer: exact when disabled, FP8 as re-derived, and the roles a layer stack emits."""

import torch
import torch.nn.functional as F
from module_ref import (
    DEVICE,
    assert_fp8_close,
    leaves,
    math_sdpa,
    ref_activation,
    ref_attention,
    ref_linear,
    ref_norm,
    sdpa_plain,
)
from module_step import run

import dist_quant as dq
from dist_quant import factories

S, B, HIDDEN, FFN, HEADS = 8, 2, 32, 64, 2
D = HIDDEN // HEADS


def make_layer(seed: int = 0, **kw) -> dq.TransformerLayer:
    torch.manual_seed(seed)
    layer = dq.TransformerLayer(HIDDEN, FFN, HEADS, device=DEVICE, **kw)
    with torch.no_grad():
        for name, p in layer.named_parameters():
            if name.endswith("layer_norm_weight"):
                p.uniform_(0.5, 1.5)
            elif name.endswith("layer_norm_bias"):
                p.uniform_(-0.5, 0.5)
    return layer


def inputs(seed: int = 0):
    torch.manual_seed(100 + seed)
    return torch.randn(S, B, HIDDEN, device=DEVICE), torch.randn(S, B, HIDDEN, device=DEVICE)


def test_disabled_autocast_is_plain_pytorch_math_bit_for_bit():
    layer = make_layer()
    x, dy = inputs()
    with math_sdpa():
        got = run(layer, x, dy, enabled=False)
        x2, *params = leaves(x, *layer.parameters(), dtype=torch.float32)
        ln1_w, ln1_b, wqkv, bqkv, wo, bo, ln2_w, ln2_b, w1, b1, w2, b2 = params
        mixed = F.linear(F.layer_norm(x2, (HIDDEN,), ln1_w, ln1_b, 1e-5), wqkv, bqkv)
        q, k, v = mixed.reshape(S, B, 3, HEADS, D).unbind(2)
        h = x2 + F.linear(sdpa_plain(q, k, v, "causal"), wo, bo)
        mlp_in = F.layer_norm(h, (HIDDEN,), ln2_w, ln2_b, 1e-5)
        a = F.gelu(F.linear(mlp_in, w1, b1), approximate="tanh")
        y = h + F.linear(a, w2, b2)
        y.backward(dy)
    for t, r in zip(got, [y, x2.grad] + [p.grad for p in params]):
        assert torch.equal(t, r)


def test_current_scaling_matches_float64_rederivation():
    """Float8CurrentScaling without fp8_dpa: every GEMM in FP8, attention in high precision."""
    layer = make_layer(1)
    x, dy = inputs(1)
    got = run(layer, x, dy, dq.Float8CurrentScaling())
    masked = torch.ones(S, S, dtype=torch.bool, device=DEVICE).triu(1)

    def reference(fp8: bool):
        x64, *params = leaves(x, *layer.parameters())
        ln1_w, ln1_b, wqkv, bqkv, wo, bo, ln2_w, ln2_b, w1, b1, w2, b2 = params
        mixed = ref_linear(ref_norm(x64, ln1_w, ln1_b, "LayerNorm", 1e-5), wqkv, bqkv, fp8=fp8)
        q, k, v = mixed.reshape(S, B, 3, HEADS, D).unbind(2)
        ctx = ref_attention(*(t.permute(1, 2, 0, 3) for t in (q, k, v)), masked, fp8=False)
        h = x64 + ref_linear(ctx.permute(2, 0, 1, 3).reshape(S, B, HIDDEN), wo, bo, fp8=fp8)
        mlp_in = ref_norm(h, ln2_w, ln2_b, "LayerNorm", 1e-5)
        h1 = ref_linear(mlp_in, w1, b1, fp8=fp8)
        y = h + ref_linear(ref_activation(h1, "gelu"), w2, b2, fp8=fp8)
        y.backward(dy.double())
        return [y, x64.grad] + [p.grad for p in params]

    names = ["output", "dgrad"] + [n for n, _ in layer.named_parameters()]
    for name, a, r8, rhp in zip(names, got, reference(True), reference(False)):
        assert_fp8_close(a, r8, rhp, name)


class Stack(torch.nn.Module):
    def __init__(self, n: int = 4) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layers = torch.nn.ModuleList(
            dq.TransformerLayer(HIDDEN, FFN, HEADS, device=DEVICE) for _ in range(n)
        )

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


def expected_roles(n: int) -> set[tuple[str, str, str]]:
    roles = set()
    for i in range(n):
        attn, mlp = f"layers.{i}.self_attention", f"layers.{i}.mlp"
        for gemm in (f"{attn}.qkv", f"{attn}.proj", f"{mlp}.fc1", f"{mlp}.fc2"):
            roles |= {("linear", t, gemm) for t in ("input", "weight", "grad_output")}
        roles |= {("dpa", t, f"{attn}.core_attention") for t in ("qkv", "s", "do", "dp")}
    return roles | {None}  # slots no module wired (the MLP's output, qkv's grad input)


def test_factory_sees_every_role_of_a_four_layer_model_with_its_module_type():
    seen = []

    @dq.quantizer_factory(key="tests.logging_current.v1")
    def logging_factory(role):
        seen.append(None if role is None else (role.module_type, role.tensor_type, role.name))
        return factories.current_scaling(role)

    model = Stack(4)
    x = torch.randn(S, B, HIDDEN, device=DEVICE, requires_grad=True)
    with dq.autocast(recipe=dq.CustomRecipe(logging_factory, fp8_dpa=True)):
        y = model(x)
    y.sum().backward()
    # attention's o / dqkv slots carry the consuming linears' roles (MHA wiring), so dpa/o and
    # dpa/dqkv never reach the factory in this model
    assert set(seen) == expected_roles(4)
    assert x.grad is not None and torch.isfinite(x.grad).all()


def test_per_layer_targeting_keeps_first_and_last_layer_in_high_precision():
    model = Stack(4)
    x = torch.randn(S, B, HIDDEN, device=DEVICE, requires_grad=True)
    with dq.autocast(recipe=dq.CustomRecipe(factories.bf16_first_last(4))):
        model(x).sum().backward()
    for i, layer in enumerate(model.layers):
        attn, mlp = layer.self_attention, layer.mlp
        gemm_inputs = {
            "qkv": (attn.qkv, 0),
            "proj": (attn.proj, 0),
            "fc1": (mlp, 0),  # LayerNormMLP: fc1 input slot 0, fc2 input slot 3
            "fc2": (mlp, 3),
            "attention qkv": (attn.core_attention, 0),
        }
        expected = dq.IdentityQuantizer if i in (0, 3) else dq.Float8CurrentScalingQuantizer
        for what, (module, slot) in gemm_inputs.items():
            got = module.quant_binding.runtime.fwd_quantizers[slot]
            assert type(got) is expected, f"layer {i} {what}: {type(got).__name__}"
        for module, slot in ((attn.qkv, 0), (attn.proj, 0), (mlp, 0), (mlp, 2)):  # grad outputs
            assert type(module.quant_binding.runtime.bwd_quantizers[slot]) is expected


def test_explicit_layer_name_prefixes_the_children():
    layer = make_layer(2, name="blocks.7")
    with dq.autocast():
        layer(torch.randn(S, B, HIDDEN, device=DEVICE))
    assert layer.self_attention.qkv.role_name == "blocks.7.self_attention.qkv"
    assert layer.self_attention.core_attention.role_name == "blocks.7.self_attention.core_attention"
    assert layer.mlp.quant_binding.runtime.fwd_roles[3] == dq.QuantizerRole(
        "linear", "input", "blocks.7.mlp.fc2"
    )
