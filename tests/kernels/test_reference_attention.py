"""The float64 definition of FP8 attention (``kernels/reference_attention.py``, the CPU path and the
kernels' oracle) against ``tests/flash_ref.py``, an independent float64 autograd re-derivation of
the same formulas, on the same FP8 operands; plus what the definition promises by construction."""

import math

import pytest
import torch
from attention_cases import E4M3, E5M2, forward_row_bounds, operands, rel_err
from dist_quant.kernels import reference_attention as ref
from flash_ref import cast, flash_attention

SHAPES = {"mha": (2, 2, 2, 9, 9, 8), "gqa": (1, 4, 2, 11, 11, 8), "cross": (1, 2, 1, 5, 13, 8)}


class FixedScales:
    """flash_ref's inner rounding with the fixed scales the reference is given."""

    def __init__(self, s_scale: torch.Tensor, dp_scale: torch.Tensor) -> None:
        self.s_scale, self.dp_scale = s_scale, dp_scale

    def p(self, x):
        return cast(x, self.s_scale, E4M3)

    p_backward = p

    def ds(self, x, bound):
        return cast(x, self.dp_scale, E5M2)


def dequantized(ops, name):
    return (ops[name].double() * ops[f"{name}_scale_inv"].double()).requires_grad_(True)


@pytest.mark.parametrize("pad", [False, True], ids=["unpadded", "padded"])
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
@pytest.mark.parametrize("shape", list(SHAPES))
def test_reference_equals_an_independent_float64_rederivation(shape, causal, pad):
    ops = operands(*SHAPES[shape], device="cpu", seed=3, pad=pad, causal=causal)
    sq, sk = ops["q"].shape[2], ops["k"].shape[2]
    masked = ref.masked_positions(sq, sk, ops["pad_mask"], causal, torch.device("cpu"))
    q, k, v = (dequantized(ops, n) for n in ("q", "k", "v"))
    out = flash_attention(q, k, v, masked, FixedScales(ops["s_scale"], ops["dp_scale"]))
    do = ops["do"].double() * ops["do_scale_inv"].double()
    out.backward(do)

    keys = ("q", "k", "v", "q_scale_inv", "k_scale_inv", "v_scale_inv", "s_scale", "s_dtype")
    fwd = ref.attention_fwd(*(ops[n] for n in keys), ops["pad_mask"], causal)
    bwd = ref.attention_bwd(
        ops["q"], ops["k"], ops["v"], fwd.out, ops["do"], ops["q_scale_inv"],
        ops["k_scale_inv"], ops["v_scale_inv"], ops["do_scale_inv"], fwd.lse, ops["s_scale"],
        E4M3, ops["dp_scale"], E5M2, ops["pad_mask"], causal,
    )  # fmt: skip
    # the same FP8 roundings of values equal to ~1e-16 (a tie flipped by float64 rounding would
    # show as ~1e-2, and none is expected at these sizes); they differ by where the scale inverse
    # is applied: flash_ref dequantizes each code in fp32 (6e-8 relative), the reference scales
    # the float64 sum
    for name, a, b in zip(
        ("out", "dq", "dk", "dv"), (fwd.out, *bwd[:3]), (out, q.grad, k.grad, v.grad)
    ):
        assert rel_err(a, b) < 1e-7, f"{name}: {rel_err(a, b):.2e}"


def test_p_is_rounded_against_an_integer_row_max_and_normalised_after():
    """One query, three keys, worked by hand: base-2 logits t, M = ceil(max t), the codes of
    exp2(t - M) * 448 in E4M3, the output their v-weighted sum times fp32(1/448) over
    sum(exp2(t - M))."""
    d = 4
    q = torch.tensor([[[[1.0, 0.5, -2.0, 0.0]]]]).to(E4M3)  # (1, 1, 1, 4), scale_inv 1
    k = torch.tensor([[[[1.0, 1.0, 0.0, 0.0], [0.0, 0.0, -1.0, 2.0], [3.0, -1.0, 1.0, 0.5]]]])
    v = torch.tensor([[[[1.0, 0.0, 0.0, 2.0], [0.0, 1.0, 0.0, -1.0], [0.5, 0.5, 4.0, 0.0]]]])
    k, v = k.to(E4M3), v.to(E4M3)
    one, s_scale = torch.ones(1), torch.tensor([448.0])
    got = ref.attention_fwd(q, k, v, one, one, one, s_scale, E4M3, None, False)

    logits = [sum(a * b for a, b in zip(q.flatten().tolist(), row)) for row in k[0, 0].tolist()]
    t = [x / math.sqrt(d) / math.log(2.0) for x in logits]
    m = math.ceil(max(t))
    p = [2.0 ** (x - m) for x in t]
    codes = [torch.tensor(x * 448.0).float().to(E4M3).item() for x in p]
    s_inv = torch.tensor(448.0).reciprocal().item()  # the contract's scale_inv: 1 / scale in fp32
    expected = [
        sum(c * vr[j] for c, vr in zip(codes, v[0, 0].tolist())) * s_inv / sum(p) for j in range(d)
    ]
    assert got.out.flatten().tolist() == pytest.approx(expected, rel=1e-12)
    assert got.lse.item() == pytest.approx(m + math.log2(sum(p)), rel=1e-12)
    assert got.s_amax.item() == pytest.approx(max(p), rel=1e-12)
    assert max(p) <= 1.0 and codes != [x * 448.0 for x in p]  # the rounding is visible


