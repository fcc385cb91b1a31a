"""DotProductAttention and MultiheadAttention: exact SDPA when not FP8, emulated FP8 attention as
re-derived in float64, boundary roles wired between the children."""

import pytest
import torch
from module_ref import (
    DEVICE,
    E4M3,
    E5M2,
    assert_fp8_close,
    leaves,
    math_sdpa,
    ref_attention,
    ref_linear,
    sdpa_plain,
)

import dist_quant as dq
from dist_quant import factories
from dist_quant.forward import active_runtime
from dist_quant.kinds import Direction

S, B, H, D = 12, 2, 2, 16
FP8_DPA = dq.Float8CurrentScaling(fp8_dpa=True)


def qkv(seed: int = 0, s_kv: int = S):
    torch.manual_seed(seed)
    q = torch.randn(S, B, H, D, device=DEVICE)
    k, v = (torch.randn(s_kv, B, H, D, device=DEVICE) for _ in range(2))
    return q, k, v, torch.randn(S, B, H * D, device=DEVICE)


def padding_mask(s_kv: int = S) -> torch.Tensor:
    mask = torch.zeros(B, 1, 1, s_kv, dtype=torch.bool, device=DEVICE)
    mask[1, ..., s_kv - 3 :] = True  # the second sequence has 3 padded keys
    return mask


def run_dpa(dpa, q, k, v, do, mask=None, recipe=None, enabled=True):
    q, k, v = leaves(q, k, v, dtype=torch.float32)
    with dq.autocast(enabled=enabled, recipe=recipe):
        out = dpa(q, k, v, mask)
    out.backward(do)
    return [out.detach(), q.grad, k.grad, v.grad]


@pytest.mark.parametrize("mask_type", ["causal", "padding", "no_mask"])
@pytest.mark.parametrize(
    "recipe", [None, dq.Float8CurrentScaling()], ids=["disabled", "no_fp8_dpa"]
)
def test_attention_without_fp8_dpa_is_sdpa_bit_for_bit(mask_type, recipe):
    """autocast off, or a recipe without fp8_dpa: PyTorch's SDPA exactly (the roles still exist)."""
    dpa = dq.DotProductAttention(H, D, attn_mask_type=mask_type, name="attn", device=DEVICE)
    q, k, v, do = qkv()
    mask = padding_mask() if mask_type == "padding" else None
    with math_sdpa():
        got = run_dpa(dpa, q, k, v, do, mask, recipe=recipe, enabled=recipe is not None)
        q2, k2, v2 = leaves(q, k, v, dtype=torch.float32)
        out = sdpa_plain(q2, k2, v2, mask_type, mask)
        out.backward(do)
    for a, b in zip(got, [out, q2.grad, k2.grad, v2.grad]):
        assert torch.equal(a, b)
    if recipe is not None:
        assert [str(r) for r in dpa.quant_binding.runtime.fwd_roles] == [
            "dpa/qkv@attn",
            "dpa/s@attn",
            "dpa/o@attn",
        ]
        assert [str(r) for r in dpa.quant_binding.runtime.bwd_roles] == [
            "dpa/do@attn",
            "dpa/dp@attn",
            "dpa/dqkv@attn",
        ]


@pytest.mark.parametrize("mask_type", ["causal", "padding_causal"])
def test_fp8_attention_matches_float64_rederivation(mask_type):
    dpa = dq.DotProductAttention(H, D, attn_mask_type=mask_type, name="attn", device=DEVICE)
    q, k, v, do = qkv(1)
    mask = padding_mask() if mask_type == "padding_causal" else None
    got = run_dpa(dpa, q, k, v, do, mask, recipe=FP8_DPA)

    masked = torch.ones(S, S, dtype=torch.bool, device=DEVICE).triu(1)
    if mask is not None:
        masked = masked | mask

    def reference(fp8: bool):
        q64, k64, v64 = leaves(q, k, v)
        out = ref_attention(*(t.permute(1, 2, 0, 3) for t in (q64, k64, v64)), masked, fp8=fp8)
        out = out.permute(2, 0, 1, 3).reshape(S, B, H * D)
        out.backward(do.double())
        return [out, q64.grad, k64.grad, v64.grad]

    for name, a, r8, rhp in zip(["o", "dq", "dk", "dv"], got, reference(True), reference(False)):
        assert_fp8_close(a, r8, rhp, name)


def test_bshd_layout_equals_sbhd_layout():
    q, k, v, do = qkv(2)
    a = dq.DotProductAttention(H, D, name="attn", device=DEVICE)
    b = dq.DotProductAttention(H, D, qkv_format="bshd", name="attn", device=DEVICE)
    ra = run_dpa(a, q, k, v, do, recipe=FP8_DPA)
    rb = run_dpa(b, *(t.transpose(0, 1) for t in (q, k, v, do)), recipe=FP8_DPA)
    for x, y in zip(ra, rb):
        assert torch.equal(x, y.transpose(0, 1))


