"""Grouped-query attention (`num_gqa_groups`): exact against attention on repeated key/value heads
without FP8, as re-derived in float64 with FP8 linears and with emulated FP8 attention (current
and delayed scaling, two steps so that delayed scales come from the first step's amaxes), the
fused qkv weight's shape and layout, and the constructor's checks."""

import pytest
import torch
import torch.nn.functional as F
from gqa_ref import Scaling, gqa_attention, layer_norm, linear
from module_ref import DEVICE, assert_fp8_close, leaves, math_sdpa

import dist_quant as dq
from dist_quant.modules import attention

S, B, H, D = 12, 2, 4, 8
HIDDEN = H * D
RECIPES = {
    "current": lambda **kw: dq.Float8CurrentScaling(**kw),
    "delayed": lambda **kw: dq.DelayedScaling(amax_history_len=4, **kw),
}


def causal() -> torch.Tensor:
    return torch.ones(S, S, dtype=torch.bool, device=DEVICE).triu(1)


def padding_mask() -> torch.Tensor:
    mask = torch.zeros(B, 1, 1, S, dtype=torch.bool, device=DEVICE)
    mask[1, ..., S - 3 :] = True  # the second sequence has 3 padded keys
    return mask


def qkv(groups: int, seed: int = 0, dtype=torch.float32):
    g = torch.Generator(device="cpu").manual_seed(seed)
    q = torch.randn(S, B, H, D, generator=g)
    k, v = (torch.randn(S, B, groups, D, generator=g) for _ in range(2))
    do = torch.randn(S, B, H * D, generator=g)
    return [t.to(DEVICE, dtype) for t in (q, k, v, do)]


def run_dpa(dpa, q, k, v, do, mask=None, recipe=None):
    q, k, v = leaves(q, k, v, dtype=q.dtype)
    with dq.autocast(enabled=recipe is not None, recipe=recipe):
        out = dpa(q, k, v, mask)
    out.backward(do)
    return [out.detach(), q.grad, k.grad, v.grad]


def sdpa_on_repeated_kv(q, k, v, do, mask_type: str, mask):
    """PyTorch's SDPA on (s, b, h, d) tensors after repeating each KV head for its query group."""
    q, k, v = leaves(q, k, v, dtype=q.dtype)
    rep = H // k.shape[2]
    qb, kb, vb = (t.permute(1, 2, 0, 3) for t in (q, k, v))
    kb, vb = kb.repeat_interleave(rep, dim=1), vb.repeat_interleave(rep, dim=1)
    if mask_type == "causal":
        out = F.scaled_dot_product_attention(qb, kb, vb, is_causal=True)
    else:
        out = F.scaled_dot_product_attention(qb, kb, vb, attn_mask=None if mask is None else ~mask)
    out = out.permute(2, 0, 1, 3).reshape(S, B, H * D)
    out.backward(do)
    return [out.detach(), q.grad, k.grad, v.grad]


