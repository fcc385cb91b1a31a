"""RecipeState: buffers, quantizer views, delayed updates, custom factories, inherit."""

import dataclasses
import re

import pytest
import torch

from dist_quant.formats import Format
from dist_quant.quantizers import (
    Float8BlockQuantizer,
    Float8CurrentScalingQuantizer,
    Float8Quantizer,
    IdentityQuantizer,
    MXFP8Quantizer,
)
from dist_quant.recipes import (
    CustomRecipe,
    DelayedScaling,
    Float8BlockScaling,
    Float8CurrentScaling,
    MXFP8BlockScaling,
)
from dist_quant.roles import DelayedScalingRequest, QuantizerRole
from dist_quant.state import (
    CustomRecipeState,
    DelayedScalingRecipeState,
    Float8BlockScalingRecipeState,
    RecipeState,
)

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
FC1 = "layers.0.fc1"
LINEAR_FWD = [
    QuantizerRole("linear", "input", FC1),
    QuantizerRole("linear", "weight", FC1),
    None,  # output slot: no role given
]


def test_create_checks_roles_mode_and_recipe():
    with pytest.raises(ValueError, match="2 roles for num_quantizers=3"):
        RecipeState.create(DelayedScaling(), num_quantizers=3, roles=LINEAR_FWD[:2])
    with pytest.raises(ValueError, match="mode must be one of"):
        RecipeState.create(DelayedScaling(), mode="fwd")
    with pytest.raises(ValueError, match=re.escape("roles[1] must be a QuantizerRole")):
        RecipeState.create(DelayedScaling(), num_quantizers=2, roles=[None, "weight"])
    with pytest.raises(TypeError, match="expected a Recipe"):
        RecipeState.create("delayed")


@pytest.mark.parametrize(
    "fmt, mode, dtype",
    [
        (Format.HYBRID, "forward", E4M3),
        (Format.HYBRID, "backward", E5M2),
        (Format.E4M3, "backward", E4M3),
    ],
)
def test_delayed_state_buffers_and_dtype_per_direction(fmt, mode, dtype):
    state = RecipeState.create(
        DelayedScaling(fp8_format=fmt, amax_history_len=5), mode=mode, num_quantizers=3
    )
    assert isinstance(state, DelayedScalingRecipeState)
    assert torch.equal(state.scale, torch.ones(3))
    assert torch.equal(state.amax_history, torch.zeros(5, 3))
    assert [q.fp8_dtype for q in state.make_quantizers()] == [dtype] * 3
    (group,) = state.delayed_groups()
    assert group.scale is state.scale and group.amax_history is state.amax_history
    assert torch.equal(group.fp8_max, torch.full((3,), torch.finfo(dtype).max))


def test_delayed_quantizers_are_new_objects_viewing_the_state_buffers():
    state = RecipeState.create(DelayedScaling(amax_history_len=4), num_quantizers=3)
    first, second = state.make_quantizers(), state.make_quantizers()
    for i, (a, b) in enumerate(zip(first, second, strict=True)):
        assert a is not b
        for q in (a, b):
            assert q.scale.data_ptr() == state.scale[i].data_ptr()
            assert q.amax.data_ptr() == state.amax_history[0, i].data_ptr()
    x = torch.tensor([[0.5, -3.0], [2.0, 1.0]])
    first[1].quantize(x)
    assert state.amax_history[0].tolist() == [0.0, 3.0, 0.0]


def test_delayed_group_update_matches_float64_rederivation():
    state = RecipeState.create(DelayedScaling(margin=1, amax_history_len=3), num_quantizers=2)
    state.amax_history.copy_(torch.tensor([[3.0, 0.0], [7.0, 0.0], [5.0, 0.0]]))
    (group,) = state.delayed_groups()
    group.update()
    expected0 = torch.tensor(448.0 / 7.0 / 2.0, dtype=torch.float64).float()
    assert state.scale[0] == expected0
    assert state.scale[1] == 1.0  # amax 0 keeps the previous scale
    # TE's roll: the current row moves to the end (newest past step), row 0 restarts at zero
    assert state.amax_history.tolist() == [[0.0, 0.0], [5.0, 0.0], [3.0, 0.0]]


