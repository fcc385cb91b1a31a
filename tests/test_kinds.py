"""The typed vocabulary: scaling kinds, GEMM operand layouts, directions, tensor-parallel modes and
amax algorithms, their string spellings at the edges, their capabilities, and quantizers describing
themselves for the plan digest."""

import inspect
import json

import pytest
import torch
from dist_quant.kernels import reference
from torch import nn

import dist_quant as dq
from dist_quant import checks
from dist_quant.kinds import AmaxAlgo, Direction, OperandLayout, ParallelMode, PassMode, ScalingKind
from dist_quant.quantizers import Quantizer
from dist_quant.recipes import Float8CurrentScaling, NVFP4BlockScaling
from dist_quant.state import RecipeState
from dist_quant.tensor import GemmOperand

CPU, CUDA = torch.device("cpu"), torch.device("cuda")


def test_kinds_are_their_strings_at_every_edge():
    q = dq.Float8CurrentScalingQuantizer(torch.float8_e4m3fn)
    assert q.scaling == "current" and q.scaling is ScalingKind.CURRENT
    assert {"current": 1}[q.scaling] == 1  # hashes as its string
    assert f"{q.scaling}" == str(q.scaling) == "current"
    assert json.dumps({"d": Direction.BACKWARD, "l": OperandLayout.BLOCK1D}) == (
        '{"d": "backward", "l": "block1d"}'
    )
    assert [k.value for k in ScalingKind] == [
        "delayed",
        "current",
        "mxfp8",
        "block",
        "nvfp4",
        "identity",
    ]


@pytest.mark.parametrize(
    "kind,per_tensor,fp8_gemm,fp8_attention,cpu_rows,cuda_rows",
    [
        (ScalingKind.DELAYED, True, True, True, 1, 16),
        (ScalingKind.CURRENT, True, True, True, 1, 16),
        (ScalingKind.MXFP8, False, True, True, 32, 32),
        (ScalingKind.BLOCK, False, True, False, 128, 128),
        (ScalingKind.NVFP4, False, True, False, 16, 16),
        (ScalingKind.IDENTITY, False, False, True, 1, 1),
    ],
)
def test_scaling_kinds_answer_their_capabilities(
    kind, per_tensor, fp8_gemm, fp8_attention, cpu_rows, cuda_rows
):
    assert (kind.per_tensor, kind.needs_fp8_gemm, kind.fp8_attention) == (
        per_tensor,
        fp8_gemm,
        fp8_attention,
    )
    assert (kind.row_alignment(CPU), kind.row_alignment(CUDA)) == (cpu_rows, cuda_rows)


def test_operand_layouts_know_their_block_dim():
    assert [(x.value, x.per_tensor, x.block_dim) for x in OperandLayout] == [
        ("tensor", True, None),
        ("mxfp8", False, None),
        ("block1d", False, 1),
        ("block2d", False, 2),
        ("nvfp4", False, None),
    ]
    assert [OperandLayout.of_block_dim(d) for d in (1, 2)] == ["block1d", "block2d"]


def test_a_string_kind_becomes_the_enum_and_a_bad_one_is_refused():
    class Halver(Quantizer):
        scaling = "current"

        def quantize(self, x):
            return x / 2

    assert Halver.scaling is ScalingKind.CURRENT
    with pytest.raises(ValueError, match=r"Bogus.scaling must be one of 'delayed', .*'fp4'"):

        class Bogus(Quantizer):
            scaling = "fp4"

            def quantize(self, x):
                return x

    with pytest.raises(TypeError, match="Unkinded must set `scaling` to a .*ScalingKind"):

        class Unkinded(Quantizer):
            def quantize(self, x):
                return x

    data = torch.zeros(2, 4, dtype=torch.float8_e4m3fn)
    operand = GemmOperand(data, torch.ones(()), "tensor", torch.float8_e4m3fn)
    assert operand.scaling is OperandLayout.TENSOR
    with pytest.raises(ValueError, match="GemmOperand.scaling must be one of 'tensor'"):
        GemmOperand(data, torch.ones(()), "block3d", torch.float8_e4m3fn)


def test_recipe_state_mode_takes_a_direction_or_its_spelling():
    for mode in ("backward", Direction.BACKWARD):
        state = RecipeState.create(dq.Float8CurrentScaling(), mode=mode, num_quantizers=1)
        assert state.mode is Direction.BACKWARD
        assert state.make_quantizers()[0].fp8_dtype == torch.float8_e5m2  # HYBRID backward
    assert Direction.of(True) is Direction.FORWARD and Direction.BACKWARD.fwd is False
    with pytest.raises(ValueError, match="mode must be one of 'forward', 'backward', got 'fwd'"):
        RecipeState.create(dq.Float8CurrentScaling(), mode="fwd")


