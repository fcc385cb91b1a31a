"""Triton amax, current scale and the fused current-scaling cast against the reference, bit for bit.

The fused cast must equal the reference composition amax -> current_scale -> cast_to_fp8 (or
cast_transpose), including the amax, scale and scale_inv it reports.
"""

import pytest
import torch
from dist_quant.kernels import current_scaling_cast
from dist_quant.kernels import reference as ref
from dist_quant.kernels.current import (
    amax_triton,
    current_scale_triton,
    current_scaling_cast_triton,
)
from triton_cases import (
    DEVICE,
    FP8_DTYPES,
    RAGGED_SHAPES,
    assert_bitwise_equal,
    on_device,
    random_values,
    with_specials,
)


@pytest.mark.parametrize("x_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", RAGGED_SHAPES)
def test_amax_matches_reference_on_ragged_shapes(shape, x_dtype):
    x = random_values(shape, x_dtype, seed=11)
    assert_bitwise_equal(amax_triton(*on_device(x)), ref.amax(x), "amax")


@pytest.mark.parametrize("plant", [float("nan"), float("inf"), -float("inf"), -3e38])
def test_amax_over_many_programs_propagates_the_planted_value(plant):
    # 140k elements span several interpreter programs and loop iterations of the persistent grid;
    # the planted value sits in the last, ragged block.
    x = random_values((140_001,), torch.float32, seed=12)
    x[-3] = plant
    out = amax_triton(*on_device(x))
    assert_bitwise_equal(out, ref.amax(x), "amax")
    assert out.shape == ()


_AMAXES = torch.tensor(
    [0.0, -0.0, -1.0, 1e-45, 1e-40, 1e-38, 2.0**-126, 0.5, 1.0, 3.0, 448.0, 57344.0, 1e30,
     3.4e38, float("inf"), float("nan")]
)  # fmt: skip


@pytest.mark.parametrize("fp8_dtype", FP8_DTYPES)
@pytest.mark.parametrize("eps", [0.0, 1e-42, 2.0])
@pytest.mark.parametrize("pow2", [False, True])
def test_current_scale_matches_reference_on_edge_amaxes(fp8_dtype, eps, pow2):
    # 1e-45 / 1e-40 overflow the scale to inf (-> FLT_MAX); 0, negative, inf and NaN give 1.
    scale, scale_inv = current_scale_triton(
        *on_device(_AMAXES), fp8_dtype, amax_epsilon=eps, use_power_2_scales=pow2
    )
    exp_scale, exp_inv = ref.current_scale(
        _AMAXES, fp8_dtype, amax_epsilon=eps, use_power_2_scales=pow2
    )
    assert_bitwise_equal(scale, exp_scale, "scale")
    assert_bitwise_equal(scale_inv, exp_inv, "scale_inv")


def _reference_current_cast(x, fp8_dtype, eps, pow2, transpose):
    a = ref.amax(x)
    scale, scale_inv = ref.current_scale(a, fp8_dtype, amax_epsilon=eps, use_power_2_scales=pow2)
    if transpose:
        q, q_t = ref.cast_transpose(x, scale, fp8_dtype)
    else:
        q, q_t = ref.cast_to_fp8(x, scale, fp8_dtype), None
    return q, q_t, scale.reshape(1), scale_inv.reshape(1), a


@pytest.mark.parametrize("transpose", [False, True])
@pytest.mark.parametrize("fp8_dtype", FP8_DTYPES)
@pytest.mark.parametrize("shape", RAGGED_SHAPES)
def test_fused_current_scaling_cast_equals_the_reference_composition(shape, fp8_dtype, transpose):
    x = random_values(shape, torch.bfloat16, seed=13)
    pow2 = fp8_dtype == torch.float8_e5m2
    out = current_scaling_cast_triton(
        *on_device(x), fp8_dtype, amax_epsilon=1e-3, use_power_2_scales=pow2, transpose=transpose
    )
    expected = _reference_current_cast(x, fp8_dtype, 1e-3, pow2, transpose)
    for name, got, exp in zip(out._fields, out, expected):
        if exp is None:
            assert got is None, name
        else:
            assert_bitwise_equal(got, exp, name)


@pytest.mark.parametrize("plant", [float("nan"), float("inf")])
def test_fused_current_scaling_cast_with_non_finite_amax_uses_scale_one(plant):
    x = with_specials(random_values((33, 65), torch.float32, seed=14))
    x[0, 0] = plant
    out = current_scaling_cast_triton(*on_device(x), torch.float8_e4m3fn, transpose=True)
    expected = _reference_current_cast(x, torch.float8_e4m3fn, 0.0, False, True)
    for name, got, exp in zip(out._fields, out, expected):
        assert_bitwise_equal(got, exp, name)
    assert out.scale.item() == 1.0


def test_current_scaling_cast_dispatcher_on_cpu_is_the_reference_composition():
    x = random_values((6, 40), torch.float32, seed=15)
    out = current_scaling_cast(x, torch.float8_e5m2, amax_epsilon=0.5, transpose=True)
    expected = _reference_current_cast(x, torch.float8_e5m2, 0.5, False, True)
    for name, got, exp in zip(out._fields, out, expected):
        assert_bitwise_equal(got, exp, name)


def test_bad_arguments_raise_value_errors_naming_the_op():
    x = torch.ones(4, device=DEVICE)
    with pytest.raises(ValueError, match="current_scale: amax_epsilon must be >= 0"):
        current_scale_triton(x, torch.float8_e4m3fn, amax_epsilon=-1.0)
    with pytest.raises(ValueError, match="current_scaling_cast: amax_epsilon must be >= 0"):
        current_scaling_cast_triton(x, torch.float8_e4m3fn, amax_epsilon=float("nan"))
    with pytest.raises(ValueError, match="amax: x must be fp32/bf16/fp16"):
        amax_triton(x.to(torch.int64))