def test_callable_algorithms_get_transformer_engines_signatures():
    seen = {}

    def newest(history):
        seen["history_shape"] = tuple(history.shape)
        return history[0] * 2

    def halve(amax, scale, fp8_max, recipe):
        seen["args"] = (amax.tolist(), scale.tolist(), fp8_max.tolist(), recipe)
        return scale / 2

    recipe = DelayedScaling(
        amax_history_len=2, amax_compute_algo=newest, scaling_factor_compute_algo=halve
    )
    state = RecipeState.create(recipe, num_quantizers=2)
    state.amax_history[0].copy_(torch.tensor([1.0, 4.0]))
    state.delayed_groups()[0].update()
    assert seen == {
        "history_shape": (2, 2),
        "args": ([2.0, 8.0], [1.0, 1.0], [448.0, 448.0], recipe),
    }
    assert state.scale.tolist() == [0.5, 0.5]
    assert state.amax_history.tolist() == [[0.0, 0.0], [1.0, 4.0]]

    only_amax = DelayedScaling(amax_history_len=2, amax_compute_algo=newest)
    state = RecipeState.create(only_amax, num_quantizers=1)
    state.amax_history[0, 0] = 7.0
    state.delayed_groups()[0].update()
    assert state.scale[0] == torch.tensor(448.0 / 14.0, dtype=torch.float64).float()


def test_group_rescale_recomputes_standard_groups_and_leaves_callable_ones_to_their_update():
    def double(amax, scale, fp8_max, recipe):
        return scale * 2

    for custom in (None, double):
        recipe = DelayedScaling(amax_history_len=3, scaling_factor_compute_algo=custom)
        state = RecipeState.create(recipe, num_quantizers=2)
        state.amax_history.copy_(torch.tensor([[7.0, 0.0], [2.0, 0.0], [5.0, 0.0]]))
        (group,) = state.delayed_groups()
        group.update()  # -> rows [0, 5, 7]; the closed step's 7 is the newest kept amax
        before = state.scale.clone()
        dataclasses.replace(group, margin=2, algo="most_recent").rescale_from_history()
        if custom is None:
            want = torch.tensor(448.0 / 7.0 / 4.0, dtype=torch.float64).float()
            assert state.scale.tolist() == [want.item(), before[1].item()]  # amax 0 keeps it
        else:
            assert torch.equal(state.scale, before), "a user scale rule is not run at publish"
        assert state.amax_history.tolist() == [[0.0, 0.0], [5.0, 0.0], [7.0, 0.0]]


def test_callable_algorithm_with_wrong_shape_fails_before_changing_state():
    recipe = DelayedScaling(amax_history_len=2, amax_compute_algo=lambda h: h.amax())
    state = RecipeState.create(recipe, num_quantizers=2)
    state.amax_history[0].copy_(torch.tensor([1.0, 4.0]))
    with pytest.raises(ValueError, match=re.escape("amax_compute_algo must return a tensor")):
        state.delayed_groups()[0].update()
    assert state.amax_history.tolist() == [[1.0, 4.0], [0.0, 0.0]]
    assert state.scale.tolist() == [1.0, 1.0]


@pytest.mark.parametrize(
    "recipe, mode, cls, dtype",
    [
        (Float8CurrentScaling(), "forward", Float8CurrentScalingQuantizer, E4M3),
        (Float8CurrentScaling(), "backward", Float8CurrentScalingQuantizer, E5M2),
        (Float8CurrentScaling(Format.E4M3), "backward", Float8CurrentScalingQuantizer, E4M3),
        (MXFP8BlockScaling(), "backward", MXFP8Quantizer, E4M3),
        (Float8BlockScaling(), "backward", Float8BlockQuantizer, E4M3),
    ],
)
def test_stateless_states_make_fresh_quantizers_of_the_recipe(recipe, mode, cls, dtype):
    state = RecipeState.create(recipe, mode=mode, num_quantizers=2)
    first, second = state.make_quantizers(), state.make_quantizers()
    assert all(type(q) is cls and q.fp8_dtype == dtype for q in first)
    assert all(a is not b for a, b in zip(first, second, strict=True))
    assert state.persistent_buffers() == {} and state.delayed_groups() == []


def test_current_scaling_quantizers_carry_the_recipe_options():
    recipe = Float8CurrentScaling(use_power_2_scales=True, amax_epsilon=1e-4)
    (q,) = RecipeState.create(recipe).make_quantizers()
    assert (q.use_power_2_scales, q.amax_epsilon) == (True, 1e-4)


