"""SwiGLU and its backward fused with the per-tensor FP8 cast (``kernels/swiglu_cast.py``,
``kernels/swiglu_backward_cast.py``) against the unfused definition: SwiGLU's value (or its
gradient), then torch's own float8 cast with the same scale.

In the interpreter (CPU) SwiGLU's value is re-derived in numpy float32 in the order
``kernels/swiglu.py`` states (numpy's ``exp`` is what the interpreter runs for CUDA's ``expf``;
torch's CPU ``exp`` may differ by an ulp), the scale and amax in fp32 with torch, and the bytes by
torch's saturating cast. On a GPU the comparison is with the unfused ops run there: torch's
``F.silu(gate) * up`` on CUDA, then ``delayed_cast`` / ``current_scaling_cast``.
"""

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from dist_quant.kernels.swiglu_backward_cast import (
    current_swiglu_backward_cast_triton,
    delayed_swiglu_backward_cast_triton,
)
from dist_quant.kernels.swiglu_cast import current_swiglu_cast_triton, delayed_swiglu_cast_triton
from triton_cases import DEVICE, assert_bitwise_equal, random_values, with_specials

from dist_quant import kernels as K

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
DTYPES = [torch.bfloat16, torch.float16, torch.float32]
SHAPES = [(5, 2 * 123), (3, 7, 2 * 33), (1, 2), (70, 2 * 65)]


def _numpy_swiglu(h: torch.Tensor) -> torch.Tensor:
    """silu(g) * u in numpy float32, rounded to h's dtype after silu and after the product."""

    def rounded(v: np.ndarray) -> np.ndarray:
        return torch.from_numpy(v).to(h.dtype).float().numpy()  # torch rounds to nearest even

    g, u = np.split(h.float().numpy(), 2, axis=-1)
    with np.errstate(over="ignore", invalid="ignore"):
        silu = rounded(g / (np.float32(1) + np.exp(-g)))
        return torch.from_numpy(rounded(silu * u)).to(h.dtype)


def _torch_cast(a: torch.Tensor, scale: torch.Tensor, fp8: torch.dtype) -> torch.Tensor:
    """torch's own cast of fp32 ``a * scale``, saturated first (older torch casts overflow to
    NaN)."""
    fmax = torch.finfo(fp8).max
    return (a.float() * scale).clamp(-fmax, fmax).to(fp8)


def _check_bytes(out, a: torch.Tensor, scale: torch.Tensor, fp8: torch.dtype, transpose: bool):
    want = _torch_cast(a, scale, fp8)
    assert_bitwise_equal(out.data.cpu(), want, "q")
    if transpose:
        assert_bitwise_equal(out.data_t.cpu(), want.reshape(-1, want.shape[-1]).t().contiguous())
    else:
        assert out.data_t is None
    assert_bitwise_equal(out.scale_inv.cpu(), torch.reciprocal(scale).reshape(1), "scale_inv")


@pytest.mark.skipif(DEVICE != "cpu", reason="the interpreter's arithmetic (numpy) is checked here")
@pytest.mark.parametrize("fp8", [E4M3, E5M2])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_delayed_swiglu_cast_equals_torch_cast_of_swiglu_in_the_interpreter(shape, dtype, fp8):
    h = with_specials(random_values(shape, dtype, seed=shape[-1]) * 6)
    a = _numpy_swiglu(h)
    scale = torch.tensor([0.75 if fp8 == E4M3 else 3.0])
    amax_out = torch.tensor([2.5])  # a running max: the fold keeps the larger value
    for transpose in (True, False):
        amax = amax_out.clone()
        out = delayed_swiglu_cast_triton(h.clone(), scale, fp8, amax, transpose)
        _check_bytes(out, a, scale, fp8, transpose)
        want_amax = torch.maximum(amax_out, a.float().abs().max().reshape(1))  # NaN propagates
        assert_bitwise_equal(amax, want_amax, "amax")


@pytest.mark.skipif(DEVICE != "cpu", reason="the interpreter's arithmetic (numpy) is checked here")
@pytest.mark.parametrize("fp8", [E4M3, E5M2])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_current_swiglu_cast_equals_torch_cast_of_swiglu_in_the_interpreter(shape, dtype, fp8):
    h = random_values(shape, dtype, seed=shape[-1] + 1).clamp(-8, 8)  # finite activations
    a = _numpy_swiglu(h)
    amax = a.float().abs().max()
    scale = torch.tensor(torch.finfo(fp8).max, dtype=torch.float32) / amax  # fp32 IEEE division
    for transpose in (True, False):
        out = current_swiglu_cast_triton(h.clone(), fp8, 0.0, False, transpose)
        _check_bytes(out, a, scale.reshape(1), fp8, transpose)
        assert_bitwise_equal(out.amax, amax, "amax")
        assert_bitwise_equal(out.scale, scale.reshape(1), "scale")


