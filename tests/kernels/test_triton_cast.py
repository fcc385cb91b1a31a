"""Triton per-tensor cast, cast+transpose and the fused amax against ``kernels.reference``, bit for bit.

On a CPU-only machine the kernels run in Triton's interpreter (conftest sets TRITON_INTERPRET=1),
on a GPU compiled; the reference runs on the CPU either way.
"""

import pytest
import torch
from dist_quant.kernels import cast_to_fp8_with_amax, cast_transpose_with_amax, delayed_cast
from dist_quant.kernels import reference as ref
from dist_quant.kernels.cast import cast_to_fp8_triton, cast_transpose_triton
from dist_quant.kernels.delayed import delayed_cast_triton
from triton_cases import (
    DEVICE,
    FP8_DTYPES,
    RAGGED_SHAPES,
    assert_bitwise_equal,
    fp8_grid_values,
    on_device,
    random_values,
    with_specials,
)


@pytest.mark.parametrize("fp8_dtype", FP8_DTYPES)
@pytest.mark.parametrize("scale", [1.0, 3.0, 2.0**-20, 1e30])
def test_cast_rounds_every_code_point_midpoint_neighbour_and_special_like_reference(
    fp8_dtype, scale
):
    # scale 1 pins the grid itself; 3 moves midpoints off the grid; 2**-20 lands in FP8
    # subnormals; 1e30 saturates everything non-zero.
    x = fp8_grid_values(fp8_dtype)
    (x_dev,) = on_device(x)
    q = cast_to_fp8_triton(x_dev, torch.tensor(scale), fp8_dtype)
    assert_bitwise_equal(q, ref.cast_to_fp8(x, torch.tensor(scale), fp8_dtype), "cast")
    q_t_src = x.reshape(1, -1)
    q2, q2_t = cast_transpose_triton(q_t_src.to(DEVICE, copy=True), scale, fp8_dtype)
    exp, exp_t = ref.cast_transpose(q_t_src, scale, fp8_dtype)
    assert_bitwise_equal(q2, exp, "cast_transpose q")
    assert_bitwise_equal(q2_t, exp_t, "cast_transpose q_t")


@pytest.mark.parametrize("fp8_dtype", FP8_DTYPES)
@pytest.mark.parametrize("x_dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", RAGGED_SHAPES)
def test_cast_and_cast_transpose_match_reference_on_ragged_shapes(shape, x_dtype, fp8_dtype):
    x = with_specials(random_values(shape, x_dtype, seed=hash(shape) % 1000))
    scale = torch.tensor([0.75])
    (x_dev,) = on_device(x)
    assert_bitwise_equal(
        cast_to_fp8_triton(x_dev, scale, fp8_dtype), ref.cast_to_fp8(x, scale, fp8_dtype), "cast"
    )
    q, q_t = cast_transpose_triton(x_dev, scale, fp8_dtype)
    exp_q, exp_t = ref.cast_transpose(x, scale, fp8_dtype)
    assert_bitwise_equal(q, exp_q, "q")
    assert_bitwise_equal(q_t, exp_t, "q_t")


def _noncontiguous(base: torch.Tensor) -> list[torch.Tensor]:
    return [
        base.t(),  # dense, permuted: torch keeps this layout in its output
        base[:, ::2],  # gaps: torch's output is contiguous
        base.t()[::3],
        base[:, 5:70],
        base.reshape(4, 16, 96).permute(2, 0, 1),  # 3D permuted
    ]


@pytest.mark.parametrize("fp8_dtype", FP8_DTYPES)
def test_noncontiguous_inputs_give_torch_layout_and_reference_bits(fp8_dtype):
    base = with_specials(random_values((64, 96), torch.bfloat16, seed=7))
    for x, x_dev in zip(_noncontiguous(base), _noncontiguous(base.to(DEVICE, copy=True))):
        assert_bitwise_equal(
            cast_to_fp8_triton(x_dev, 2.5, fp8_dtype), ref.cast_to_fp8(x, 2.5, fp8_dtype), "cast"
        )
        q, q_t = cast_transpose_triton(x_dev, 2.5, fp8_dtype)
        exp_q, exp_t = ref.cast_transpose(x, 2.5, fp8_dtype)
        assert_bitwise_equal(q, exp_q, "q")
        assert_bitwise_equal(q_t, exp_t, "q_t")


