"""Role names and boundary roles are a property of the model's structure (issue 16).

What these catch: names lost for every block called after the first one in an autocast region (a
factory targeting `tl1` silently applied its default to it), a root `MultiheadAttention` planned
without its boundary roles and then re-planned by its first forward outside the atomic plan, a
forward that changes roles, a module used at two places named silently, and role-less slots handed
to factories as an empty `QuantizerRole()` instead of `None` (API.md).

Observables are public only: what a recording factory is asked, `output_quantizer_role`, the plan
digest of `dq.plan_model`, and outputs, compared bit for bit with the run the roles say should
happen (identity quantizers run exactly the high-precision math: checked against autocast off).
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
import torch
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

import dist_quant as dq
from dist_quant import factories

HIDDEN, FFN, HEADS, S, B = 32, 64, 2, 8, 2
LAYER_GEMMS = ("self_attention.qkv", "self_attention.proj", "mlp.fc1", "mlp.fc2")


class Recorder:
    """A keyed factory answering like `factories.current_scaling`; records every role it is asked
    with (None for a role-less slot)."""

    def __init__(self, key: str = "tests.role_names.recorder.v1") -> None:
        self.roles: list[dq.QuantizerRole | None] = []
        dq.quantizer_factory(key=key)(self)

    def __call__(self, role: dq.QuantizerRole | None) -> dq.Float8CurrentScalingQuantizer:
        self.roles.append(role)
        return factories.current_scaling(role)

    def names(self) -> set[str]:
        return {r.name for r in self.roles if r is not None}


def layer_names(prefix: str) -> set[str]:
    """Every role name a TransformerLayer whose role name is `prefix` emits."""
    dot = f"{prefix}." if prefix else ""
    return {f"{dot}{g}" for g in LAYER_GEMMS} | {f"{dot}self_attention.core_attention"}


def layer(name: str | None = None, seed: int = 0) -> dq.TransformerLayer:
    torch.manual_seed(seed)
    return dq.TransformerLayer(HIDDEN, FFN, HEADS, name=name)


def x_in(seed: int = 1) -> torch.Tensor:
    return torch.randn(S, B, HIDDEN, generator=torch.Generator().manual_seed(seed))


# ---- 1. names for every block called in a region ---------------------------------------------
def test_every_top_level_block_called_in_one_autocast_names_its_own_subtree():
    tl0, tl1, tl2 = layer("tl0", 0), layer("tl1", 1), layer("tl2", 2)
    rec = Recorder()
    with dq.autocast(recipe=dq.CustomRecipe(rec)):
        tl2(tl1(tl0(x_in())))
    assert rec.names() == layer_names("tl0") | layer_names("tl1") | layer_names("tl2")
    assert None in rec.roles  # role-less slots are asked with None, not QuantizerRole()
    assert dq.QuantizerRole() not in rec.roles


def test_factory_targeting_the_second_block_applies_to_it():
    """tl1 in high precision, tl0 on current scaling: tl1's output equals its autocast-off output
    bit for bit, tl0's equals plain current scaling (the issue's `tl1` silently got the default)."""
    tl0, tl1 = layer("tl0", 0), layer("tl1", 1)

    @dq.quantizer_factory(key="tests.role_names.tl1_high_precision.v1")
    def tl1_high_precision(role):
        if role is not None and role.name.startswith("tl1."):
            return dq.IdentityQuantizer()
        return factories.current_scaling(role)

    x = x_in()
    with dq.autocast(recipe=dq.CustomRecipe(tl1_high_precision)):
        h = tl0(x)
        y = tl1(h)
    with dq.autocast(enabled=False):
        y_hp = tl1(h)
    fresh0 = layer("tl0", 0)
    with dq.autocast(recipe=dq.Float8CurrentScaling()):
        h_cs = fresh0(x)
    assert torch.equal(y, y_hp)
    assert torch.equal(h, h_cs)
    assert not torch.equal(h, tl0.float()(x))  # tl0 really quantized (autocast off differs)


def test_unnamed_blocks_called_one_after_another_each_take_names_from_themselves():
    tl_a, tl_b = layer(seed=0), layer(seed=1)
    rec = Recorder()
    with dq.autocast(recipe=dq.CustomRecipe(rec)):
        tl_b(tl_a(x_in()))
    assert rec.names() == layer_names("")
    # both blocks were planned: each qkv's output slot has its own block's attention role
    want = dq.QuantizerRole("dpa", "qkv", "self_attention.core_attention")
    assert tl_a.self_attention.qkv.output_quantizer_role == want
    assert tl_b.self_attention.qkv.output_quantizer_role == want


def test_plain_sequential_root_names_its_blocks_by_their_path():
    model = nn.Sequential(layer(seed=0), layer(seed=1))
    rec = Recorder()
    with dq.autocast(recipe=dq.CustomRecipe(rec)):
        model(x_in())
    assert rec.names() == layer_names("0") | layer_names("1")


def test_blocks_wrapped_for_checkpointing_or_compiled_are_named_by_their_place_in_the_model():
    """torchtitan wraps each block (`checkpoint_wrapper`, `torch.compile`); a factory targeting
    `1.mlp.fc2` must still find it, and checkpoint keys must not depend on the wrapping."""
    model = nn.Sequential(layer(seed=0), layer(seed=1), layer(seed=2))
    model[1] = checkpoint_wrapper(model[1], checkpoint_fn=dq.activation_checkpoint)
    model[2] = torch.compile(model[2], backend="eager")
    rec = Recorder()
    with dq.autocast(recipe=dq.CustomRecipe(rec)):
        model(x_in())
    assert rec.names() == layer_names("0") | layer_names("1") | layer_names("2")
    keys = {k for k in model.state_dict() if k.endswith("_extra_state")}
    assert "1.mlp._extra_state" in keys and "2._orig_mod.mlp._extra_state" in keys


def test_explicit_name_wins_over_the_path_and_restarts_it():
    model = nn.Sequential(layer(seed=0), layer("special", 1))
    rec = Recorder()
    dq.apply_recipe(model, dq.CustomRecipe(rec))
    assert rec.names() == layer_names("0") | layer_names("special")


def test_names_are_fixed_by_the_first_plan_and_never_changed_by_a_forward():
    model = nn.Sequential(layer(seed=0), layer(seed=1))
    first = Recorder()
    dq.apply_recipe(model, dq.CustomRecipe(first))
    with dq.autocast():
        model[1](model[0](x_in()))  # the blocks called on their own, after the model was planned
    again = Recorder("tests.role_names.recorder.v2")
    dq.apply_recipe(model[1], dq.CustomRecipe(again))  # replanning from an inner block
    assert again.names() == layer_names("1")
    assert first.names() == layer_names("0") | layer_names("1")
    assert (
        dq.plan_model(model, dq.CustomRecipe(first)).digest
        == dq.plan_model(model, dq.CustomRecipe(first)).digest
    )


def test_a_module_used_at_two_places_keeps_its_first_path_with_a_warning():
    shared = dq.Linear(16, 16)
    model = nn.Sequential(shared, nn.Tanh(), shared)
    rec = Recorder()
    with pytest.warns(UserWarning, match=r"used at two places in the model \('0' and '2'\)"):
        dq.apply_recipe(model, dq.CustomRecipe(rec))
    assert rec.names() == {"0"}


def test_a_model_planned_once_registers_no_global_module_hook_in_autocast():
    """dynamo warns about global module hooks (issue 17): once every dist-quant module alive is
    planned, an autocast region installs none; while some are not, the region's hook removes
    itself as soon as the first call planned them. A fresh interpreter, so no module left alive by
    another test keeps the planning hook on."""
    script = textwrap.dedent(
        """
        import torch
        from torch import nn
        from torch.nn.modules import module as torch_module
        import dist_quant as dq

        def hooks():
            return len(torch_module._global_forward_pre_hooks)

        model = nn.Sequential(dq.TransformerLayer(32, 64, 2), dq.TransformerLayer(32, 64, 2))
        x = torch.randn(4, 2, 32)
        with dq.autocast():
            assert hooks() == 1, "unplanned modules exist: the region plans calls"
            model(x)
            assert hooks() == 0, "everything planned by the first call: the hook is gone"
            model(x)
        with dq.autocast():
            assert hooks() == 0
            model(x)
        other = nn.Sequential(dq.Linear(32, 32))
        dq.apply_recipe(other, dq.Float8CurrentScaling())
        with dq.autocast():
            assert hooks() == 0
            other(x)
        print("ok")
        """
    )
    out = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr


# ---- 2. boundary roles at plan time ----------------------------------------------------------
def test_root_mha_is_planned_with_its_boundary_roles_and_its_first_forward_replans_nothing():
    torch.manual_seed(0)
    mha = dq.MultiheadAttention(HIDDEN, HEADS)
    rec = Recorder()
    recipe = dq.CustomRecipe(rec)
    digest = dq.plan_model(mha, recipe).digest
    rec.roles.clear()
    dq.apply_recipe(mha, recipe)
    assert mha.qkv.output_quantizer_role == dq.QuantizerRole("dpa", "qkv", "core_attention")
    assert mha.proj.grad_input_quantizer_role == dq.QuantizerRole("dpa", "do", "core_attention")
    assert mha.core_attention.output_quantizer_role == dq.QuantizerRole("linear", "input", "proj")
    assert mha.core_attention.grad_input_quantizer_role == dq.QuantizerRole(
        "linear", "grad_output", "qkv"
    )
    # the qkv GEMM's output slot and attention's own qkv slot both carry dpa/qkv
    assert rec.roles.count(dq.QuantizerRole("dpa", "qkv", "core_attention")) == 2
    asked = len(rec.roles)
    with dq.autocast():
        mha(x_in()).sum().backward()
    assert len(rec.roles) == asked, "the first forward re-planned modules outside the plan"
    assert dq.plan_model(mha, recipe).digest == digest


# ---- 4. None for role-less slots --------------------------------------------------------------
BUILT_IN_FACTORIES = [
    factories.high_precision,
    factories.delayed_scaling,
    factories.current_scaling,
    factories.mxfp8,
    factories.float8_block_scaling,
    factories.attention_current_linear_block,
    factories.bf16_first_last(4),
]


@pytest.mark.parametrize("factory", BUILT_IN_FACTORIES, ids=lambda f: f.__name__)
def test_every_built_in_factory_plans_a_model_whose_slots_include_role_less_ones(factory):
    model = nn.Sequential(dq.Linear(16, 16), dq.LayerNormMLP(16, 32))
    dq.apply_recipe(model, dq.CustomRecipe(factory))
    answer = factory(None)
    assert isinstance(answer, (dq.DelayedScalingRequest, dq.IdentityQuantizer)) or hasattr(
        answer, "quantize"
    )
    with dq.autocast():
        model(torch.randn(4, 16)).sum().backward()


def test_te_style_factory_checking_none_first_gets_none_for_the_output_slot():
    seen = []

    @dq.quantizer_factory(key="tests.role_names.te_style.v1")
    def te_style(role):
        seen.append(role)
        if role is None:
            return dq.IdentityQuantizer()
        return factories.current_scaling(role)

    lin = dq.Linear(16, 16, name="lin")
    dq.apply_recipe(lin, dq.CustomRecipe(te_style))
    assert seen == [
        dq.QuantizerRole("linear", "input", "lin"),
        dq.QuantizerRole("linear", "weight", "lin"),
        None,
        dq.QuantizerRole("linear", "grad_output", "lin"),
        None,
    ]


def test_roles_table_shows_role_less_slots_with_the_quantizer_the_factory_gave_for_none():
    from dist_quant.launch.roles import role_rows

    model = nn.Sequential(layer(seed=0), layer(seed=1))
    rows = role_rows(model, dq.CustomRecipe(factories.attention_current_linear_block))
    role_less = [r for r in rows if r[2] == "-"]
    # no role: the MLP's output and grad input, proj's output, qkv's grad input (both layers)
    owners = {
        f"{i}.{m}" for i in (0, 1) for m in ("mlp", "self_attention.proj", "self_attention.qkv")
    }
    assert {r[0].split(" ")[0] for r in role_less} == owners
    assert {(r[3], r[4]) for r in role_less} == {("", "IdentityQuantizer")}
    qkv_out = [r for r in rows if r[0].startswith("1.self_attention.qkv ") and r[1] == "fwd[2]"]
    assert [(r[2], r[3]) for r in qkv_out] == [("dpa/qkv", "1.self_attention.core_attention")]


def test_a_model_built_inside_an_autocast_region_is_named_by_its_structure():
    rec = Recorder()
    with dq.autocast(recipe=dq.CustomRecipe(rec)):
        model = nn.Sequential(layer(seed=0), layer(seed=1))
        model(x_in())
    assert rec.names() == layer_names("0") | layer_names("1")
    want = dq.QuantizerRole("dpa", "qkv", "1.self_attention.core_attention")
    assert model[1].self_attention.qkv.output_quantizer_role == want