def test_block_scaling_uses_128x128_for_weights_by_role_or_slot_convention():
    by_role = RecipeState.create(Float8BlockScaling(), num_quantizers=3, roles=LINEAR_FWD)
    assert isinstance(by_role, Float8BlockScalingRecipeState)
    assert [q.block_scaling_dim for q in by_role.make_quantizers()] == [1, 2, 1]
    # no roles: TE's forward convention (input, weight, output) per GEMM
    fwd = RecipeState.create(Float8BlockScaling(), num_quantizers=6)
    assert [q.block_scaling_dim for q in fwd.make_quantizers()] == [1, 2, 1, 1, 2, 1]
    bwd = RecipeState.create(Float8BlockScaling(), mode="backward", num_quantizers=2)
    assert [q.block_scaling_dim for q in bwd.make_quantizers()] == [1, 1]
    pow2 = RecipeState.create(Float8BlockScaling(use_power_2_scales=False))
    assert pow2.make_quantizers()[0].use_power_2_scales is False


class RecordingFactory:
    """Answers per tensor type; records every role it is called with."""

    def __init__(self, answers):
        self.answers = answers
        self.calls = []

    def __call__(self, role):
        self.calls.append(role)
        answer = self.answers.get(None if role is None else role.tensor_type, IdentityQuantizer)
        return answer() if callable(answer) else answer


def _custom(factory, roles=LINEAR_FWD, mode="forward", **kwargs):
    recipe = CustomRecipe(factory, qfactory_key="test_state.recording")
    return RecipeState.create(recipe, mode=mode, num_quantizers=len(roles), roles=roles, **kwargs)


def test_custom_factory_is_called_once_per_slot_with_its_role():
    factory = RecordingFactory({"input": lambda: Float8CurrentScalingQuantizer(E4M3)})
    state = _custom(factory)
    expected = [LINEAR_FWD[0], LINEAR_FWD[1], None]  # a role-less slot is asked with None
    assert factory.calls == expected
    first = state.make_quantizers()
    assert factory.calls == expected  # the answers given at create serve the first call
    second = state.make_quantizers()
    assert factory.calls == expected * 2
    assert [type(q) for q in first] == [
        Float8CurrentScalingQuantizer,
        IdentityQuantizer,
        IdentityQuantizer,
    ]
    assert all(a is not b for a, b in zip(first, second, strict=True))


def test_custom_quantizers_own_fresh_buffers_per_call():
    def own_buffers():
        return Float8Quantizer(torch.ones(1), torch.zeros(1), E4M3)

    state = _custom(RecordingFactory({"weight": own_buffers}))
    first, second = state.make_quantizers()[1], state.make_quantizers()[1]
    assert first.scale.data_ptr() != second.scale.data_ptr()
    assert first.amax.data_ptr() != second.amax.data_ptr()


def test_delayed_requests_share_one_buffer_pair_and_mix_with_stateless_slots():
    roles = LINEAR_FWD + [QuantizerRole("linear", "input", "layers.0.fc2")]
    factory = RecordingFactory(
        {
            "input": DelayedScalingRequest(amax_history_len=8),
            "weight": lambda: Float8CurrentScalingQuantizer(E4M3),
        }
    )
    state = _custom(factory, roles=roles)
    assert isinstance(state, CustomRecipeState)
    # delayed slots 0 and 3 -> shared columns 0 and 1; slot 1 current; slot 2 (no role) identity
    assert state.scale.shape == (2,) and state.amax_history.shape == (8, 2)
    for _ in range(2):
        qs = state.make_quantizers()
        assert [type(q) for q in qs] == [
            Float8Quantizer,
            Float8CurrentScalingQuantizer,
            IdentityQuantizer,
            Float8Quantizer,
        ]
        for q, col in ((qs[0], 0), (qs[3], 1)):
            assert q.scale.data_ptr() == state.scale[col].data_ptr()
            assert q.amax.data_ptr() == state.amax_history[0, col].data_ptr()
            assert q.fp8_dtype == E4M3
    qs[3].quantize(torch.tensor([-6.0, 2.0]))
    assert state.amax_history[0].tolist() == [0.0, 6.0]
    (group,) = state.delayed_groups()
    assert group.scale is state.scale and group.amax_history is state.amax_history
    assert set(state.persistent_buffers()) == {"scale", "amax_history"}


