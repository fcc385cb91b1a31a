"""Formats and quantizers: scales re-derived in float64, data against torch's own saturating cast,
amax bookkeeping of delayed scaling, usage flags, and a hypothesis round-trip error bound.

The bit-level cast itself is pinned against an independent decoder in tests/kernels/; here torch's
cast of the independently computed fp32 product is the reference for the bytes.
"""

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays

import dist_quant
from dist_quant import (
    Float8BlockQuantizer,
    Float8CurrentScalingQuantizer,
    Float8Quantizer,
    Format,
    IdentityQuantizer,
    MXFP8Quantizer,
    NVFP4Quantizer,
)
from dist_quant.formats import bwd_dtype, fwd_dtype

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
FP8_MAX = {E4M3: 448.0, E5M2: 57344.0}
# (mantissa bits, smallest normal exponent) of each format, for its grid spacing.
GRID = {E4M3: (3, -6), E5M2: (2, -14)}


def f32(x):
    with np.errstate(over="ignore"):
        return np.asarray(x, dtype=np.float64).astype(np.float32).astype(np.float64)


def torch_cast_bytes(x: torch.Tensor, scale: float, fp8_dtype: torch.dtype) -> np.ndarray:
    """torch's own cast of the fp32 product, saturated: the contract's q."""
    product = torch.tensor(f32(x.double().numpy() * scale), dtype=torch.float32)
    limit = FP8_MAX[fp8_dtype]
    return product.clamp(-limit, limit).to(fp8_dtype).view(torch.uint8).numpy()


def half_ulp(y: np.ndarray, fp8_dtype: torch.dtype) -> np.ndarray:
    mbits, emin = GRID[fp8_dtype]
    exponent = np.frexp(np.abs(y))[1] - 1  # floor(log2 |y|); y = 0 falls under emin
    return 2.0 ** (np.maximum(exponent, emin) - mbits) / 2


def current_scale(amax: float, fp8_dtype: torch.dtype, pow2: bool) -> float:
    """The contract's current-scaling scale, from float64 math rounded once to fp32."""
    if amax == 0:
        return 1.0
    scale = float(f32(FP8_MAX[fp8_dtype] / amax))
    scale = float(np.finfo(np.float32).max) if math.isinf(scale) else scale
    return 2.0 ** (math.frexp(scale)[1] - 1) if pow2 else scale


def test_formats_map_to_forward_and_backward_dtypes():
    assert (fwd_dtype(Format.E4M3), bwd_dtype(Format.E4M3)) == (E4M3, E4M3)
    assert (fwd_dtype(Format.E5M2), bwd_dtype(Format.E5M2)) == (E5M2, E5M2)
    assert (fwd_dtype(Format.HYBRID), bwd_dtype(Format.HYBRID)) == (E4M3, E5M2)
    with pytest.raises(ValueError, match="'E4M3'"):
        fwd_dtype("E4M3")


@pytest.mark.parametrize(
    "make",
    [
        lambda d: Float8Quantizer(torch.ones(1), torch.zeros(1), d),
        lambda d: Float8CurrentScalingQuantizer(d),
        lambda d: MXFP8Quantizer(d),
        lambda d: Float8BlockQuantizer(d),
    ],
)
def test_quantizers_reject_non_fp8_dtypes_by_name(make):
    with pytest.raises(ValueError, match="torch.float16"):
        make(torch.float16)


def test_constructor_and_usage_arguments_are_validated():
    with pytest.raises(ValueError, match="block_scaling_dim"):
        Float8BlockQuantizer(block_scaling_dim=3)
    with pytest.raises(ValueError, match="scale must be a 1-element float32"):
        Float8Quantizer(torch.ones(1, dtype=torch.float64), torch.zeros(1), E4M3)
    with pytest.raises(ValueError, match="amax must be a 1-element float32"):
        Float8Quantizer(torch.ones(1), torch.zeros(2), E4M3)
    with pytest.raises(ValueError, match="amax_epsilon"):
        Float8CurrentScalingQuantizer(E4M3, amax_epsilon=-1.0)
    q = MXFP8Quantizer()
    with pytest.raises(ValueError, match="at least one"):
        q.set_usage(rowwise=False, columnwise=False)
    assert (q.rowwise_usage, q.columnwise_usage) == (True, True)
    with pytest.raises(ValueError, match="int64"):
        q.quantize(torch.ones(4, dtype=torch.int64))