@pytest.mark.parametrize(
    "cls,others",
    [
        (
            dq.Float8CurrentScalingQuantizer,
            {"use_power_2_scales": True, "amax_epsilon": 1e-6, "amax_reduction_group": object()},
        ),
        (dq.Float8BlockQuantizer, {"use_power_2_scales": False, "block_scaling_dim": 2}),
        (dq.MXFP8Quantizer, {}),
    ],
)
def test_every_setting_reaches_the_description(cls, others):
    """Each constructor setting, changed alone from its default, changes `describe()`; so does
    the FP8 dtype. (`others` lists every setting the constructor has besides the dtype.)"""
    params = set(inspect.signature(cls).parameters) - {"fp8_dtype"}
    assert params == set(others)
    base = cls(torch.float8_e4m3fn).describe()
    for name, other in others.items():
        assert cls(torch.float8_e4m3fn, **{name: other}).describe() != base, name
    e5m2 = cls(torch.float8_e5m2).describe()
    assert e5m2 != base and e5m2[:2] == base[:2] == (cls.__name__, cls.scaling.value)


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(dq.Linear(16, 16, name="fc"))


def test_plan_digest_sees_a_reduction_group_that_reflection_skipped():
    """Two ranks whose factory differs only in a quantizer's (non-scalar) reduction group must
    not agree on a plan digest: the coordinator would commit two different quantizations."""
    group = object()

    @dq.quantizer_factory(key="tests.kinds.same_key.v1")
    def plain(role):
        return dq.Float8CurrentScalingQuantizer(torch.float8_e4m3fn)

    @dq.quantizer_factory(key="tests.kinds.same_key.v1")
    def reduced(role):
        return dq.Float8CurrentScalingQuantizer(torch.float8_e4m3fn, amax_reduction_group=group)

    a = dq.plan_model(_model(), dq.CustomRecipe(plain))
    b = dq.plan_model(_model(), dq.CustomRecipe(reduced))
    assert a.recipe_key == b.recipe_key  # the keys agree: only the digest can tell them apart
    assert a.digest != b.digest
    assert a.digest == dq.plan_model(_model(), dq.CustomRecipe(plain)).digest


def test_pass_modes_read_a_recipes_overrides_and_default_to_quantized():
    assert PassMode.of_recipe(object()) == (PassMode.QUANTIZED, PassMode.QUANTIZED)
    recipe = NVFP4BlockScaling(backward_override="dequantized")
    assert PassMode.of_recipe(recipe) == (PassMode.QUANTIZED, PassMode.DEQUANTIZED)
    recipe = Float8CurrentScaling(forward_override="high_precision")
    assert PassMode.of_recipe(recipe) == (PassMode.HIGH_PRECISION, PassMode.QUANTIZED)


def test_the_recipe_layers_spellings_are_the_kinds_values():
    """checks.py keeps plain strings (the recipes layer does not import the kernels, where
    AmaxAlgo lives): a kind added on one side only fails here."""
    assert checks.AMAX_COMPUTE_ALGOS == tuple(a.value for a in AmaxAlgo)
    overrides = {*checks.FORWARD_OVERRIDES, *checks.BACKWARD_OVERRIDES}
    assert overrides == {m.value for m in PassMode} - {PassMode.QUANTIZED.value}


def test_amax_algos_name_what_the_reference_computes_and_carry_their_kernel_code():
    history = torch.tensor([[1.0, 5.0], [3.0, 2.0], [2.0, 4.0]])  # (L=3, n=2); row 0 is this step
    assert reference.delayed_amax(history, AmaxAlgo.MAX).tolist() == [3.0, 5.0]
    assert reference.delayed_amax(history, "most_recent").tolist() == [1.0, 5.0]
    assert [a.code for a in AmaxAlgo] == [0, 1]
    assert all(AmaxAlgo.of_code(a.code) is a for a in AmaxAlgo)
    with pytest.raises(ValueError, match="algo must be 'max' or 'most_recent', got 'mean'"):
        reference.delayed_amax(history, "mean")
    state = RecipeState.create(dq.DelayedScaling(amax_compute_algo="most_recent"))
    assert state.delayed_groups()[0].algo is AmaxAlgo.MOST_RECENT


def test_parallel_mode_is_taken_as_its_spelling_and_stored_as_the_kind():
    row = dq.Linear(8, 4, parallel_mode="row")
    assert row.parallel_mode is ParallelMode.ROW and row.gemm_layout()[0].parallel_mode == "row"
    assert "parallel_mode=row," in repr(row)
    assert dq.Linear(8, 4).gemm_layout()[0].parallel_mode is None
    assert [m.weight_split_dim for m in ParallelMode] == [0, 1]  # (out, in): column splits rows
    with pytest.raises(ValueError, match="parallel_mode must be one of None, 'column', 'row'"):
        dq.Linear(8, 4, parallel_mode="diagonal")