@pytest.mark.parametrize("sdpa_gqa", [True, False], ids=["enable_gqa", "repeat_interleave"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("groups", [2, 1], ids=["gqa2", "mqa"])
@pytest.mark.parametrize("mask_type", ["causal", "padding", "no_mask"])
def test_gqa_without_fp8_attention_is_sdpa_on_repeated_kv_bit_for_bit(
    mask_type, groups, dtype, sdpa_gqa, monkeypatch
):
    """Both ways of broadcasting KV heads (SDPA's `enable_gqa`, torch >= 2.5, and the repeat used
    before it) give SDPA's result on explicitly repeated heads, values and gradients, bit for bit,
    with one exception: in bf16, `enable_gqa` sums dk and dv over the query group in fp32 before
    their one rounding to bf16 (the repeat rounds each head's share first), so those two may
    differ in the last bits, and are then closer to float64 attention. In fp32 every result is
    also plain softmax attention in float64 to fp32 accuracy."""
    if not sdpa_gqa:
        monkeypatch.setattr(attention, "_SDPA_HAS_GQA", False)
    elif not attention._SDPA_HAS_GQA:
        pytest.skip("this torch's SDPA has no enable_gqa")
    dpa = dq.DotProductAttention(H, D, num_gqa_groups=groups, attn_mask_type=mask_type)
    q, k, v, do = qkv(groups, dtype=dtype)
    mask = padding_mask() if mask_type == "padding" else None
    with math_sdpa():
        got = run_dpa(dpa.to(DEVICE), q, k, v, do, mask)
        want = sdpa_on_repeated_kv(q, k, v, do, mask_type, mask)
    masked = causal() if mask_type == "causal" else mask
    q64, k64, v64 = leaves(q, k, v)
    out = gqa_attention(
        *(t.permute(1, 2, 0, 3) for t in (q64, k64, v64)), masked, Scaling("none"), fp8=False
    )
    out = out.permute(2, 0, 1, 3).reshape(S, B, H * D)
    out.backward(do.double())
    ref64 = [out, q64.grad, k64.grad, v64.grad]
    summed_in_fp32 = dtype is torch.bfloat16 and sdpa_gqa and groups < H
    for name, a, b, r in zip(["o", "dq", "dk", "dv"], got, want, ref64):
        assert a.dtype == dtype
        err = ((a.double() - r).norm() / r.norm()).item()
        if summed_in_fp32 and name in ("dk", "dv"):
            assert err <= ((b.double() - r).norm() / r.norm()).item() and err < 2**-8, name
            continue
        assert torch.equal(a, b), name
        if dtype is torch.float32:
            assert err < 1e-6, f"{name}: {err:.2e} from float64 attention"


def dpa_reference(q, k, v, do, masked, sc: Scaling) -> list[torch.Tensor]:
    q64, k64, v64 = leaves(q, k, v)
    out = gqa_attention(*(t.permute(1, 2, 0, 3) for t in (q64, k64, v64)), masked, sc)
    out = out.permute(2, 0, 1, 3).reshape(S, B, H * D)
    out.backward(do.double())
    sc.step()
    return [out, q64.grad, k64.grad, v64.grad]


@pytest.mark.parametrize("recipe", list(RECIPES))
@pytest.mark.parametrize("mask_type", ["causal", "padding_causal"])
def test_gqa_fp8_attention_matches_float64_rederivation(mask_type, recipe):
    """k, v, dk and dv are rounded at KV-head shape (dk, dv after summing their query group):
    a rounding after the repeat would give each query head's copy its own rounding (and, under
    delayed scaling, another amax in the second step's scale)."""
    dpa = dq.DotProductAttention(H, D, num_gqa_groups=2, attn_mask_type=mask_type).to(DEVICE)
    mask = padding_mask() if mask_type == "padding_causal" else None
    masked = causal() if mask is None else causal() | mask
    ref8, ref_hp = Scaling(recipe), Scaling("none")
    for step in range(2):
        q, k, v, do = qkv(2, seed=step)
        got = run_dpa(dpa, q, k, v, do, mask, RECIPES[recipe](fp8_dpa=True))

        for name, a, r8, rhp in zip(
            ["o", "dq", "dk", "dv"],
            got,
            dpa_reference(q, k, v, do, masked, ref8),
            dpa_reference(q, k, v, do, masked, ref_hp),
        ):
            assert_fp8_close(a, r8, rhp, f"step {step} {name}")


def mha(groups: int, seed: int = 0, kv_channels: int | None = None) -> dq.MultiheadAttention:
    torch.manual_seed(seed)
    m = dq.MultiheadAttention(
        HIDDEN, H, num_gqa_groups=groups, kv_channels=kv_channels, input_layernorm=True, name="attn"
    )
    with torch.no_grad():
        m.qkv.layer_norm_weight.uniform_(0.5, 1.5)
        m.qkv.layer_norm_bias.uniform_(-0.5, 0.5)
    return m.to(DEVICE)


def mha_reference(m, x, dy, sc: Scaling, *, fp8_dpa: bool):
    """norm -> qkv GEMM -> [q; k; v] rows split into query and KV heads -> attention -> proj."""
    x64, ln_w, ln_b, wqkv, bqkv, wp, bp = leaves(x, *m.parameters())
    g, d = m.num_gqa_groups, m.kv_channels
    mixed = linear(layer_norm(x64, ln_w, ln_b), wqkv, bqkv, sc, "qkv")
    q, k, v = mixed.split([H * d, g * d, g * d], dim=-1)
    q, k, v = (t.reshape(S, B, -1, d).permute(1, 2, 0, 3) for t in (q, k, v))
    ctx = gqa_attention(q, k, v, causal(), sc, fp8=fp8_dpa)
    out = linear(ctx.permute(2, 0, 1, 3).reshape(S, B, H * d), wp, bp, sc, "proj")
    out.backward(dy.double())
    sc.step()
    return [out, x64.grad, ln_w.grad, ln_b.grad, wqkv.grad, bqkv.grad, wp.grad, bp.grad]


@pytest.mark.parametrize("kv_channels", [None, 2 * D], ids=["d=hidden/heads", "d=2*hidden/heads"])
@pytest.mark.parametrize("fp8_dpa", [False, True], ids=["fp8_linears", "fp8_linears_and_dpa"])
@pytest.mark.parametrize("recipe", list(RECIPES))
def test_gqa_mha_matches_float64_rederivation(recipe, fp8_dpa, kv_channels):
    """The three GEMMs in FP8, attention in high precision (SDPA with KV broadcast) or emulated
    FP8; two steps. Under fp8_dpa attention's `o` and `dqkv` slots (roles of proj's input and
    qkv's output gradient) round with attention's own quantizers, and the linears round again.
    With `kv_channels` the heads are wider than hidden / heads and proj maps them back."""
    m = mha(groups=2, seed=1, kv_channels=kv_channels)
    d = kv_channels or D
    assert m.qkv.weight.shape == ((H + 2 * 2) * d, HIDDEN) and m.proj.weight.shape == (
        HIDDEN,
        H * d,
    )
    ref8, ref_hp = Scaling(recipe), Scaling("none")
    names = ["output", "dgrad"] + [n for n, _ in m.named_parameters()]
    for step in range(2):
        g = torch.Generator(device="cpu").manual_seed(10 + step)
        x = torch.randn(S, B, HIDDEN, generator=g).to(DEVICE).requires_grad_(True)
        dy = torch.randn(S, B, HIDDEN, generator=g).to(DEVICE)
        m.zero_grad(set_to_none=True)
        with dq.autocast(recipe=RECIPES[recipe](fp8_dpa=fp8_dpa)):
            y = m(x)
        y.backward(dy)
        got = [y.detach(), x.grad] + [p.grad for p in m.parameters()]
        r8 = mha_reference(m, x, dy, ref8, fp8_dpa=fp8_dpa)
        rhp = mha_reference(m, x, dy, ref_hp, fp8_dpa=False)
        for name, a, w8, whp in zip(names, got, r8, rhp):
            assert_fp8_close(a, w8, whp, f"step {step} {name}")


def test_gqa_transformer_layer_disabled_is_plain_pytorch_math_bit_for_bit():
    torch.manual_seed(3)
    ffn = 64
    layer = dq.TransformerLayer(
        HIDDEN, ffn, H, num_gqa_groups=1, normalization="RMSNorm", activation="swiglu", bias=False
    ).to(DEVICE)
    shapes = {n: tuple(p.shape) for n, p in layer.named_parameters()}
    assert shapes["self_attention.qkv.weight"] == ((H + 2) * D, HIDDEN)
    assert shapes["self_attention.proj.weight"] == (HIDDEN, HIDDEN)
    g = torch.Generator(device="cpu").manual_seed(4)
    x, dy = (torch.randn(S, B, HIDDEN, generator=g).to(DEVICE) for _ in range(2))
    with math_sdpa():
        xa = x.clone().requires_grad_(True)
        y = layer(xa)
        y.backward(dy)
        got = [y.detach(), xa.grad] + [p.grad for p in layer.parameters()]
        x2, *params = leaves(x, *layer.parameters(), dtype=torch.float32)
        ln1, wqkv, wo, ln2, w1, w2 = params
        mixed = F.linear(F.rms_norm(x2, (HIDDEN,), ln1, 1e-5), wqkv)
        q, k, v = mixed.split([H * D, D, D], dim=-1)
        q, k, v = (t.reshape(S, B, -1, D).permute(1, 2, 0, 3) for t in (q, k, v))
        ctx = F.scaled_dot_product_attention(
            q,
            k.expand(-1, H, -1, -1).contiguous(),
            v.expand(-1, H, -1, -1).contiguous(),
            is_causal=True,
        )
        h = x2 + F.linear(ctx.permute(2, 0, 1, 3).reshape(S, B, HIDDEN), wo)
        gate, up = F.linear(F.rms_norm(h, (HIDDEN,), ln2, 1e-5), w1).chunk(2, -1)
        out = h + F.linear(F.silu(gate) * up, w2)
        out.backward(dy)
    for a, r in zip(got, [out, x2.grad] + [p.grad for p in params]):
        assert torch.equal(a, r)


def test_gqa_checkpoint_round_trip_restores_weights_and_scaling_state(tmp_path):
    src, dst = mha(groups=2, seed=5), mha(groups=2, seed=6)
    recipe = dq.DelayedScaling(amax_history_len=4, fp8_dpa=True)
    x = torch.randn(S, B, HIDDEN, device=DEVICE)
    with dq.autocast(recipe=recipe):
        src(x).sum().backward()
    dq.checkpoint.save(tmp_path / "gqa.pt", src)
    dq.checkpoint.load(tmp_path / "gqa.pt", dst)
    with torch.no_grad(), dq.autocast(recipe=recipe):
        assert torch.equal(src(x), dst(x))
    state = src.state_dict()
    assert state["qkv.weight"].shape == ((H + 4) * D, HIDDEN) and state["qkv.bias"].shape == (64,)
    with pytest.raises(ValueError, match="qkv.weight"):
        dq.checkpoint.load(tmp_path / "gqa.pt", mha(groups=1))  # MHA's [q; k; v] is larger


@pytest.mark.parametrize(
    "make, match",
    [
        (
            lambda: dq.DotProductAttention(4, 8, num_gqa_groups=3, name="a"),
            r"DotProductAttention 'a': num_gqa_groups=3 must divide num_attention_heads=4",
        ),
        (
            lambda: dq.MultiheadAttention(32, 4, num_gqa_groups=0, name="m"),
            r"MultiheadAttention 'm': num_gqa_groups must be an int >= 1, got 0",
        ),
        (
            lambda: dq.TransformerLayer(32, 64, 4, num_gqa_groups=True, name="t"),
            r"TransformerLayer 't': num_gqa_groups must be an int >= 1, got True",
        ),
        (
            lambda: dq.TransformerLayer(32, 64, 4, kv_channels=0, name="t"),
            r"TransformerLayer 't': kv_channels must be an int >= 1, got 0",
        ),
        (
            lambda: dq.MultiheadAttention(30, 4, name="m"),
            r"'m': hidden_size=30 must be a multiple of num_attention_heads=4 \(or give kv_",
        ),
        (
            lambda: dq.MultiheadAttention(32, 4, num_gqa_groups=8, name="m"),
            r"'m': num_gqa_groups=8 must divide num_attention_heads=4",
        ),
    ],
)
def test_invalid_num_gqa_groups_is_refused_naming_the_module(make, match):
    with pytest.raises(ValueError, match=match):
        make()


def test_key_and_value_must_carry_the_kv_heads():
    dpa = dq.DotProductAttention(H, D, num_gqa_groups=2, name="a")
    q, k, v, _ = qkv(2)
    with pytest.raises(ValueError, match=r"'a': key must be 4D sbhd with 2 heads of 8 channels"):
        dpa(q, q, v)
    with pytest.raises(ValueError, match=r"'a': value must be 4D sbhd with 2 heads"):
        dpa(q, k, q)