def test_current_swiglu_cast_of_a_nan_activation_casts_with_scale_one():
    h = with_specials(random_values((9, 2 * 40), torch.float32, seed=3))  # a NaN reaches `a`
    out = current_swiglu_cast_triton(h, E4M3, 0.0, False, True)
    assert torch.isnan(out.amax) and out.scale.item() == 1.0
    _check_bytes(out, _numpy_swiglu(h), torch.ones(1), E4M3, True)


def test_bad_arguments_are_refused_naming_the_op():
    with pytest.raises(ValueError, match="h's last dim .* even"):
        delayed_swiglu_cast_triton(torch.zeros(2, 7), torch.ones(1), E4M3, torch.zeros(1), True)
    with pytest.raises(ValueError, match="delayed_swiglu_cast: scale must be a 1-element fp32"):
        delayed_swiglu_cast_triton(torch.zeros(2, 8), torch.ones(2), E4M3, torch.zeros(1), True)
    with pytest.raises(ValueError, match="current_swiglu_cast: fp8_dtype must be"):
        current_swiglu_cast_triton(torch.zeros(2, 8), torch.float16, 0.0, False, True)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("fp8", [E4M3, E5M2])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(4096, 2 * 1792), (3, 517, 2 * 1100), (1, 2)])
def test_fused_casts_equal_the_unfused_ops_on_the_gpu_bit_for_bit(shape, dtype, fp8):
    h = (random_values(shape, dtype, seed=shape[-1]) * 6).clamp(-30, 30).cuda()
    gate, up = h.chunk(2, dim=-1)
    a = F.silu(gate) * up  # torch's eager ops on CUDA: the unfused activation
    scale = torch.tensor([0.75], device="cuda")
    amax_f, amax_u = torch.full((1,), 0.5, device="cuda"), torch.full((1,), 0.5, device="cuda")
    fused = K.delayed_swiglu_cast(h, scale, fp8, amax_f, transpose=True)
    unfused = K.delayed_cast(a, scale, fp8, amax_u, transpose=True)
    for got, want, what in zip(fused, unfused, ("q", "q_t", "scale_inv")):
        assert_bitwise_equal(got, want, what)
    assert_bitwise_equal(amax_f, amax_u, "amax")
    fused = K.current_swiglu_cast(h, fp8, transpose=True)
    unfused = K.current_scaling_cast(a, fp8, transpose=True)
    for got, want, what in zip(fused, unfused, ("q", "q_t", "scale", "scale_inv", "amax")):
        assert_bitwise_equal(got, want, what)