def test_fp8_attention_rejects_block_scaling_on_an_attention_role():
    @dq.quantizer_factory(key="tests.block_softmax.v1")
    def block_softmax(role):
        if role.tensor_type == "s":
            return dq.Float8BlockQuantizer()
        return factories.current_scaling(role)

    dpa = dq.DotProductAttention(H, D, name="attn", device=DEVICE)
    q, k, v, do = qkv(3)
    with pytest.raises(ValueError, match=r"'attn'.*dpa/s@attn.*Float8BlockQuantizer"):
        run_dpa(dpa, q, k, v, do, recipe=dq.CustomRecipe(block_softmax, fp8_dpa=True))
    # the same factory without fp8_dpa never runs FP8 attention: plain SDPA, no error
    run_dpa(dpa, q, k, v, do, recipe=dq.CustomRecipe(block_softmax))
    run_dpa(dpa, q, k, v, do, recipe=dq.Float8BlockScaling())


def test_padding_mask_is_required_exactly_for_padding_types():
    q, k, v, _ = qkv(4)
    with pytest.raises(ValueError, match="DotProductAttention 'a': .*needs an attention_mask"):
        dq.DotProductAttention(H, D, attn_mask_type="padding", name="a")(q, k, v)
    with pytest.raises(ValueError, match="DotProductAttention 'a': .*takes no attention_mask"):
        dq.DotProductAttention(H, D, name="a")(q, k, v, padding_mask())
    with pytest.raises(ValueError, match="DotProductAttention 'a': query .*2 heads of 16"):
        dq.DotProductAttention(H, D, name="a")(q[..., :8], k, v)


# ---- MultiheadAttention ----------------------------------------------------------------------
HIDDEN = H * D


