"""The NVFP4 recipe end to end on one process: its key and JSON form, the quantizer's copies
against the kernels' reference cast, the recipe state's per-role options, the linear GEMM triple
against the reference GEMM, the plan-time refusal of shapes NVFP4 cannot block, and checkpoints.

The bit-level numerics (E2M1 rounding, scales, Hadamard transform, stochastic rounding, GEMM) are
pinned against a float64 re-derivation in tests/kernels/test_nvfp4_reference.py; here the
expectations are built from those reference functions called directly on the same inputs, never
from the quantizer or module under test.
"""

from __future__ import annotations

import io

import pytest
import torch
from dist_quant.kernels import reference, reference_nvfp4

import dist_quant as dq
from dist_quant import checkpoint as ckpt
from dist_quant import factories
from dist_quant.kinds import OperandLayout
from dist_quant.nvfp4 import NVFP4Quantizer
from dist_quant.recipes import recipe_from_dict
from dist_quant.tensor import from_saved, to_saved

T, IN, OUT = 32, 64, 48  # tokens, in_features, out_features: multiples of 16


def _x(seed: int, shape=(T, IN)) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def _ref_cast(x: torch.Tensor, *, rht: bool = False, block_2d: bool = False, **sr):
    """The reference's NVFP4 cast of 2-D `x` (after the transform), with its own amax."""
    src = reference_nvfp4.random_hadamard_transform(x) if rht else x
    amax = reference.amax(src)
    cast = reference_nvfp4.quantize_nvfp4(src, amax, block_2d=block_2d, **sr)
    return cast.data, cast.scales, amax


# ---- recipe -----------------------------------------------------------------------------------
def test_nvfp4_is_a_builtin_and_every_option_round_trips_through_json():
    assert recipe_from_dict("nvfp4") == dq.NVFP4BlockScaling()
    recipe = dq.NVFP4BlockScaling(
        input_rht=False, weight_2d=False, stochastic_rounding=False, seed=5, reduce_amax=False,
        backward_override="high_precision",
    )  # fmt: skip
    back = recipe_from_dict(recipe.to_dict())
    assert back == recipe and back.digest() == recipe.digest()
    assert recipe.to_dict()["type"] == "NVFP4BlockScaling"


def test_overrides_enter_a_key_only_when_set_so_existing_digests_stay():
    # the keys these recipes had before the override fields existed, written out by hand
    assert dq.DelayedScaling().key() == (
        "DelayedScaling",
        (0, "HYBRID", 1024, "max", None, True, False, False),
    )
    assert dq.MXFP8BlockScaling().key() == ("MXFP8BlockScaling", ("E4M3",))
    assert dq.MXFP8BlockScaling().to_dict() == {"type": "MXFP8BlockScaling", "fp8_format": "E4M3"}
    set_key = dq.MXFP8BlockScaling(backward_override="dequantized").key()
    assert set_key == ("MXFP8BlockScaling", ("E4M3", ("backward_override", "dequantized")))
    fwd = dq.Float8CurrentScaling(forward_override="high_precision").key()
    bwd = dq.Float8CurrentScaling(backward_override="high_precision").key()
    assert fwd != bwd  # named pairs: two overrides with one value never collide


@pytest.mark.parametrize(
    "make, message",
    [
        (
            lambda: dq.NVFP4BlockScaling(forward_override="dequantized"),
            "forward_override must be None or one of 'high_precision'",
        ),
        (
            lambda: dq.NVFP4BlockScaling(backward_override="bf16"),
            "backward_override must be None or one of 'high_precision', 'dequantized'",
        ),
        (
            lambda: dq.MXFP8BlockScaling(
                forward_override="high_precision", backward_override="high_precision"
            ),
            "quantize nothing; use HighPrecision",
        ),
        (
            lambda: dq.NVFP4BlockScaling(
                forward_override="high_precision", backward_override="dequantized"
            ),
            "quantizes none",
        ),
        (
            lambda: dq.DelayedScaling(forward_override="high_precision"),
            "after the forward amax reduction",
        ),
        (
            lambda: dq.Float8CurrentScaling(fp8_dpa=True, backward_override="high_precision"),
            "fp8_dpa=True",
        ),
        (lambda: dq.NVFP4BlockScaling(seed=-1), "NVFP4BlockScaling.seed"),
    ],
)
def test_meaningless_overrides_and_bad_options_are_refused_naming_the_field(make, message):
    with pytest.raises(ValueError, match=message):
        make()


