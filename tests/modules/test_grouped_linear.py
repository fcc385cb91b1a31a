"""GroupedLinear: per-expert GEMMs over row splits, exact split padding, grouped slot layout."""

import pytest
import torch
import torch.nn.functional as F
from module_ref import DEVICE, assert_fp8_close, leaves, ref_linear
from module_step import assert_recipes_agree_bit_for_bit
from module_step import run as run_step
from recipe_cases import builtin_and_reference_factory

import dist_quant as dq
from dist_quant.modules.functional import LinearSlots
from dist_quant.modules.grouped_linear import row_alignment

IN, OUT = 32, 24
SPLITS = [37, 0, 19, 8]  # ragged sizes: every FP8 recipe pads them; an empty expert


def make(seed: int = 0, n: int = len(SPLITS)) -> dq.GroupedLinear:
    torch.manual_seed(seed)
    return dq.GroupedLinear(n, IN, OUT, name="experts", device=DEVICE)


def inputs(seed: int = 0, splits=SPLITS):
    torch.manual_seed(100 + seed)
    tokens = sum(splits)
    return torch.randn(tokens, IN, device=DEVICE), torch.randn(tokens, OUT, device=DEVICE)


def run(mod, x, dy, recipe=None, enabled=True):
    return run_step(mod, x, dy, recipe, enabled, forward_args=(SPLITS,))


def test_disabled_autocast_is_plain_per_expert_linear_bit_for_bit():
    mod = make()
    x, dy = inputs()
    got = run(mod, x, dy, enabled=False)
    x2, *params = leaves(x, *mod.parameters(), dtype=torch.float32)
    y = torch.cat(
        [F.linear(xi, params[2 * i], params[2 * i + 1]) for i, xi in enumerate(x2.split(SPLITS))]
    )
    y.backward(dy)
    for t, r in zip(got, [y, x2.grad] + [p.grad for p in params]):
        assert torch.equal(t, r)


def test_current_scaling_matches_float64_rederivation_per_expert():
    mod = make(1)
    x, dy = inputs(1)
    got = run(mod, x, dy, dq.Float8CurrentScaling())

    def reference(fp8: bool):
        x64, *params = leaves(x, *mod.parameters())
        y = torch.cat(
            [
                # an empty expert has nothing to quantize
                ref_linear(xi, params[2 * i], params[2 * i + 1], fp8=fp8 and len(xi) > 0)
                for i, xi in enumerate(x64.split(SPLITS))
            ]
        )
        y.backward(dy.double())
        return [y, x64.grad] + [p.grad for p in params]

    names = ["output", "dgrad"] + [n for n, _ in mod.named_parameters()]
    for name, a, r8, rhp in zip(names, got, reference(True), reference(False)):
        if name in ("weight1", "bias1"):  # the empty expert: zero gradients, not None
            assert torch.equal(a, torch.zeros_like(a))
        else:
            assert_fp8_close(a, r8, rhp, name)


@pytest.mark.parametrize(
    "recipe",
    [dq.MXFP8BlockScaling(), dq.Float8BlockScaling(), dq.Float8CurrentScaling()],
    ids=["mxfp8", "block", "current"],
)
def test_split_padding_is_exact_against_unpadded_linears(recipe):
    """Each expert equals a `Linear` with its weights run on its rows alone (a Linear never pads):
    same quantized operands, so only the fp32 accumulation may differ (a padded wgrad sums extra
    zero terms; on CUDA a padded split may take `_scaled_mm` where the unpadded one is emulated):
    at most ~K * 2^-24 relative for K <= 64 terms, far below one FP8 step (2^-4 relative)."""
    mod = make(2)
    x, dy = inputs(2)
    got = run(mod, x, dy, recipe)
    rows = 0
    for i, m in enumerate(SPLITS):
        if m == 0:
            continue
        lin = dq.Linear(IN, OUT, name="experts", device=DEVICE)
        with torch.no_grad():
            lin.weight.copy_(getattr(mod, f"weight{i}"))
            lin.bias.copy_(getattr(mod, f"bias{i}"))
        xi = x[rows : rows + m].clone().requires_grad_(True)
        with dq.autocast(recipe=recipe):
            yi = lin(xi)
        yi.backward(dy[rows : rows + m])
        for a, b in zip(
            (got[0][rows : rows + m], got[1][rows : rows + m], got[2 + 2 * i], got[3 + 2 * i]),
            (yi, xi.grad, lin.weight.grad, lin.bias.grad),
        ):
            torch.testing.assert_close(a, b.detach(), rtol=1e-5, atol=1e-5)
        rows += m


