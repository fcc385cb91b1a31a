"""Cast telemetry: the Triton counts equal the reference's, and both equal a float64 re-derivation.

The re-derivation does not use torch's FP8 cast: it decides saturation and underflow from the
fp32 product in numpy (IEEE float32 multiply), compared in float64 against fp8_max and half the
smallest FP8 subnormal (round-to-nearest-even sends exactly half to zero). Counts are integers, so
every comparison is exact.
"""

import numpy as np
import pytest
import torch
from dist_quant.kernels import reference as ref
from dist_quant.kernels.fp8_stats import cast_stats, cast_stats_triton
from triton_cases import (
    FP8_DTYPES,
    RAGGED_SHAPES,
    assert_bitwise_equal,
    fp8_grid_values,
    on_device,
    random_values,
    with_specials,
)

# smallest subnormal: E4M3 2**-9, E5M2 2**-16
_MIN_SUBNORMAL = {torch.float8_e4m3fn: 2.0**-9, torch.float8_e5m2: 2.0**-16}


def _float64_stats(x: torch.Tensor, scale: float, fp8_dtype: torch.dtype) -> tuple[int, int, int]:
    x32 = x.float().numpy().reshape(-1)
    limit = float(torch.finfo(fp8_dtype).max)
    with np.errstate(invalid="ignore", over="ignore"):
        v = (x32 * np.float32(scale)).astype(np.float64)  # the fp32 product, widened exactly
        saturated = int(np.sum(np.abs(v) > limit))
        nonzero = x32 != 0
        underflowed = int(np.sum(nonzero & (np.abs(v) <= _MIN_SUBNORMAL[fp8_dtype] / 2)))
    return saturated, underflowed, int(np.sum(nonzero))


def _assert_same_stats(actual: ref.CastStats, expected: ref.CastStats) -> None:
    for name in ("saturated", "underflowed", "nonzero", "amax"):
        assert_bitwise_equal(getattr(actual, name), getattr(expected, name), name)


@pytest.mark.parametrize("fp8_dtype", FP8_DTYPES)
@pytest.mark.parametrize("scale", [1.0, 2.0**-20, 2.0**20, 3.0])
def test_reference_counts_equal_a_float64_rederivation_on_the_fp8_grid(fp8_dtype, scale):
    # every code point, every midpoint and its fp32 neighbours, values past max, subnormals, specials
    x = fp8_grid_values(fp8_dtype) / scale
    got = ref.cast_stats(x, scale, fp8_dtype)
    expected = _float64_stats(x, scale, fp8_dtype)
    assert (got.saturated.item(), got.underflowed.item(), got.nonzero.item()) == expected
    assert got.saturated.item() > 0 and got.underflowed.item() > 0  # both paths exercised


@pytest.mark.parametrize("fp8_dtype", FP8_DTYPES)
def test_reference_underflow_is_exactly_the_elements_the_cast_zeroes(fp8_dtype):
    x = with_specials(random_values((64, 65), torch.float32, seed=3))
    got = ref.cast_stats(x, 1.0, fp8_dtype)
    q = ref.cast_to_fp8(x, 1.0, fp8_dtype).float()
    assert got.underflowed.item() == int(((x != 0) & (q == 0)).sum())
    assert got.saturated.item() == int((x.abs() > torch.finfo(fp8_dtype).max).sum())
    assert_bitwise_equal(got.amax, ref.amax(x), "amax")


@pytest.mark.parametrize("x_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("fp8_dtype", FP8_DTYPES)
@pytest.mark.parametrize("shape", RAGGED_SHAPES)
def test_triton_stats_match_the_reference_on_ragged_shapes(shape, fp8_dtype, x_dtype):
    x = with_specials(random_values(shape, x_dtype, seed=21))
    scale = torch.tensor([0.75], dtype=torch.float32)
    got = cast_stats_triton(*on_device(x, scale), fp8_dtype)
    _assert_same_stats(got, ref.cast_stats(x, scale, fp8_dtype))


@pytest.mark.parametrize("fp8_dtype", FP8_DTYPES)
@pytest.mark.parametrize("scale", [1.0, 2.0**-20, 2.0**20, 3.4e38])
def test_triton_stats_match_the_float64_rederivation_on_the_fp8_grid(fp8_dtype, scale):
    # scale 3.4e38 overflows finite products to inf: saturated, never NaN
    x = fp8_grid_values(fp8_dtype) / min(scale, 2.0**20)
    with np.errstate(over="ignore"):  # the interpreter multiplies in numpy
        got = cast_stats_triton(*on_device(x), scale, fp8_dtype)
    expected = _float64_stats(x, scale, fp8_dtype)
    assert (got.saturated.item(), got.underflowed.item(), got.nonzero.item()) == expected


def test_triton_stats_over_many_programs_count_every_block_once():
    # 140k elements span every interpreter program and several loop iterations, ragged last block
    x = random_values((140_001,), torch.float32, seed=22)
    x[-1] = float("nan")
    got = cast_stats_triton(*on_device(x), 1.0, torch.float8_e4m3fn)
    _assert_same_stats(got, ref.cast_stats(x, 1.0, torch.float8_e4m3fn))
    assert got.amax.isnan()


def test_transposed_input_is_counted_like_its_contiguous_copy():
    x = random_values((37, 129), torch.bfloat16, seed=23).t()
    got = cast_stats_triton(*on_device(x), 2.0, torch.float8_e5m2)
    _assert_same_stats(got, ref.cast_stats(x.contiguous(), 2.0, torch.float8_e5m2))


def test_dispatcher_runs_the_reference_on_cpu_and_refuses_a_bad_dtype():
    x = random_values((4, 9), torch.float32, seed=24)
    _assert_same_stats(
        cast_stats(x, 1.0, torch.float8_e4m3fn), ref.cast_stats(x, 1.0, torch.float8_e4m3fn)
    )
    with pytest.raises(ValueError, match="fp8_dtype must be"):
        cast_stats_triton(x, 1.0, torch.float16)
    with pytest.raises(ValueError, match="x must be fp32/bf16/fp16"):
        cast_stats_triton(x.double(), 1.0, torch.float8_e4m3fn)