class Block(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.attn = dq.MultiheadAttention(HIDDEN, H, input_layernorm=True, device=DEVICE)

    def forward(self, x):
        return self.attn(x)


def boundary_roles(mha: dq.MultiheadAttention) -> dict[str, dq.QuantizerRole | None]:
    return {
        "qkv.output": mha.qkv.output_quantizer_role,
        "proj.grad_input": mha.proj.grad_input_quantizer_role,
        "dpa.output": mha.core_attention.output_quantizer_role,
        "dpa.grad_input": mha.core_attention.grad_input_quantizer_role,
    }


EXPECTED_BOUNDARY = {
    "qkv.output": dq.QuantizerRole("dpa", "qkv", "attn.core_attention"),
    "proj.grad_input": dq.QuantizerRole("dpa", "do", "attn.core_attention"),
    "dpa.output": dq.QuantizerRole("linear", "input", "attn.proj"),
    "dpa.grad_input": dq.QuantizerRole("linear", "grad_output", "attn.qkv"),
}


def test_mha_wires_boundary_roles_when_first_planned_and_a_forward_never_rewires_them():
    block = Block()
    assert boundary_roles(block.attn)["qkv.output"] is None
    dq.apply_recipe(block, dq.Float8CurrentScaling())  # plans before any forward
    assert boundary_roles(block.attn) == EXPECTED_BOUNDARY
    assert block.attn.qkv.quant_binding.runtime.fwd_roles[2] == EXPECTED_BOUNDARY["qkv.output"]
    assert (
        block.attn.core_attention.quant_binding.runtime.bwd_roles[2]
        == EXPECTED_BOUNDARY["dpa.grad_input"]
    )

    block.attn.proj.grad_input_quantizer_role = None  # set by hand after the plan: it stays
    with dq.autocast():
        block(torch.randn(S, B, HIDDEN, device=DEVICE))
    dq.apply_recipe(block, dq.Float8CurrentScaling())  # a later plan does not rewire either
    assert boundary_roles(block.attn) == {**EXPECTED_BOUNDARY, "proj.grad_input": None}
    assert block.attn.proj.quant_binding.runtime.bwd_roles[1] is None


def test_setting_an_equal_role_does_not_rebuild():
    calls = []

    @dq.quantizer_factory(key="tests.counting_current.v1")
    def counting(role):
        calls.append(role)
        return factories.current_scaling(role)

    block = Block()
    recipe = dq.CustomRecipe(counting)
    x = torch.randn(S, B, HIDDEN, device=DEVICE)
    with dq.autocast(recipe=recipe):
        block(x)
    children = [block.attn.qkv, block.attn.core_attention, block.attn.proj]
    runtimes = [c.quant_binding.runtime for c in children]
    revisions = [c.quant_binding.role_revision for c in children]
    n_calls = len(calls)
    # equal but distinct role objects, then two more forwards that rewire them
    block.attn.qkv.output_quantizer_role = dq.QuantizerRole("dpa", "qkv", "attn.core_attention")
    for _ in range(2):
        with dq.autocast(recipe=recipe):
            block(x)
    assert [c.quant_binding.runtime for c in children] == runtimes
    assert all(a is b for a, b in zip((c.quant_binding.runtime for c in children), runtimes))
    assert [c.quant_binding.role_revision for c in children] == revisions
    assert len(calls) == n_calls


def test_dpa_delayed_scaling_buffers_survive_a_role_change():
    dpa = dq.DotProductAttention(H, D, name="attn", device=DEVICE)
    q, k, v, do = qkv(5)
    recipe = dq.DelayedScaling(fp8_dpa=True)
    run_dpa(dpa, q, k, v, do, recipe=recipe)
    states = [dpa.quant_binding.runtime.fwd_state, dpa.quant_binding.runtime.bwd_state]
    old = [(s.scale, s.amax_history, s.scale.clone(), s.amax_history.clone()) for s in states]
    assert all(o[2].ne(1).any() for o in old), "one step must have moved the scales off 1"
    dpa.output_quantizer_role = dq.QuantizerRole("linear", "input", "proj")
    dpa.grad_input_quantizer_role = dq.QuantizerRole("linear", "grad_output", "qkv")
    with dq.autocast(recipe=recipe):
        runtime = active_runtime(dpa)
    assert runtime.fwd_roles[2] == dq.QuantizerRole("linear", "input", "proj")
    for s, (scale, hist, scale_val, hist_val) in zip([runtime.fwd_state, runtime.bwd_state], old):
        assert s.scale is scale and s.amax_history is hist
        assert torch.equal(s.scale, scale_val) and torch.equal(s.amax_history, hist_val)


def test_fp8_attention_backward_reduces_over_the_group_its_forward_ran_under(backward_reductions):
    # the flash path's backward enrols the `do` / `dp` groups with its plan's copy of the
    # reduction group: a second forward under another group before the first one's backward must
    # not redirect that backward's amax reduction
    dpa = dq.DotProductAttention(H, D, name="attn", device=DEVICE)
    dq.apply_recipe(dpa, dq.DelayedScaling(fp8_dpa=True))
    q, k, v = leaves(*qkv(6)[:3], dtype=torch.float32)
    first, second = object(), object()
    with dq.autocast(amax_reduction_group=first):
        out_first = dpa(q, k, v)
    plan = dpa.quant_binding.forward_plan
    assert plan.gemms[0].flash and plan.reduction_group is first
    with dq.autocast(amax_reduction_group=second):
        dpa(q, k, v)
    out_first.sum().backward()
    assert backward_reductions == [(Direction.BACKWARD, first)]


@pytest.mark.parametrize("fp8_mha", [False, True])
def test_mha_matches_float64_rederivation(fp8_mha):
    """qkv LayerNormLinear -> FP8 attention -> proj Linear; with fp8_mha the qkv output and the
    proj input gradient also round through their boundary slots (dpa/qkv: E4M3, dpa/do: E5M2)."""
    torch.manual_seed(6)
    mha = dq.MultiheadAttention(HIDDEN, H, name="attn", device=DEVICE)
    x = torch.randn(S, B, HIDDEN, device=DEVICE, requires_grad=True)
    dy = torch.randn(S, B, HIDDEN, device=DEVICE)
    with dq.autocast(recipe=dq.Float8CurrentScaling(fp8_dpa=True, fp8_mha=fp8_mha)):
        y = mha(x)
    y.backward(dy)
    got = [y, x.grad] + [p.grad for p in mha.parameters()]
    masked = torch.ones(S, S, dtype=torch.bool, device=DEVICE).triu(1)

    def reference(fp8: bool):
        x64, *params = leaves(x, *mha.parameters())
        wq, bq, wp, bp = params
        mixed = ref_linear(x64, wq, bq, fp8=fp8, out=E4M3 if fp8_mha else None)
        q, k, v = mixed.reshape(S, B, 3, H, D).unbind(2)
        ctx = ref_attention(*(t.permute(1, 2, 0, 3) for t in (q, k, v)), masked, fp8=fp8)
        ctx = ctx.permute(2, 0, 1, 3).reshape(S, B, HIDDEN)
        out = ref_linear(ctx, wp, bp, fp8=fp8, grad_in=E5M2 if fp8_mha else None)
        out.backward(dy.double())
        return [out, x64.grad] + [p.grad for p in params]

    names = ["output", "dgrad"] + [n for n, _ in mha.named_parameters()]
    for name, a, r8, rhp in zip(names, got, reference(True), reference(False)):
        assert_fp8_close(a, r8, rhp, name)
