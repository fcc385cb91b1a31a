"""`factories.fp8_fallback`: named modules leave the base recipe; the recipe crosses JSON intact."""

import copy
import json

import pytest
import torch

import dist_quant as dq
from dist_quant.factories import fp8_fallback
from dist_quant.recipes import recipe_from_dict


def _role(name, tensor_type="input"):
    return dq.QuantizerRole("linear", tensor_type, name)


def test_named_module_and_its_children_get_current_scaling_others_keep_delayed():
    f = fp8_fallback(["layers.1"], base={"type": "DelayedScaling", "margin": 2})
    assert isinstance(f(_role("layers.1")), dq.Float8CurrentScalingQuantizer)
    assert isinstance(f(_role("layers.1.mlp.fc1")), dq.Float8CurrentScalingQuantizer)
    assert f(_role("layers.1.mlp.fc1", "grad_output")).fp8_dtype == torch.float8_e5m2
    kept = f(_role("layers.10"))  # a prefix of the name, not a parent module
    assert kept == dq.DelayedScalingRequest(margin=2)


def test_bf16_target_is_identity():
    f = fp8_fallback(["head"], to="bf16", base="current")
    assert isinstance(f(_role("head")), dq.IdentityQuantizer)
    assert isinstance(f(_role("body")), dq.Float8CurrentScalingQuantizer)


def test_fallback_recipe_round_trips_through_json_with_the_same_key():
    r = dq.CustomRecipe(fp8_fallback(["b", "a"], base="delayed"))
    text = json.dumps(r.to_dict())
    back = recipe_from_dict(json.loads(text))
    assert back.key() == r.key()
    assert back.key() != dq.CustomRecipe(fp8_fallback(["a"], base="delayed")).key()
    assert json.loads(text)["qfactory"]["params"]["layers"] == ["a", "b"]


def test_switching_one_layer_keeps_the_other_layers_outputs_bit_for_bit():
    torch.manual_seed(0)
    model = torch.nn.Sequential(dq.Linear(32, 32), dq.Linear(32, 32))
    twin = copy.deepcopy(model)
    x = torch.randn(8, 32)
    dq.apply_recipe(model, dq.CustomRecipe(fp8_fallback(["1"], base="current")))
    dq.apply_recipe(twin, dq.Float8CurrentScaling())
    with dq.autocast():
        h, h_twin = model[0](x), twin[0](x)
    assert torch.equal(h, h_twin)  # layer 0 untouched
    with dq.autocast():
        y = model[1](h)
    with torch.no_grad():
        y_hp = torch.nn.functional.linear(h, model[1].weight, model[1].bias)
    assert not torch.equal(y, y_hp) and torch.allclose(y, y_hp, rtol=0.1, atol=0.1)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"layers": []}, "layers must be a non-empty list"),
        ({"layers": "fc"}, "layers must be a non-empty list"),
        ({"layers": ["fc"], "to": "fp4"}, "to must be one of"),
        ({"layers": ["fc"], "base": "nonsense"}, "nonsense"),
    ],
)
def test_bad_fallback_parameters_are_refused(kwargs, match):
    with pytest.raises(ValueError, match=match):
        fp8_fallback(**kwargs)


def test_a_builder_refusing_its_params_is_a_value_error_naming_the_field():
    bad = {
        "type": "CustomRecipe",
        "qfactory": {"builder": "dist_quant.factories:fp8_fallback", "params": {"layers": []}},
    }
    with pytest.raises(ValueError, match="CustomRecipe.qfactory: builder .* refused"):
        recipe_from_dict(bad)


def test_a_fallback_never_lowers_a_high_precision_slot():
    f = fp8_fallback(["fc"], to="current", base="bf16")
    assert isinstance(f(_role("fc")), dq.IdentityQuantizer)


def test_an_nvfp4_bases_untouched_slots_keep_every_option_of_the_base():
    base = dq.NVFP4BlockScaling(grad_output_rht=False, reduce_amax=False, seed=4)
    f = fp8_fallback(["head"], to="mxfp8", base=base.to_dict())
    inp, weight, grad = (f(_role("body", t)) for t in ("input", "weight", "grad_output"))
    assert (inp.rht, weight.block_2d, grad.rht, grad.stochastic_rounding) == (
        True,
        True,
        False,
        True,
    )
    assert not any(q.reduce_amax for q in (inp, weight, grad))
    assert isinstance(f(_role("head", "grad_output")), dq.MXFP8Quantizer)