def test_hybrid_requests_resolve_per_direction_before_they_are_compared():
    roles = [QuantizerRole("linear", "grad_output", FC1), QuantizerRole("linear", "input", FC1)]
    answers = {"grad_output": DelayedScalingRequest(), "input": DelayedScalingRequest(Format.E5M2)}
    state = _custom(RecordingFactory(answers), roles=roles, mode="backward")
    assert [q.fp8_dtype for q in state.make_quantizers()] == [E5M2, E5M2]
    with pytest.raises(ValueError, match="fp8_format") as err:
        _custom(RecordingFactory(answers), roles=roles, mode="forward")
    assert str(roles[0]) in str(err.value) and str(roles[1]) in str(err.value)


def test_disagreeing_delayed_requests_name_both_roles():
    answers = {"input": DelayedScalingRequest(margin=1), "weight": DelayedScalingRequest()}
    with pytest.raises(ValueError, match="margin") as err:
        _custom(RecordingFactory(answers))
    assert "linear/input@layers.0.fc1" in str(err.value)
    assert "linear/weight@layers.0.fc1" in str(err.value)


def test_bad_factory_answers_name_module_and_role():
    with pytest.raises(ValueError, match=r"module 'layers.0.fc1', role linear/weight@.*None"):
        _custom(RecordingFactory({"weight": None}))
    with pytest.raises(TypeError, match="role linear/input@layers.0.fc1.*returned a str"):
        _custom(RecordingFactory({"input": "fp8"}))
    with pytest.raises(ValueError, match="unnamed module, role <no role>"):
        _custom(RecordingFactory({None: None}))
    with pytest.raises(ValueError, match="module 'blk.proj', role <no role>"):
        _custom(RecordingFactory({None: None}), roles=[None], module_name="blk.proj")

    def broken(role):
        raise KeyError("no rule")

    with pytest.raises(ValueError, match="role linear/input@layers.0.fc1 .*KeyError") as err:
        _custom(broken)
    assert isinstance(err.value.__cause__, KeyError)


def test_inherit_rebinds_buffers_without_copying():
    recipe = DelayedScaling(amax_history_len=4)
    old = RecipeState.create(recipe, num_quantizers=3)
    old.scale.copy_(torch.tensor([0.5, 2.0, 4.0]))
    old.amax_history[1].copy_(torch.tensor([1.0, 2.0, 3.0]))
    values = {k: v.clone() for k, v in old.persistent_buffers().items()}
    new = RecipeState.create(DelayedScaling(amax_history_len=4, margin=2), num_quantizers=3)
    assert new.inherit_state_from(old) is True
    assert new.scale is old.scale and new.amax_history is old.amax_history
    for name, tensor in new.persistent_buffers().items():
        assert torch.equal(tensor, values[name])
    q = new.make_quantizers()[2]
    assert q.scale.data_ptr() == old.scale[2].data_ptr()


@pytest.mark.parametrize(
    "other",
    [
        lambda: RecipeState.create(DelayedScaling(amax_history_len=4), num_quantizers=2),
        lambda: RecipeState.create(DelayedScaling(amax_history_len=5), num_quantizers=3),
        lambda: RecipeState.create(Float8CurrentScaling(), num_quantizers=3),
        lambda: _custom(RecordingFactory({"input": DelayedScalingRequest(amax_history_len=4)})),
    ],
    ids=["fewer-slots", "longer-history", "other-class", "custom"],
)
def test_inherit_refuses_mismatches_and_leaves_both_unchanged(other):
    state = RecipeState.create(DelayedScaling(amax_history_len=4), num_quantizers=3)
    donor = other()
    before = {id(s): dict(s.persistent_buffers()) for s in (state, donor)}
    values = {id(s): {k: v.clone() for k, v in before[id(s)].items()} for s in (state, donor)}
    assert state.inherit_state_from(donor) is False
    for s in (state, donor):
        after = s.persistent_buffers()
        assert after.keys() == before[id(s)].keys()
        for name, tensor in after.items():
            assert tensor is before[id(s)][name]
            assert torch.equal(tensor, values[id(s)][name])


def test_custom_states_with_delayed_requests_inherit_from_each_other():
    answers = {"input": DelayedScalingRequest(amax_history_len=4)}
    old, new = _custom(RecordingFactory(answers)), _custom(RecordingFactory(answers))
    old.scale.fill_(3.0)
    assert new.inherit_state_from(old) is True
    assert new.scale is old.scale and new.make_quantizers()[0].scale.item() == 3.0
