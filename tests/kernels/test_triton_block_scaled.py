"""Triton MXFP8 and Float8 block casts against the reference, bit for bit.

Data is compared with the reference's data made contiguous: the reference returns a padded view for
a ragged 2D input (its zero-padding leaks into the strides), the kernels return contiguous data.
"""

import pytest
import torch
from dist_quant.kernels import reference as ref
from dist_quant.kernels.block import block_cast_triton
from dist_quant.kernels.mxfp8 import mxfp8_cast_triton
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


def _check_mxfp8(x, fp8_dtype, columnwise):
    q, e8m0 = mxfp8_cast_triton(*on_device(x), fp8_dtype, columnwise=columnwise)
    exp_q, exp_e = ref.mxfp8_cast(x, fp8_dtype, columnwise=columnwise)
    assert q.is_contiguous()
    assert_bitwise_equal(q, exp_q.contiguous(), "q")
    assert_bitwise_equal(e8m0, exp_e, "e8m0")


def _check_block(x, fp8_dtype, block_dim, pow2):
    q, s_inv = block_cast_triton(
        *on_device(x), fp8_dtype, block_dim=block_dim, use_power_2_scales=pow2
    )
    exp_q, exp_s = ref.block_cast(x, fp8_dtype, block_dim=block_dim, use_power_2_scales=pow2)
    assert q.is_contiguous()
    assert_bitwise_equal(q, exp_q.contiguous(), "q")
    assert_bitwise_equal(s_inv, exp_s, "scale_inv")


@pytest.mark.parametrize("columnwise", [False, True])
@pytest.mark.parametrize("fp8_dtype", FP8_DTYPES)
@pytest.mark.parametrize("shape", RAGGED_SHAPES + [(2, 64, 40)])
def test_mxfp8_cast_matches_reference_on_ragged_shapes(shape, fp8_dtype, columnwise):
    x = with_specials(random_values(shape, torch.bfloat16, seed=21))
    _check_mxfp8(x, fp8_dtype, columnwise)


@pytest.mark.parametrize("columnwise", [False, True])
@pytest.mark.parametrize("fp8_dtype", FP8_DTYPES)
def test_mxfp8_cast_of_grid_values_and_exact_power_of_two_block_maxima(fp8_dtype, columnwise):
    grid = fp8_grid_values(fp8_dtype)
    grid = grid[~grid.isnan() & ~grid.isinf()]  # one NaN/inf would turn its whole block to NaN
    fmax = torch.finfo(fp8_dtype).max
    # Blocks whose amax is fp8_max * 2**k exactly (E has no +1), one ulp above (E gets +1),
    # all zeros (E = 0), fp32 subnormals only (E = 0), and the bottom of the E8M0 range:
    # 2**-127 * fp8_max and its fp32 neighbours (E = 0, 0, 1), where amax / fp8_max is subnormal.
    bottom = torch.tensor(fmax * 2.0**-127, dtype=torch.float32)
    special_rows = [
        torch.full((32,), fmax * 2.0**-3),
        torch.full((32,), fmax * 2.0**-3 * (1 + 2.0**-23)),
        torch.zeros(32),
        torch.full((32,), 1e-42),
        torch.full((32,), -3.0e38),
        bottom.expand(32),
        torch.nextafter(bottom, torch.tensor(0.0)).expand(32),
        torch.nextafter(bottom, torch.tensor(1.0)).expand(32),
    ]
    n = -(-grid.numel() // 32) * 32
    x = torch.cat([torch.nn.functional.pad(grid, (0, n - grid.numel())), *special_rows])
    _check_mxfp8(x.reshape(-1, 32), fp8_dtype, columnwise)
    _check_mxfp8(x.reshape(-1, 32).t().contiguous(), fp8_dtype, columnwise)


@pytest.mark.parametrize("pow2", [True, False])
@pytest.mark.parametrize("block_dim", [1, 2])
@pytest.mark.parametrize("fp8_dtype", FP8_DTYPES)
@pytest.mark.parametrize("shape", RAGGED_SHAPES + [(3, 50, 300)])
def test_block_cast_matches_reference_on_ragged_shapes(shape, fp8_dtype, block_dim, pow2):
    x = with_specials(random_values(shape, torch.float32, seed=22))
    _check_block(x, fp8_dtype, block_dim, pow2)


@pytest.mark.parametrize("block_dim", [1, 2])
@pytest.mark.parametrize("fp8_dtype", FP8_DTYPES)
def test_block_cast_edge_tiles_zero_tiny_and_saturating(fp8_dtype, block_dim):
    # Tiles of zeros (scale 1), of fp32 subnormals (scale overflows -> FLT_MAX), of huge values,
    # of FP8 grid values, and one with inf (scale 1, the rest NaN-free).
    grid = fp8_grid_values(fp8_dtype)
    grid = grid[~grid.isnan() & ~grid.isinf()][:128]
    rows = [torch.zeros(128), torch.full((128,), 1e-44), torch.full((128,), 3.0e38), grid]
    inf_row = torch.linspace(-5, 5, 128)
    inf_row[7] = float("inf")
    x = torch.stack(rows + [inf_row])  # (5, 128)
    # 1x128: two rows per case; 128x128: one whole tile per case.
    x = x.repeat_interleave(2 if block_dim == 1 else 128, dim=0)
    _check_block(x, fp8_dtype, block_dim, pow2=False)
    _check_block(x, fp8_dtype, block_dim, pow2=True)


def test_noncontiguous_inputs_match_reference():
    base = random_values((96, 160), torch.bfloat16, seed=23).to(DEVICE, copy=True)
    for view in (base.t(), base[:, 3:150:2]):
        x = view.cpu()
        q, e = mxfp8_cast_triton(view, torch.float8_e4m3fn, columnwise=True)
        exp_q, exp_e = ref.mxfp8_cast(x, torch.float8_e4m3fn, columnwise=True)
        assert_bitwise_equal(q, exp_q, "mxfp8 q")
        assert_bitwise_equal(e, exp_e, "mxfp8 e8m0")
        q, s = block_cast_triton(view, torch.float8_e5m2, block_dim=2)
        exp_q, exp_s = ref.block_cast(x, torch.float8_e5m2, block_dim=2)
        assert_bitwise_equal(q, exp_q.contiguous(), "block q")
        assert_bitwise_equal(s, exp_s, "block scale_inv")


def test_bad_arguments_raise_value_errors_naming_the_op():
    x = torch.ones(4, 4, device=DEVICE)
    with pytest.raises(ValueError, match="block_cast: block_dim must be 1"):
        block_cast_triton(x, torch.float8_e4m3fn, block_dim=3)
    with pytest.raises(ValueError, match="mxfp8_cast: fp8_dtype"):
        mxfp8_cast_triton(x, torch.bfloat16)
    with pytest.raises(ValueError, match="mxfp8_cast: x must be fp32/bf16/fp16"):
        mxfp8_cast_triton(x.to(torch.float64), torch.float8_e4m3fn)