@pytest.mark.parametrize("transpose", [False, True])
@pytest.mark.parametrize(
    "start,plant,expected",
    [
        (0.0, None, None),  # expected None: max|x| of the random data
        (1e30, None, 1e30),  # a larger running amax survives
        (0.0, float("inf"), float("inf")),
        (5.0, float("nan"), float("nan")),  # NaN propagates into the history slot
        (float("nan"), None, float("nan")),  # and stays there
    ],
)
def test_fused_amax_accumulates_the_running_max_in_place(transpose, start, plant, expected):
    x = random_values((37, 70), torch.float32, seed=3)
    if plant is not None:
        x[20, 33] = plant
    if expected is None:
        expected = x.double().abs().max().item()  # max is exact: no rounding in float64
    expected = torch.tensor(expected, dtype=torch.float32).item()  # as the fp32 slot holds it
    history = torch.full((4, 3), 7.0, device=DEVICE)
    history[0, 1] = start
    slot = history[0, 1:2]  # a 1-element view into the accumulator row, as quantizers hold
    (x_dev,) = on_device(x)
    if transpose:
        q, q_t = cast_transpose_triton(x_dev, 1.5, torch.float8_e4m3fn, amax_out=slot)
        assert_bitwise_equal(q_t, ref.cast_transpose(x, 1.5, torch.float8_e4m3fn)[1], "q_t")
    else:
        q = cast_to_fp8_triton(x_dev, 1.5, torch.float8_e4m3fn, amax_out=slot)
    assert_bitwise_equal(q, ref.cast_to_fp8(x, 1.5, torch.float8_e4m3fn), "q")
    got = history[0, 1].item()
    assert got == expected or (got != got and expected != expected), (got, expected)
    others = torch.cat([history[0, :1], history[0, 2:], history[1:].flatten()]).cpu()
    assert torch.equal(others, torch.full_like(others, 7.0)), "only the slot may change"


def test_fused_amax_dispatchers_on_cpu_follow_the_same_rule():
    x = random_values((9, 20), torch.bfloat16, seed=5)
    expected = max(2.0, x.double().abs().max().item())
    slot = torch.tensor([2.0])
    q = cast_to_fp8_with_amax(x, 1.0, torch.float8_e5m2, slot)
    assert slot.item() == expected
    assert_bitwise_equal(q, ref.cast_to_fp8(x, 1.0, torch.float8_e5m2), "q")
    slot2 = torch.tensor([float("nan")])
    q, q_t = cast_transpose_with_amax(x, 1.0, torch.float8_e5m2, slot2)
    assert slot2.isnan().item()
    assert_bitwise_equal(q_t, ref.cast_transpose(x, 1.0, torch.float8_e5m2)[1], "q_t")


@pytest.mark.parametrize("transpose", [False, True])
@pytest.mark.parametrize("shape", [(37, 70), (3, 5, 8), (0, 16)])
def test_delayed_cast_gives_the_cast_the_folded_amax_and_the_scales_ieee_reciprocal(
    shape, transpose
):
    # 1/3 is not a power of two: its fp32 reciprocal is a rounded quotient, compared with
    # float64 1/scale rounded once to fp32 (IEEE division)
    x = random_values(shape, torch.bfloat16, seed=11)
    scale = torch.tensor([3.0])
    expected_inv = torch.tensor([1.0 / 3.0], dtype=torch.float64).float()
    expected_amax = max(0.5, x.double().abs().max().item()) if x.numel() else 0.5
    (x_dev,) = on_device(x)
    for fn in (delayed_cast_triton, delayed_cast):
        slot = torch.tensor([0.5], device=x_dev.device)
        out = fn(x_dev, scale.to(x_dev.device), torch.float8_e4m3fn, slot, transpose=transpose)
        assert_bitwise_equal(out.scale_inv, expected_inv, f"{fn.__name__} scale_inv")
        assert slot.item() == expected_amax
        if transpose and len(shape) >= 1:
            exp_q, exp_t = ref.cast_transpose(x, scale, torch.float8_e4m3fn)
            assert_bitwise_equal(out.data_t, exp_t, f"{fn.__name__} q_t")
        else:
            exp_q = ref.cast_to_fp8(x, scale, torch.float8_e4m3fn)
            assert out.data_t is None
        assert_bitwise_equal(out.data, exp_q, f"{fn.__name__} q")


def test_bad_arguments_raise_value_errors_naming_the_op():
    x = torch.ones(4, 4, device=DEVICE)
    with pytest.raises(ValueError, match="cast_to_fp8.*fp8_dtype"):
        cast_to_fp8_triton(x, 1.0, torch.float16)
    with pytest.raises(ValueError, match="cast_to_fp8: scale must hold exactly one value"):
        cast_to_fp8_triton(x, torch.ones(2), torch.float8_e4m3fn)
    with pytest.raises(ValueError, match="cast_transpose: x must be fp32/bf16/fp16"):
        cast_transpose_triton(x.to(torch.int32), 1.0, torch.float8_e4m3fn)
    with pytest.raises(ValueError, match="amax_out must be a 1-element fp32"):
        cast_to_fp8_triton(x, 1.0, torch.float8_e4m3fn, amax_out=torch.zeros(2, device=DEVICE))
    with pytest.raises(ValueError, match="rank >= 1"):
        cast_transpose_triton(torch.ones((), device=DEVICE), 1.0, torch.float8_e4m3fn)