# ---- quantizer --------------------------------------------------------------------------------
def test_quantizer_copies_are_the_reference_casts_of_the_tensor_and_its_transpose():
    x = _x(0)
    q = NVFP4Quantizer(rht=True)
    t = q.quantize(x)
    row, col = t.rowwise, t.columnwise
    for got, want in ((row, _ref_cast(x)), (col, _ref_cast(x.t().contiguous(), rht=True))):
        assert torch.equal(got.data, want[0])
        assert torch.equal(got.scales.view(torch.uint8), want[1].view(torch.uint8))
        assert torch.equal(got.amax.reshape(()), want[2])
    assert (row.rht, col.rht) == (False, True)
    # each copy has its own global amax: the transform changes it
    assert not torch.equal(row.amax, col.amax)


def test_2d_weight_copies_hold_the_same_values_and_dequantize_to_one_matrix():
    w = _x(1, (OUT, IN))
    t = NVFP4Quantizer(block_2d=True).quantize(w)
    rowwise = t.rowwise.operand().dequantize()
    columnwise = t.columnwise.operand().dequantize()
    assert torch.equal(rowwise, columnwise.t())
    want = reference_nvfp4.dequantize_nvfp4(
        *_ref_cast(w, block_2d=True)[:2],
        reference_nvfp4.nvfp4_global_scales(reference.amax(w))[1],
        dtype=torch.float32,
    )
    assert torch.equal(t.dequantize(), want)


def test_stochastic_rounding_draws_from_an_offset_that_advances_per_cast():
    x = _x(2)
    offset = torch.zeros(1, dtype=torch.int64)
    q = NVFP4Quantizer(stochastic_rounding=True, seed=9, sr_offset=offset)
    q.set_usage(rowwise=True, columnwise=False)
    first, second = q.quantize(x), q.quantize(x)
    assert offset.item() == 2
    for got, off in ((first, 0), (second, 1)):
        want = _ref_cast(x, stochastic=True, seed=9, offset=off)
        assert torch.equal(got.rowwise.data, want[0])
    assert not torch.equal(first.rowwise.data, second.rowwise.data)


# ---- the linear GEMM triple -------------------------------------------------------------------
def _linear(seed: int = 3, in_f: int = IN, out_f: int = OUT) -> dq.Linear:
    torch.manual_seed(seed)
    return dq.Linear(in_f, out_f)


def test_recipe_state_gives_each_role_its_options():
    m = _linear()
    dq.apply_recipe(m, dq.NVFP4BlockScaling())
    rt = m.quant_binding.runtime
    inp, weight, _ = rt.fwd_quantizers
    grad = rt.bwd_quantizers[0]
    assert (inp.rht, inp.block_2d, inp.stochastic_rounding) == (True, False, False)
    assert (weight.rht, weight.block_2d, weight.stochastic_rounding) == (False, True, False)
    assert (grad.rht, grad.block_2d, grad.stochastic_rounding) == (True, False, True)
    off = dq.NVFP4BlockScaling(
        input_rht=False, grad_output_rht=False, weight_2d=False, stochastic_rounding=False
    )
    dq.apply_recipe(m, off)
    rt = m.quant_binding.runtime
    for q in (*rt.fwd_quantizers, *rt.bwd_quantizers):
        assert (q.rht, q.block_2d, q.stochastic_rounding) == (False, False, False)


