"""Reference factories: per-role choices, composed dispatch, keys, the "bf16" built-in."""

import json
import warnings

import pytest
import torch

from dist_quant import factories
from dist_quant.quantizers import (
    Float8BlockQuantizer,
    Float8CurrentScalingQuantizer,
    Float8Quantizer,
    IdentityQuantizer,
    MXFP8Quantizer,
)
from dist_quant.recipes import CustomRecipe, DelayedScaling, HighPrecision, recipe_from_json
from dist_quant.roles import DelayedScalingRequest, QuantizerRole
from dist_quant.state import RecipeState

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2


def linear(tensor_type, name="layers.1.fc1"):
    return QuantizerRole("linear", tensor_type, name)


def dpa(tensor_type, name="layers.1.self_attention.core"):
    return QuantizerRole("dpa", tensor_type, name)


BASIC = [
    factories.high_precision,
    factories.delayed_scaling,
    factories.current_scaling,
    factories.mxfp8,
    factories.float8_block_scaling,
]


@pytest.mark.parametrize("role", [linear("weight"), QuantizerRole(), None], ids=str)
def test_basic_factories_answer_every_role_including_none(role):
    assert isinstance(factories.high_precision(role), IdentityQuantizer)
    assert factories.delayed_scaling(role) == DelayedScalingRequest()
    mx = factories.mxfp8(role)
    assert isinstance(mx, MXFP8Quantizer) and mx.fp8_dtype == E4M3


@pytest.mark.parametrize(
    "role, dtype",
    [
        (linear("input"), E4M3),
        (linear("weight"), E4M3),
        (linear("grad_output"), E5M2),
        (QuantizerRole("linear", "grad_input", "x"), E5M2),
        (dpa("qkv"), E4M3),
        (dpa("s"), E4M3),
        (dpa("o"), E4M3),
        (dpa("do"), E5M2),
        (dpa("dp"), E5M2),
        (dpa("dqkv"), E5M2),
        (QuantizerRole(), E4M3),
    ],
    ids=str,
)
def test_current_scaling_uses_e5m2_for_gradient_roles(role, dtype):
    q = factories.current_scaling(role)
    assert isinstance(q, Float8CurrentScalingQuantizer) and q.fp8_dtype == dtype


@pytest.mark.parametrize(
    "role, dim",
    [(linear("weight"), 2), (linear("input"), 1), (linear("grad_output"), 1), (dpa("qkv"), 1)],
    ids=str,
)
def test_block_scaling_is_2d_for_weights_only(role, dim):
    q = factories.float8_block_scaling(role)
    assert isinstance(q, Float8BlockQuantizer) and q.block_scaling_dim == dim
    assert q.fp8_dtype == E4M3


def test_bf16_first_last_keeps_edge_layers_and_outside_slots_in_high_precision():
    factory = factories.bf16_first_last(4)
    kinds = [type(factory(linear("input", f"model.layers.{i}.mlp.fc1"))) for i in range(4)]
    assert kinds == [
        IdentityQuantizer,
        Float8CurrentScalingQuantizer,
        Float8CurrentScalingQuantizer,
        IdentityQuantizer,
    ]
    assert factory(linear("grad_output", "layers.2.proj")).fp8_dtype == E5M2
    for outside in (linear("input", "lm_head"), linear("input", "mylayers.2.fc"), QuantizerRole()):
        assert isinstance(factory(outside), IdentityQuantizer)
    with pytest.raises(ValueError, match="layer 4, but the factory was built for num_layers=4"):
        factory(linear("input", "layers.4.fc1"))
    with pytest.raises(ValueError, match="num_layers must be an int >= 1"):
        factories.bf16_first_last(0)


def test_attention_current_linear_block_dispatches_on_module_type():
    f = factories.attention_current_linear_block
    assert isinstance(f(dpa("s")), Float8CurrentScalingQuantizer)
    assert f(dpa("dqkv")).fp8_dtype == E5M2
    assert f(linear("weight")).block_scaling_dim == 2
    assert f(QuantizerRole("grouped_linear", "input", "moe.experts")).block_scaling_dim == 1
    assert isinstance(f(QuantizerRole()), IdentityQuantizer)


def test_every_reference_factory_has_an_explicit_key():
    composed = [factories.bf16_first_last(3), factories.attention_current_linear_block]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a fallback key would warn
        keys = [CustomRecipe(f).key() for f in BASIC + composed]
        assert CustomRecipe(factories.bf16_first_last(5)).key() not in keys
    assert len(set(keys)) == len(keys)
    assert CustomRecipe(factories.bf16_first_last(3)).key() in keys


def test_bf16_builtin_is_all_identity_and_round_trips():
    recipe = recipe_from_json("bf16")
    assert isinstance(recipe, HighPrecision) and recipe.name == "bf16"
    assert recipe.key() == ("bf16", ()) and recipe.to_dict() == {"type": "bf16"}
    assert recipe_from_json(json.dumps(recipe.to_dict())) == recipe == recipe_from_json('"bf16"')
    for mode in ("forward", "backward"):
        state = RecipeState.create(recipe, mode=mode, num_quantizers=2)
        assert all(isinstance(q, IdentityQuantizer) for q in state.make_quantizers())
    # what the factory gives a slot, the recipe gives every slot
    assert isinstance(factories.high_precision(None), IdentityQuantizer)


def test_factory_by_import_path_builds_the_same_state_after_a_json_round_trip():
    text = json.dumps({"type": "CustomRecipe", "qfactory": "dist_quant.factories:current_scaling"})
    recipe = recipe_from_json(text)
    assert recipe.qfactory is factories.current_scaling
    roles = [linear("grad_output"), None]
    state = RecipeState.create(recipe, mode="backward", num_quantizers=2, roles=roles)
    assert [q.fp8_dtype for q in state.make_quantizers()] == [E5M2, E4M3]


def test_delayed_scaling_factory_matches_the_delayed_recipe_state():
    roles = [linear("input"), linear("weight"), None]
    custom = RecipeState.create(
        CustomRecipe(factories.delayed_scaling), num_quantizers=3, roles=roles
    )
    builtin = RecipeState.create(DelayedScaling(), num_quantizers=3, roles=roles)
    assert all(type(q) is Float8Quantizer for q in custom.make_quantizers())
    assert [q.fp8_dtype for q in custom.make_quantizers()] == [E4M3] * 3
    for name, tensor in builtin.persistent_buffers().items():
        mine = custom.persistent_buffers()[name]
        assert (mine.shape, mine.dtype) == (tensor.shape, tensor.dtype)
        assert torch.equal(mine, tensor)