def test_grouped_query_attention_equals_attention_on_repeated_kv_heads():
    ops = operands(1, 4, 2, 7, 7, 8, device="cpu", seed=5)
    rep = {**ops, "k": ops["k"].repeat_interleave(2, 1), "v": ops["v"].repeat_interleave(2, 1)}
    outs = []
    for o in (ops, rep):
        fwd = ref.attention_fwd(
            o["q"], o["k"], o["v"], o["q_scale_inv"], o["k_scale_inv"], o["v_scale_inv"],
            o["s_scale"], E4M3, None, True,
        )  # fmt: skip
        bwd = ref.attention_bwd(
            o["q"], o["k"], o["v"], fwd.out, o["do"], o["q_scale_inv"], o["k_scale_inv"],
            o["v_scale_inv"], o["do_scale_inv"], fwd.lse, o["s_scale"], E4M3, o["dp_scale"],
            E5M2, None, True,
        )  # fmt: skip
        outs.append((fwd.out, *bwd[:3]))
    (o1, dq1, dk1, dv1), (o2, dq2, dk2, dv2) = outs
    assert torch.equal(o1, o2) and torch.equal(dq1, dq2)
    pair = lambda t: t.reshape(1, 2, 2, 7, 8).sum(2)  # noqa: E731
    torch.testing.assert_close(dk1, pair(dk2), rtol=1e-14, atol=0)
    torch.testing.assert_close(dv1, pair(dv2), rtol=1e-14, atol=0)


def test_fp8_rounding_inside_attention_is_visible_against_unquantized_attention():
    """The noise floor the kernel tolerances sit far below: the reference differs from softmax
    attention on the same FP8 operands by P's and dS's rounding, ~1e-2."""
    ops = operands(1, 2, 2, 64, 64, 16, device="cpu", seed=9, causal=False)
    q, k, v = (dequantized(ops, n) for n in ("q", "k", "v"))
    plain = torch.softmax(q @ k.transpose(-2, -1) / 4.0, -1) @ v
    fwd = ref.attention_fwd(
        ops["q"], ops["k"], ops["v"], ops["q_scale_inv"], ops["k_scale_inv"],
        ops["v_scale_inv"], ops["s_scale"], E4M3, None, False,
    )  # fmt: skip
    assert 3e-3 < rel_err(fwd.out, plain) < 5e-2, rel_err(fwd.out, plain)


@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_the_output_row_bound_holds_for_the_definition_and_fails_unrounded_attention(out_dtype):
    """The kernels' output check (`forward_row_bounds`) admits the definition itself and rejects
    what a kernel that skipped P's rounding would give: most rows of plain softmax attention on
    the same FP8 operands lie outside their bound."""
    ops = operands(1, 4, 2, 96, 96, 32, device="cpu", seed=5, causal=True)
    args = ("q", "k", "v", "q_scale_inv", "k_scale_inv", "v_scale_inv", "s_scale")
    fwd = ref.attention_fwd(*(ops[n] for n in args), E4M3, None, True)
    bound = forward_row_bounds(ops, out_dtype)
    assert bool(((fwd.out.to(out_dtype).double() - fwd.out).norm(dim=-1) <= bound).all())
    q, k, v = (dequantized(ops, n) for n in ("q", "k", "v"))
    k, v = (x.repeat_interleave(2, dim=1) for x in (k, v))
    hidden = torch.ones(96, 96, dtype=torch.bool).triu(1)
    logits = (q @ k.transpose(-2, -1) / math.sqrt(32)).masked_fill(hidden, -math.inf)
    plain = torch.softmax(logits, -1) @ v
    outside = (plain - fwd.out).norm(dim=-1) > bound
    assert outside.double().mean() > 0.75, outside.double().mean()


def test_a_fully_masked_query_row_gives_zero_output_infinite_lse_and_zero_gradients():
    ops = operands(1, 1, 1, 4, 6, 8, device="cpu", seed=2, causal=False)
    pad = torch.zeros(1, 1, 4, 6, dtype=torch.bool)
    pad[..., 1, :] = True  # query 1 sees nothing
    args = ("q", "k", "v", "q_scale_inv", "k_scale_inv", "v_scale_inv", "s_scale")
    fwd = ref.attention_fwd(*(ops[n] for n in args), E4M3, pad, False)
    assert torch.equal(fwd.out[0, 0, 1], torch.zeros(8)) and fwd.lse[0, 0, 1] == math.inf
    assert torch.isfinite(fwd.out).all()
    bwd = ref.attention_bwd(
        ops["q"], ops["k"], ops["v"], fwd.out, ops["do"], ops["q_scale_inv"], ops["k_scale_inv"],
        ops["v_scale_inv"], ops["do_scale_inv"], fwd.lse, ops["s_scale"], E4M3, ops["dp_scale"],
        E5M2, pad, False,
    )  # fmt: skip
    assert torch.equal(bwd.dq[0, 0, 1], torch.zeros(8))
    assert all(torch.isfinite(g).all() for g in bwd[:3])
