"""The reference per-tensor cast, amax, cast+transpose and dequantize against an independent oracle.

Every FP8 byte is decoded from its bit fields in Python (fp8_oracle), and expected bytes come from a
nearest-value search over that table, so these tests pin torch's cast as well as our wrapper.
"""

import math

import numpy as np
import pytest
import torch
from dist_quant.kernels import reference as ref
from fp8_oracle import E4M3, E5M2, decode_all, decode_bytes, encode, f32, positive_codes

FORMATS = [(torch.float8_e4m3fn, E4M3), (torch.float8_e5m2, E5M2)]


def _cast_bytes(values: np.ndarray, fp8_dtype: torch.dtype, scale: float = 1.0) -> np.ndarray:
    x = torch.tensor(values, dtype=torch.float32)
    return ref.cast_to_fp8(x, torch.tensor(scale), fp8_dtype).view(torch.uint8).numpy()


def _assert_bytes_match(actual: np.ndarray, expected: np.ndarray, fmt) -> None:
    """Bytes equal, except NaN, whose sign/payload byte is free: compare NaN positions instead."""
    exp_nan = np.isnan(decode_bytes(fmt, expected))
    act_nan = np.isnan(decode_bytes(fmt, actual))
    np.testing.assert_array_equal(act_nan, exp_nan)
    np.testing.assert_array_equal(actual[~exp_nan], expected[~exp_nan])


@pytest.mark.parametrize("fp8_dtype,fmt", FORMATS)
def test_torch_decodes_every_byte_like_the_bit_field_oracle(fp8_dtype, fmt):
    decoded = torch.arange(256, dtype=torch.uint8).view(fp8_dtype).double().numpy()
    expected = np.array(decode_all(fmt))
    np.testing.assert_array_equal(np.isnan(decoded), np.isnan(expected))
    finite = ~np.isnan(expected)
    np.testing.assert_array_equal(decoded[finite], expected[finite])
    np.testing.assert_array_equal(np.signbit(decoded[finite]), np.signbit(expected[finite]))


@pytest.mark.parametrize("fp8_dtype,fmt", FORMATS)
def test_fp8_max_is_the_largest_finite_code(fp8_dtype, fmt):
    assert ref.fp8_max(fp8_dtype) == fmt.max == {"e4m3fn": 448.0, "e5m2": 57344.0}[fmt.name]


@pytest.mark.parametrize("fp8_dtype,fmt", FORMATS)
def test_every_code_point_casts_to_its_own_byte(fp8_dtype, fmt):
    values = np.array(decode_all(fmt))
    finite = np.isfinite(values)  # +-0 and subnormals included; -0 keeps its sign byte 0x80
    codes = np.arange(256, dtype=np.uint8)[finite]
    np.testing.assert_array_equal(_cast_bytes(values[finite], fp8_dtype), codes)


@pytest.mark.parametrize("fp8_dtype,fmt", FORMATS)
def test_midpoints_round_to_even_and_their_neighbours_round_to_nearest(fp8_dtype, fmt):
    table, codes = positive_codes(fmt)
    lo, hi = table[:-1], table[1:]
    mid = (lo + hi) / 2  # exact in fp32: one bit more than FP8's mantissa
    np.testing.assert_array_equal(f32(mid), mid)
    below = np.nextafter(mid.astype(np.float32), np.float32(-np.inf)).astype(np.float64)
    above = np.nextafter(mid.astype(np.float32), np.float32(np.inf)).astype(np.float64)
    even = np.where(codes[:-1] % 2 == 0, codes[:-1], codes[1:])
    for sign, sign_bit in ((1.0, 0), (-1.0, 0x80)):
        np.testing.assert_array_equal(_cast_bytes(sign * mid, fp8_dtype), even | sign_bit)
        np.testing.assert_array_equal(_cast_bytes(sign * below, fp8_dtype), codes[:-1] | sign_bit)
        np.testing.assert_array_equal(_cast_bytes(sign * above, fp8_dtype), codes[1:] | sign_bit)
    # The oracle's own tie rule agrees (it is used for the random and blockwise checks below).
    np.testing.assert_array_equal(encode(fmt, mid), even)


@pytest.mark.parametrize("fp8_dtype,fmt", FORMATS)
def test_values_past_max_and_infinities_saturate_and_nan_stays_nan(fp8_dtype, fmt):
    top = fmt.max
    grid_step = top - positive_codes(fmt)[0][-2]
    past = np.array(
        [
            np.nextafter(np.float32(top), np.float32(np.inf)),
            top + grid_step / 2,  # would round (ties to even) past max without saturation
            top + grid_step,
            1e30,
            float(np.finfo(np.float32).max),
            math.inf,
        ]
    )
    max_code = int(positive_codes(fmt)[1][-1])
    np.testing.assert_array_equal(_cast_bytes(past, fp8_dtype), np.full(6, max_code, np.uint8))
    np.testing.assert_array_equal(_cast_bytes(-past, fp8_dtype), np.full(6, max_code | 0x80))
    nan_out = ref.cast_to_fp8(torch.tensor([math.nan, -math.nan]), torch.tensor(1.0), fp8_dtype)
    assert torch.isnan(nan_out.float()).all()