def test_forward_is_the_reference_gemm_of_the_reference_casts():
    m = _linear()
    x = _x(4)
    dq.apply_recipe(m, dq.NVFP4BlockScaling())
    with dq.autocast():
        y = m(x)
    xa, wa = _ref_cast(x), _ref_cast(m.weight.detach(), block_2d=True)
    want = reference_nvfp4.nvfp4_gemm(xa, wa) + m.bias.detach()
    assert torch.equal(y.detach(), want)


def _grads(m: torch.nn.Module, x: torch.Tensor, dy: torch.Tensor, recipe) -> tuple:
    x = x.clone().requires_grad_(True)
    m.zero_grad(set_to_none=True)
    dq.apply_recipe(m, recipe)
    with dq.autocast():
        y = m(x)
    y.backward(dy)
    return y.detach(), x.grad, m.weight.grad, m.bias.grad


def test_wgrad_with_only_the_output_gradient_transformed_is_the_exact_block_gemm():
    # input_rht off, grad_output_rht on: the wgrad operands' transforms differ, and the GEMM is
    # still the contract's (the input's E2M1 values transformed), not a device-ordered fp32 matmul
    m, x, dy = _linear(), _x(15), _x(16, (T, OUT))
    recipe = dq.NVFP4BlockScaling(input_rht=False, stochastic_rounding=False, weight_2d=False)
    _, _, dw, _ = _grads(m, x, dy, recipe)
    dy_t, x_t = _ref_cast(dy.t().contiguous(), rht=True), _ref_cast(x.t().contiguous())
    want = reference_nvfp4.nvfp4_gemm((*dy_t, True), (*x_t, False))
    assert torch.equal(dw, want)


def test_backward_high_precision_is_the_unconverted_backward_given_the_same_output_grad():
    m, x, dy = _linear(), _x(5), _x(6, (T, OUT))
    y, dx, dw, db = _grads(m, x, dy, dq.NVFP4BlockScaling(backward_override="high_precision"))
    x_ref = x.clone().requires_grad_(True)
    w_ref = m.weight.detach().clone().requires_grad_(True)
    b_ref = m.bias.detach().clone().requires_grad_(True)
    torch.nn.functional.linear(x_ref, w_ref, b_ref).backward(dy)
    assert torch.equal(dx, x_ref.grad) and torch.equal(dw, w_ref.grad)
    assert torch.equal(db, b_ref.grad)
    y_fp4, *_ = _grads(m, x, dy, dq.NVFP4BlockScaling())
    assert torch.equal(y, y_fp4)  # the forward is still NVFP4's


def test_backward_dequantized_runs_the_unconverted_backward_on_the_forward_operands():
    m, x, dy = _linear(), _x(7), _x(8, (T, OUT))
    _, dx, dw, _ = _grads(m, x, dy, dq.NVFP4BlockScaling(backward_override="dequantized"))
    s_dec = lambda amax: reference_nvfp4.nvfp4_global_scales(amax)[1]  # noqa: E731
    xd, xs, xa = _ref_cast(x)
    wd, ws, wa = _ref_cast(m.weight.detach(), block_2d=True)
    x_deq = reference_nvfp4.dequantize_nvfp4(xd, xs, s_dec(xa), dtype=torch.float32)
    w_deq = reference_nvfp4.dequantize_nvfp4(wd, ws, s_dec(wa), dtype=torch.float32)
    x_ref, w_ref = x_deq.requires_grad_(True), w_deq.requires_grad_(True)
    torch.nn.functional.linear(x_ref, w_ref).backward(dy)
    assert torch.equal(dx, x_ref.grad) and torch.equal(dw, w_ref.grad)