def test_public_names_are_importable_from_the_package():
    for name in ("Format", "Quantizer", "QuantizedTensor", "Float8Tensor", "MXFP8Tensor"):
        assert hasattr(dist_quant, name)


# --- delayed scaling ---------------------------------------------------------------------------


def test_delayed_quantizer_folds_a_running_max_into_the_history_row_and_casts_with_scale():
    history = torch.zeros(4, 3)  # (L, slots), owned by a recipe state
    scales = torch.tensor([1.0, 3.0, 1.0])
    q = Float8Quantizer(scales[1:2], history[0][1:2], E4M3)
    xs = [torch.tensor([[1.0, -5.5]]), torch.tensor([[2.0, 0.25]]), torch.tensor([[-7.0, 3.0]])]
    outs = [q.quantize(x) for x in xs[:2]]
    assert history[0, 1].item() == 5.5 and history.count_nonzero().item() == 1
    outs.append(q.quantize(xs[2]))
    assert history[0, 1].item() == 7.0
    for x, out in zip(xs, outs, strict=True):
        assert out.scale_inv.item() == f32(1.0 / 3.0)
        np.testing.assert_array_equal(
            out.data.view(torch.uint8).numpy(), torch_cast_bytes(x, 3, E4M3)
        )
    scales[1] = 5.0  # the next step's scale: already-quantized tensors keep their scale_inv
    assert outs[0].scale_inv.item() == f32(1.0 / 3.0)
    assert q.quantize(xs[0]).scale_inv.item() == f32(1.0 / 5.0)


def test_delayed_quantizer_propagates_nan_into_amax_so_the_update_keeps_the_scale():
    amax = torch.zeros(1)
    q = Float8Quantizer(torch.ones(1), amax, E5M2)
    q.quantize(torch.tensor([1.0, math.nan]))
    q.quantize(torch.tensor([100.0]))
    assert math.isnan(amax.item())


# --- current scaling ---------------------------------------------------------------------------