@pytest.mark.parametrize("fp8_dtype,fmt", FORMATS)
def test_values_below_half_the_smallest_subnormal_flush_to_signed_zero(fp8_dtype, fmt):
    smallest = positive_codes(fmt)[0][1]
    tiny = np.array([smallest / 4, smallest / 2, 1e-30])
    np.testing.assert_array_equal(_cast_bytes(tiny, fp8_dtype), [0, 0, 0])
    np.testing.assert_array_equal(_cast_bytes(-tiny, fp8_dtype), [0x80, 0x80, 0x80])


@pytest.mark.parametrize("fp8_dtype,fmt", FORMATS)
@pytest.mark.parametrize("in_dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_scaled_cast_rounds_the_fp32_product(fp8_dtype, fmt, in_dtype):
    gen = torch.Generator().manual_seed(1)
    x = (torch.randn(3, 77, generator=gen) * 30).to(in_dtype)
    scale = 3.7
    x64 = x.double().numpy()
    expected = encode(fmt, f32(x64 * f32(scale)))  # fp32 product = fp32(exact float64 product)
    actual = ref.cast_to_fp8(x, torch.tensor([scale]), fp8_dtype)
    assert actual.shape == x.shape and actual.dtype == fp8_dtype
    np.testing.assert_array_equal(actual.view(torch.uint8).numpy(), expected)


@pytest.mark.parametrize("shape", [(0,), (0, 5), (5, 0), (7,), (2, 3, 45)])
def test_cast_transpose_returns_the_2d_transpose_of_the_cast(shape):
    x = torch.randn(shape) * 100
    q, qt = ref.cast_transpose(x, torch.tensor(2.0), torch.float8_e4m3fn)
    rows, cols = math.prod(shape[:-1]), shape[-1]
    assert q.shape == x.shape and qt.shape == (cols, rows) and qt.is_contiguous()
    expected = encode(E4M3, f32(x.double().numpy() * 2.0)).reshape(rows, cols)
    np.testing.assert_array_equal(q.view(torch.uint8).numpy().reshape(rows, cols), expected)
    np.testing.assert_array_equal(qt.view(torch.uint8).numpy(), expected.T)


def test_cast_of_a_0dim_tensor_keeps_0dim_even_with_a_1_element_scale():
    q = ref.cast_to_fp8(torch.tensor(3.0), torch.tensor([2.0]), torch.float8_e5m2)
    assert q.shape == () and q.float().item() == 6.0


@pytest.mark.parametrize("in_dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_amax_is_fp32_max_abs_propagates_nan_and_is_zero_when_empty(in_dtype):
    x = torch.tensor([[1.5, -7.25], [3.0, 0.0]], dtype=in_dtype)
    assert ref.amax(x).dtype == torch.float32 and ref.amax(x).shape == ()
    assert ref.amax(x).item() == 7.25
    assert math.isnan(ref.amax(torch.tensor([1.0, math.nan, math.inf], dtype=in_dtype)).item())
    assert ref.amax(torch.tensor([-math.inf], dtype=in_dtype)).item() == math.inf
    assert ref.amax(torch.empty(0, 3, dtype=in_dtype)).item() == 0.0


@pytest.mark.parametrize("fp8_dtype,fmt", FORMATS)
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
def test_dequantize_multiplies_by_scale_inv_in_fp32(fp8_dtype, fmt, out_dtype):
    q = torch.arange(256, dtype=torch.uint8).view(fp8_dtype)
    scale_inv = 0.3
    expected = f32(np.array(decode_all(fmt)) * f32(scale_inv))
    out = ref.dequantize(q, torch.tensor([scale_inv]), out_dtype)
    assert out.dtype == out_dtype and out.shape == (256,)
    expected_t = torch.tensor(expected, dtype=torch.float32).to(out_dtype)
    torch.testing.assert_close(out, expected_t, rtol=0, atol=0, equal_nan=True)


def test_invalid_fp8_dtype_and_multi_element_scale_are_rejected():
    with pytest.raises(ValueError, match="torch.float16"):
        ref.fp8_max(torch.float16)
    with pytest.raises(ValueError, match="exactly one value"):
        ref.cast_to_fp8(torch.ones(4), torch.ones(2), torch.float8_e4m3fn)
    with pytest.raises(ValueError, match="0-dim"):
        ref.cast_transpose(torch.tensor(1.0), torch.tensor(1.0), torch.float8_e4m3fn)