def test_forward_high_precision_is_bf16s_forward_with_nvfp4s_backward():
    m, x, dy = _linear(), _x(9), _x(10, (T, OUT))
    y, dx, dw, db = _grads(m, x, dy, dq.NVFP4BlockScaling(forward_override="high_precision"))
    y_hp, *_ = _grads(m, x, dy, dq.HighPrecision())
    assert torch.equal(y, y_hp)
    # the backward quantizes the same operands NVFP4's forward would have kept, with the same
    # (seed, offset) stream: a fresh state per apply_recipe
    _, dx4, dw4, db4 = _grads(m, x, dy, dq.NVFP4BlockScaling())
    assert torch.equal(dx, dx4) and torch.equal(dw, dw4) and torch.equal(db, db4)


# ---- bad input --------------------------------------------------------------------------------
def _plan_lazily(model: torch.nn.Module, recipe) -> None:
    with dq.autocast(recipe=recipe):
        model(_x(19))


@pytest.mark.parametrize("plan", [dq.apply_recipe, _plan_lazily], ids=["apply", "autocast"])
@pytest.mark.parametrize(
    "in_f, out_f, role", [(40, OUT, "linear/input"), (IN, 40, "linear/weight")]
)
def test_features_not_a_multiple_of_16_are_refused_at_plan_time_and_nothing_published(
    in_f, out_f, role, plan
):
    # a valid layer, then (through a plain nn.Linear, so the forward runs) the refused one
    m = torch.nn.Sequential(_linear(), torch.nn.Linear(OUT, in_f), _linear(in_f=in_f, out_f=out_f))
    layers = [m[0], m[2]]
    plan(m, dq.MXFP8BlockScaling())
    before = [layer.quant_binding.runtime for layer in layers]
    with pytest.raises(dq.RecipeUpdateError, match="module '2'.*multiple of 16") as info:
        plan(m, dq.NVFP4BlockScaling())
    assert role in str(info.value)
    assert [layer.quant_binding.runtime for layer in layers] == before
    assert [layer.quant_binding.recipe for layer in layers] == [dq.MXFP8BlockScaling()] * 2


def test_the_transformed_copies_need_multiples_of_16_not_32():
    # 48 features and 48 tokens under both transforms: planned, and the weight gradient is the
    # reference GEMM of the reference casts
    m, x, dy = _linear(in_f=48, out_f=48), _x(17, (48, 48)), _x(18, (48, 48))
    _, _, dw, _ = _grads(m, x, dy, dq.NVFP4BlockScaling(stochastic_rounding=False))
    dy_t, x_t = _ref_cast(dy.t().contiguous(), rht=True), _ref_cast(x.t().contiguous(), rht=True)
    assert torch.equal(dw, reference_nvfp4.nvfp4_gemm((*dy_t, True), (*x_t, True)))


def test_a_token_count_not_a_multiple_of_16_is_refused_naming_module_and_role():
    m = _linear()
    dq.apply_recipe(m, dq.NVFP4BlockScaling())
    x = _x(11, (T - 4, IN)).requires_grad_(True)
    with pytest.raises(ValueError, match=r"module '.*', role input \(forward\).*tokens"):
        with dq.autocast():
            m(x)


# ---- state that outlives a process ------------------------------------------------------------
def test_a_fresh_model_resumes_an_nvfp4_checkpoint_with_its_rounding_stream():
    """The stochastic-rounding offsets are checkpointed: the resumed model's next step draws the
    same bits as the original's."""
    m, x, dy = _linear(), _x(12), _x(13, (T, OUT))
    recipe = dq.NVFP4BlockScaling(seed=3)
    _grads(m, x, dy, recipe)  # one step: the output gradient's offsets advance
    buf = io.BytesIO()
    torch.save(m.state_dict(), buf)
    fresh = _linear(seed=99)
    buf.seek(0)
    ckpt.load_state_dict(fresh, torch.load(buf, weights_only=False))
    assert dq.current_recipe(fresh) == recipe
    offsets = fresh.quant_binding.runtime.bwd_state.sr_offset
    assert torch.equal(offsets, m.quant_binding.runtime.bwd_state.sr_offset)
    assert offsets[0].item() == 2  # rowwise and columnwise copies of one output gradient

    def step(model):
        model.zero_grad(set_to_none=True)
        xx = x.clone().requires_grad_(True)
        with dq.autocast():
            model(xx).backward(dy)
        return xx.grad, model.weight.grad

    for got, want in zip(step(fresh), step(m)):
        assert torch.equal(got, want)