@pytest.mark.parametrize("fp8_dtype", [E4M3, E5M2])
@pytest.mark.parametrize("pow2", [False, True])
@pytest.mark.parametrize("epsilon", [0.0, 100.0])
@pytest.mark.parametrize("in_dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_current_scaling_uses_this_tensors_amax(fp8_dtype, pow2, epsilon, in_dtype):
    x = (torch.randn(3, 5, 37, generator=torch.Generator().manual_seed(0)) * 9).to(in_dtype)
    q = Float8CurrentScalingQuantizer(fp8_dtype, use_power_2_scales=pow2, amax_epsilon=epsilon)
    out = q.quantize(x)
    scale = current_scale(max(float(x.double().abs().max()), epsilon), fp8_dtype, pow2)
    assert out.scale_inv.item() == f32(1.0 / scale)
    assert out.dtype == in_dtype and out.shape == x.shape and out.fp8_dtype == fp8_dtype
    np.testing.assert_array_equal(
        out.data.view(torch.uint8).numpy(), torch_cast_bytes(x, scale, fp8_dtype)
    )


@pytest.mark.parametrize("x", [torch.zeros(4, 4), torch.empty(0, 8)])
def test_current_scaling_of_an_all_zero_or_empty_tensor_uses_scale_one(x):
    out = Float8CurrentScalingQuantizer(E4M3).quantize(x)
    assert out.scale_inv.item() == 1.0 and out.data.shape == x.shape


def test_current_scaling_with_a_group_scales_by_the_reduced_amax(monkeypatch):
    """A stand-in all-reduce reports a larger amax from another rank; the scale must follow it."""
    calls = []

    def fake_allreduce(amax: torch.Tensor, group: object) -> None:
        calls.append((amax.dtype, amax.numel(), group))
        amax.copy_(torch.maximum(amax, torch.tensor(56.0)))

    monkeypatch.setattr("dist_quant.quantizers.allreduce_current_amax", fake_allreduce)
    out = Float8CurrentScalingQuantizer(E4M3, amax_reduction_group="tp").quantize(torch.ones(8))
    assert calls == [(torch.float32, 1, "tp")]
    assert out.scale_inv.item() == f32(1.0 / f32(448.0 / 56.0))


# --- block scaling quantizers -------------------------------------------------------------------


def test_mxfp8_quantizer_quantizes_the_columnwise_copy_from_the_original():
    # Column 0 holds one large value per 32 rows, so column blocks and row blocks differ in scale.
    x = torch.full((64, 40), 0.5)
    x[3, 0] = 300.0
    out = MXFP8Quantizer().quantize(x)
    cw = out.columnwise_operand()
    assert cw.shape == (40, 64) and cw.scale_inv.shape == (40, 2)
    # Column 0, rows 0..31: amax 300 -> v = 300/448, exponent 127 + ceil(log2 v) = 127.
    # Column 1, rows 0..31: amax 0.5 -> v = 0.5/448 -> 127 + ceil(log2 v) = 127 - 9.
    assert cw.scale_inv[0, 0].item() == 127 + math.ceil(math.log2(300 / 448))
    assert cw.scale_inv[1, 0].item() == 127 + math.ceil(math.log2(0.5 / 448))
    rw = out.rowwise_operand()
    assert rw.scale_inv.shape == (64, 2)
    assert rw.scale_inv[0, 0].item() == 127 + math.ceil(math.log2(0.5 / 448))  # row 0: all 0.5
    # Element (3, 0) = 300 in a block scaled by 2**0 both ways: E4M3 spacing 32 there -> 288.
    assert cw.dequantize()[0, 3].item() == rw.dequantize()[3, 0].item() == 288.0


@pytest.mark.parametrize("usage", [(True, False), (False, True)])
def test_block_quantizers_produce_only_the_requested_copy(usage):
    x = torch.randn(130, 200)
    for q in (MXFP8Quantizer(), Float8BlockQuantizer(block_scaling_dim=1)):
        q.set_usage(rowwise=usage[0], columnwise=usage[1])
        out = q.quantize(x)
        missing = out.columnwise_operand if usage[0] else out.rowwise_operand
        with pytest.raises(ValueError, match="set_usage"):
            missing()


def test_1x128_columnwise_scales_come_from_column_tiles_of_the_original():
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(300, 3, generator=gen) * torch.tensor([1.0, 100.0, 1e-3])
    out = Float8BlockQuantizer(block_scaling_dim=1).quantize(x)
    cw = out.columnwise_operand()
    assert cw.shape == (3, 300) and cw.scale_inv.shape == (3, 3)
    x64 = x.double().numpy()
    for col in range(3):
        for tile in range(3):
            amax = np.abs(x64[tile * 128 : (tile + 1) * 128, col]).max()
            scale = 2.0 ** (math.frexp(float(f32(448.0 / amax)))[1] - 1)
            assert cw.scale_inv[col, tile].item() == 1.0 / scale


def test_identity_quantizer_returns_its_input_unchanged():
    x = torch.randn(3, 4, dtype=torch.bfloat16)
    q = IdentityQuantizer()
    assert q.quantize(x) is x and q.fp8_dtype is None and q.scaling == "identity"


# --- round trip error bound ----------------------------------------------------------------------

finite_f32 = st.floats(-1e4, 1e4, width=32, allow_nan=False, allow_infinity=False)


@settings(max_examples=50, deadline=None)
@given(
    x=arrays(np.float32, st.tuples(st.integers(1, 4), st.integers(1, 70)), elements=finite_f32),
    fp8_dtype=st.sampled_from([E4M3, E5M2]),
    pow2=st.booleans(),
)
def test_current_scaling_round_trip_is_within_half_an_fp8_ulp_of_the_scaled_value(
    x, fp8_dtype, pow2
):
    out = Float8CurrentScalingQuantizer(fp8_dtype, use_power_2_scales=pow2).quantize(
        torch.from_numpy(x)
    )
    x64 = x.astype(np.float64)
    scale = current_scale(float(np.abs(x64).max()), fp8_dtype, pow2)
    y = f32(x64 * scale)
    # Half an FP8 ulp at the scaled value, mapped back by 1/scale; the fp32 roundings of the
    # product, of 1/scale and of the dequantizing product add a few 2**-24 relative.
    bound = half_ulp(y, fp8_dtype) / scale * (1 + 2.0**-20) + np.abs(x64) * 2.0**-21
    err = np.abs(out.dequantize().double().numpy() - x64)
    assert (err <= bound).all()


@settings(max_examples=50, deadline=None)
@given(
    x=arrays(np.float32, st.tuples(st.integers(1, 5), st.integers(1, 80)), elements=finite_f32),
    fp8_dtype=st.sampled_from([E4M3, E5M2]),
)
def test_mxfp8_round_trip_is_within_half_an_fp8_ulp_of_the_block_scaled_value(x, fp8_dtype):
    out = MXFP8Quantizer(fp8_dtype).quantize(torch.from_numpy(x))
    x64 = x.astype(np.float64)
    block_amax = np.array(
        [[np.abs(row[b : b + 32]).max() for b in range(0, row.size, 32)] for row in x64]
    )
    v = f32(block_amax / FP8_MAX[fp8_dtype])
    mantissa, e = np.frexp(v)  # v = mantissa * 2**e, mantissa in [0.5, 1)
    exponent = np.where(mantissa == 0.5, e - 1, e)  # RCEIL: smallest power of two >= v
    # Contract corners: v == 0 -> E8M0 code 0 (2**-127); an fp32-subnormal v -> code 1 (2**-126).
    exponent = np.where(v == 0, -127, np.where(v < 2.0**-126, -126, exponent))
    block_scale = np.repeat(2.0**exponent, 32, axis=1)[:, : x.shape[1]]
    y = x64 / block_scale  # exact: a power of two
    err = np.abs(out.dequantize().double().numpy() - x64)
    assert (err <= half_ulp(y, fp8_dtype) * block_scale).all()


class _SubclassedCurrent(Float8CurrentScalingQuantizer):
    def __init__(self, note: str) -> None:
        super().__init__(E4M3, use_power_2_scales=True)
        self.note = note


_TP_QUANTIZERS = {
    "current": lambda: Float8CurrentScalingQuantizer(
        E5M2, use_power_2_scales=True, amax_epsilon=1e-3
    ),
    "nvfp4": lambda: NVFP4Quantizer(block_2d=True, rht=True, seed=7, reduce_amax=True),
    "subclass": lambda: _SubclassedCurrent("kept"),
}


def _planned(make):
    q = make()
    q.set_usage(rowwise=False, columnwise=True)
    q.stats_slot = ("layers.0.fc1", "input", "forward")
    return q


@pytest.mark.parametrize("kind", list(_TP_QUANTIZERS))
def test_tensor_parallel_copy_differs_from_the_quantizer_only_in_its_reduction_group(kind) -> None:
    q = _planned(_TP_QUANTIZERS[kind])
    tp = q.with_amax_reduction_group("tp-group")
    assert type(tp) is type(q) and tp is not q
    assert q.amax_reduction_group is None
    assert vars(tp) == {**vars(q), "amax_reduction_group": "tp-group"}


@pytest.mark.usefixtures("fresh_dynamo")
@pytest.mark.parametrize("kind", ["current", "nvfp4"])
def test_tensor_parallel_copy_made_while_tracing_keeps_every_constructor_field(kind) -> None:
    """A compiled TP forward makes the copy while dynamo traces, through the class's constructor
    (torch 2.11's dynamo cannot trace copy.copy): a field that constructor call missed would be
    silently reset in every compiled TP copy. The telemetry slot is left unread there."""
    q = _planned(_TP_QUANTIZERS[kind])

    def regroup(x: torch.Tensor) -> tuple:
        return x + 1, q.with_amax_reduction_group("tp-group")

    _, tp = torch.compile(regroup, backend="eager", fullgraph=True)(torch.zeros(1))
    assert type(tp) is type(q) and tp is not q
    want = {**vars(q), "amax_reduction_group": "tp-group"}
    del want["stats_slot"]
    assert vars(tp) == want
