"""SwiGLU's kernels (``kernels/swiglu.py``) against what eager torch computes.

On a GPU the contract is torch's own bits: the kernels equal ``F.silu(gate) * up`` and its
autograd gradient run by torch on the same device, bit for bit. In the interpreter (CPU) the
kernels are checked against an independent float32 re-derivation in numpy, step by step in the
order the docstring gives: numpy's ``exp`` is what the interpreter runs for CUDA's ``expf``, so
that is exact there too (torch's CPU ``exp`` is another implementation, within an ulp). The
reference itself is checked against autograd on the CPU.
"""

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from dist_quant.kernels.swiglu import (
    swiglu_backward_reference,
    swiglu_backward_triton,
    swiglu_reference,
    swiglu_triton,
)
from triton_cases import DEVICE, assert_bitwise_equal, random_values, with_specials

from dist_quant import kernels as K

DTYPES = [torch.bfloat16, torch.float16, torch.float32]


def _operands(shape, dtype, seed):
    """h = [gate, up] of `shape` (last dim even) with specials and large negatives, and dy."""
    h = with_specials(random_values(shape, dtype, seed) * 6)
    dy = random_values((*shape[:-1], shape[-1] // 2), dtype, seed + 1)
    return h, dy


def _rounded(x: np.ndarray, dtype: torch.dtype) -> np.ndarray:
    return torch.from_numpy(x).to(dtype).float().numpy()  # torch's casts round to nearest even


def _numpy_swiglu(h: torch.Tensor, dy: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The docstring's arithmetic in numpy float32, rounding to h's dtype where torch does."""
    dtype = h.dtype
    hf = h.float().numpy()
    g, u = np.split(hf, 2, axis=-1)
    d = dy.float().numpy()
    with np.errstate(over="ignore", invalid="ignore"):
        denom = np.float32(1) + np.exp(-g)
        silu = _rounded(g / denom, dtype)
        sig = np.float32(1) / denom
        out = _rounded(silu * u, dtype)
        d_silu = _rounded(d * u, dtype)
        d_gate = _rounded(d_silu * sig * (np.float32(1) + g * (np.float32(1) - sig)), dtype)
        d_up = _rounded(d * silu, dtype)
    dh = np.concatenate([d_gate, d_up], axis=-1)
    return torch.from_numpy(out).to(dtype), torch.from_numpy(dh).to(dtype)


@pytest.mark.skipif(DEVICE != "cpu", reason="the interpreter's arithmetic (numpy) is checked here")
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(5, 2 * 123), (3, 7, 2 * 33), (1, 2), (0, 8)])
def test_kernels_do_the_stated_arithmetic_in_the_interpreter(dtype, shape):
    h, dy = _operands(shape, dtype, seed=len(shape) + shape[-1])
    exp_out, exp_dh = _numpy_swiglu(h, dy)
    assert_bitwise_equal(swiglu_triton(h.clone()), exp_out, "swiglu")
    assert_bitwise_equal(swiglu_backward_triton(dy.clone(), h.clone()), exp_dh, "backward")


@pytest.mark.parametrize("dtype", DTYPES)
def test_the_reference_is_what_autograd_computes_for_silu_times_up(dtype):
    h, dy = _operands((4, 9, 2 * 40), dtype, seed=7)
    leaf = h.clone().requires_grad_(True)
    gate, up = leaf.chunk(2, dim=-1)
    out = F.silu(gate) * up
    out.backward(dy)
    assert_bitwise_equal(swiglu_reference(h), out.detach(), "forward")
    assert_bitwise_equal(swiglu_backward_reference(dy, h), leaf.grad, "backward")


def test_an_odd_last_dim_is_refused_naming_the_op():
    with pytest.raises(ValueError, match="kernels.swiglu.swiglu: h's last dim .* even"):
        swiglu_triton(torch.zeros(2, 7))
    with pytest.raises(ValueError, match="swiglu_backward: dy must be torch.float32 of shape"):
        swiglu_backward_triton(torch.zeros(2, 3), torch.zeros(2, 8))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(4096, 2 * 1792), (3, 517, 2 * 1100), (1, 2)])
def test_kernels_equal_torch_eager_on_the_gpu_bit_for_bit(dtype, shape):
    h, dy = (t.cuda() for t in _operands(shape, dtype, seed=shape[-1]))
    leaf = h.clone().requires_grad_(True)
    gate, up = leaf.chunk(2, dim=-1)
    out = F.silu(gate) * up
    out.backward(dy)
    assert_bitwise_equal(K.swiglu(h), out.detach(), "forward")
    assert_bitwise_equal(K.swiglu_backward(dy, h), leaf.grad, "backward")