def test_row_alignment_follows_the_quantizers():
    def slots(q):
        return [LinearSlots(input=q, weight=q, grad_output=q)]

    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert row_alignment(slots(dq.MXFP8Quantizer()), cpu) == 32
    assert row_alignment(slots(dq.Float8BlockQuantizer()), cpu) == 128
    current = dq.Float8CurrentScalingQuantizer(torch.float8_e4m3fn)
    assert row_alignment(slots(current), cpu) == 1
    assert row_alignment(slots(current), cuda) == 16
    assert row_alignment(slots(dq.IdentityQuantizer()), cuda) == 1


@builtin_and_reference_factory
def test_custom_recipe_of_reference_factory_equals_builtin_bit_for_bit(builtin, factory):
    a, b = make(3), make(3)
    x, dy = inputs(3)
    assert_recipes_agree_bit_for_bit(
        a, b, x, dy, builtin, dq.CustomRecipe(factory), forward_args=(SPLITS,)
    )


def test_high_precision_recipe_equals_disabled_bit_for_bit():
    mod = make(4)
    x, dy = inputs(4)
    for ta, tb in zip(run(mod, x, dy, enabled=False), run(mod, x, dy, dq.recipe_from_dict("bf16"))):
        assert torch.equal(ta, tb)


def test_roles_repeat_each_kind_once_per_gemm_under_one_name():
    mod = dq.GroupedLinear(3, 8, 8, name="layers.1.experts")
    mod.output_quantizer_role = out = dq.QuantizerRole("linear", "input", "combine")
    g = lambda tensor_type: dq.QuantizerRole("grouped_linear", tensor_type, "layers.1.experts")  # noqa: E731
    assert (
        mod.get_quantizer_roles(fwd=True, num_quantizers=9)
        == [g("input")] * 3 + [g("weight")] * 3 + [out] * 3
    )
    assert (
        mod.get_quantizer_roles(fwd=False, num_quantizers=6) == [g("grad_output")] * 3 + [None] * 3
    )
    assert [n for n, _ in mod.named_parameters()] == [
        "weight0",
        "bias0",
        "weight1",
        "bias1",
        "weight2",
        "bias2",
    ]


def test_bad_splits_raise_naming_the_module():
    mod = make(5, n=2)
    x = torch.randn(10, IN, device=DEVICE)
    with pytest.raises(ValueError, match="'experts'.*sum to 9.*10 tokens"):
        mod(x, [4, 5])
    with pytest.raises(ValueError, match="'experts'.*list of 2 ints"):
        mod(x, [10])
    with pytest.raises(ValueError, match="'experts'.*ints >= 0"):
        mod(x, [11, -1])


def test_weight_cache_keeps_one_entry_per_expert_and_skips_empty_ones():
    mod = make(6)
    x, _ = inputs(6)
    recipe = dq.Float8CurrentScaling()
    with dq.autocast(recipe=recipe):
        mod(x, SPLITS, is_first_microbatch=True)
    first = mod.quant_binding.cached_weights()
    assert sorted(first) == ["weight0", "weight2", "weight3"]  # expert 1 got no rows
    with dq.autocast(recipe=recipe):
        mod(x, SPLITS, is_first_microbatch=False)
    assert all(mod.quant_binding.cached_weight(k) is v for k, v in first.items())