def _two_layers(seed: int) -> torch.nn.Sequential:
    torch.manual_seed(seed)
    return torch.nn.Sequential(dq.Linear(IN, IN), dq.Linear(IN, OUT))


def _train(model: torch.nn.Module, batches: list) -> None:
    opt = torch.optim.SGD(model.parameters(), lr=0.01)  # stateless: the model is the whole state
    for x, dy in batches:
        opt.zero_grad(set_to_none=True)
        with dq.autocast():
            model(x).backward(dy)
        opt.step()


@pytest.mark.parametrize(
    "recipe",
    [
        dq.NVFP4BlockScaling(seed=3),
        dq.CustomRecipe(factories.nvfp4),
        recipe_from_dict(
            {
                "type": "policy",
                "default": "nvfp4",
                "rules": [{"modules": ["1"], "recipe": {"type": "NVFP4BlockScaling", "seed": 7}}],
            }
        ),
        dq.CustomRecipe(factories.fp8_fallback(["0"], to="mxfp8", base="nvfp4")),
    ],
    ids=["recipe", "factory", "policy", "fallback"],
)
def test_k_steps_checkpoint_fresh_model_n_minus_k_steps_is_n_steps_bit_for_bit(recipe):
    """Every stochastically rounding NVFP4 quantizer, built by the recipe or by a factory, counts
    its casts in its recipe state's checkpointed buffer: resuming continues its random stream."""
    n, k = 3, 1
    batches = [(_x(20 + i), _x(40 + i, (T, OUT))) for i in range(n)]
    straight = _two_layers(seed=3)
    dq.apply_recipe(straight, recipe)
    _train(straight, batches)

    first = _two_layers(seed=3)
    dq.apply_recipe(first, recipe)
    _train(first, batches[:k])
    buf = io.BytesIO()
    torch.save(first.state_dict(), buf)
    buf.seek(0)
    resumed = _two_layers(seed=99)
    ckpt.load_state_dict(resumed, torch.load(buf, weights_only=True))
    offsets = resumed[1].quant_binding.runtime.bwd_state.sr_offset
    assert offsets.max().item() == 2 * k  # the output gradient's two copies per step
    _train(resumed, batches[k:])
    for (name, want), got in zip(straight.state_dict().items(), resumed.state_dict().values()):
        if isinstance(want, torch.Tensor):
            assert torch.equal(got, want), name
    # and the stream did matter: a model that restarts its offsets at 0 drifts
    restarted = _two_layers(seed=99)
    weights = {k: v for k, v in first.state_dict().items() if not k.endswith("_extra_state")}
    restarted.load_state_dict(weights, strict=False)
    dq.apply_recipe(restarted, recipe)
    _train(restarted, batches[k:])
    assert not torch.equal(restarted[0].weight, straight[0].weight)


def test_fsdp2_fp8_all_gather_of_an_nvfp4_weight_is_refused_at_plan_time():
    m = _linear()
    m.quant_binding.fp8_gathered_weights[1] = "weight"  # what enable_fp8_all_gather records
    with pytest.raises(dq.RecipeUpdateError, match="FSDP2 all-gathers the weight 'weight' in FP8"):
        dq.apply_recipe(m, dq.NVFP4BlockScaling())
    assert m.quant_binding.runtime is None


def test_nvfp4_operands_save_and_rebuild_for_backward_hooks():
    t = NVFP4Quantizer(rht=True).quantize(_x(14))
    for value in (t, t.columnwise_operand()):
        tensors, layout = to_saved(value)
        back = from_saved(tensors, layout)
        assert torch.equal(back.dequantize(), value.dequantize())
    assert t.columnwise_operand().scaling is OperandLayout.NVFP4