# ---- the backward: swiglu_backward(dy, h) fused with fc1's grad-output cast ----------------------
def _numpy_swiglu_backward(dy: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
    """dh = [d_gate, d_up] in numpy float32 in ``kernels/swiglu.py``'s order, rounded to h's
    dtype where torch's ops round."""

    def rounded(v: np.ndarray) -> np.ndarray:
        return torch.from_numpy(v).to(h.dtype).float().numpy()

    g, u = np.split(h.float().numpy(), 2, axis=-1)
    d = dy.float().numpy()
    one = np.float32(1)
    with np.errstate(over="ignore", invalid="ignore"):
        denom = one + np.exp(-g)
        silu, sig = rounded(g / denom), one / denom
        d_gate = rounded(rounded(d * u) * sig * (one + g * (one - sig)))
        dh = np.concatenate([d_gate, rounded(d * silu)], axis=-1)
    return torch.from_numpy(dh).to(h.dtype)


def _grad_operands(shape, dtype, seed, specials):
    """``(dy, h)``: with ``specials`` NaN/inf planted in ``h``, else every gradient finite (fp16's
    range included), as current scaling's scale formula needs to be checked."""
    h = random_values(shape, dtype, seed) * 6
    dy = random_values((*shape[:-1], shape[-1] // 2), dtype, seed + 7)
    if specials:
        return dy, with_specials(h)
    return dy.clamp(-1000, 1000), h.clamp(-8, 8)


@pytest.mark.skipif(DEVICE != "cpu", reason="the interpreter's arithmetic (numpy) is checked here")
@pytest.mark.parametrize("fp8", [E4M3, E5M2])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_delayed_swiglu_backward_cast_equals_torch_cast_of_the_gradient_in_the_interpreter(
    shape, dtype, fp8
):
    dy, h = _grad_operands(shape, dtype, shape[-1] + 2, specials=True)
    dh = _numpy_swiglu_backward(dy, h)
    scale = torch.tensor([0.75 if fp8 == E4M3 else 3.0])
    amax_out = torch.tensor([2.5])
    for transpose in (True, False):
        amax = amax_out.clone()
        out = delayed_swiglu_backward_cast_triton(dy, h.clone(), scale, fp8, amax, transpose)
        _check_bytes(out, dh, scale, fp8, transpose)
        want_amax = torch.maximum(amax_out, dh.float().abs().max().reshape(1))  # NaN propagates
        assert_bitwise_equal(amax, want_amax, "amax")


@pytest.mark.skipif(DEVICE != "cpu", reason="the interpreter's arithmetic (numpy) is checked here")
@pytest.mark.parametrize("fp8", [E4M3, E5M2])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_current_swiglu_backward_cast_equals_torch_cast_of_the_gradient_in_the_interpreter(
    shape, dtype, fp8
):
    dy, h = _grad_operands(shape, dtype, shape[-1] + 3, specials=False)
    dh = _numpy_swiglu_backward(dy, h)
    amax = dh.float().abs().max()
    scale = torch.tensor(torch.finfo(fp8).max, dtype=torch.float32) / amax  # fp32 IEEE division
    if amax == 0:  # fp16 flushed a tiny dy: the contract's scale for a zero amax
        scale = torch.tensor(1.0)
    for transpose in (True, False):
        out = current_swiglu_backward_cast_triton(dy, h.clone(), fp8, 0.0, False, transpose)
        _check_bytes(out, dh, scale.reshape(1), fp8, transpose)
        assert_bitwise_equal(out.amax, amax, "amax")
        assert_bitwise_equal(out.scale, scale.reshape(1), "scale")


def test_swiglu_backward_cast_refuses_a_dy_that_does_not_match_h():
    h = torch.zeros(3, 8)
    with pytest.raises(ValueError, match=r"delayed_swiglu_backward_cast: dy must be .* \(3, 4\)"):
        delayed_swiglu_backward_cast_triton(torch.zeros(3, 8), h, torch.ones(1), E5M2,
                                            torch.zeros(1), True)  # fmt: skip
    with pytest.raises(ValueError, match="current_swiglu_backward_cast: dy must be torch.float32"):
        current_swiglu_backward_cast_triton(torch.zeros(3, 4, dtype=torch.float16), h, E5M2)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("fp8", [E4M3, E5M2])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(4096, 2 * 1792), (3, 517, 2 * 1100), (1, 2)])
def test_fused_backward_casts_equal_the_unfused_ops_on_the_gpu_bit_for_bit(shape, dtype, fp8):
    h = (random_values(shape, dtype, seed=shape[-1]) * 6).clamp(-30, 30).cuda()
    dy = random_values((*shape[:-1], shape[-1] // 2), dtype, seed=5).cuda()
    leaf = h.clone().requires_grad_(True)
    gate, up = leaf.chunk(2, dim=-1)
    (F.silu(gate) * up).backward(dy)  # torch's eager autograd on CUDA: the unfused gradient
    dh = leaf.grad
    scale = torch.tensor([2.0], device="cuda")
    amax_f, amax_u = torch.full((1,), 0.5, device="cuda"), torch.full((1,), 0.5, device="cuda")
    fused = K.delayed_swiglu_backward_cast(dy, h, scale, fp8, amax_f, transpose=True)
    unfused = K.delayed_cast(dh, scale, fp8, amax_u, transpose=True)
    for got, want, what in zip(fused, unfused, ("q", "q_t", "scale_inv")):
        assert_bitwise_equal(got, want, what)
    assert_bitwise_equal(amax_f, amax_u, "amax")
    fused = K.current_swiglu_backward_cast(dy, h, fp8, transpose=True)
    unfused = K.current_scaling_cast(dh, fp8, transpose=True)
    for got, want, what in zip(fused, unfused, ("q", "q_t", "scale", "scale_inv", "amax")):
        assert_bitwise_equal(got, want, what)
