"""RMSNorm fused with the delayed FP8 cast (``kernels/rmsnorm_cast.py``): the proof it needs
before any module uses it.

The GPU test is the contract: the kernel's normalised output equals torch's own CUDA
``F.rms_norm`` bit for bit, and its bytes and amax equal ``delayed_cast`` of that output. Until it
passes on the H200 the modules keep ``F.rms_norm`` then the cast. In the interpreter (CPU) the
kernel is checked against a numpy re-derivation of the summation order the docstring states (fma
emulated in float64: exact products, one rounding to fp32) and ``1 / sqrt`` for ``rsqrtf``, and
its bytes against torch's own saturating cast of its output.
"""

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from dist_quant.kernels.rmsnorm_cast import rmsnorm_cast_triton
from triton_cases import DEVICE, assert_bitwise_equal

from dist_quant import kernels as K

E4M3 = torch.float8_e4m3fn
EPS = 1e-5


def _numpy_rms_norm(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """The stated order: 512 per-thread fma chains over 4-element vectors, lane then warp halving,
    IEEE division by N, reciprocal square root, gamma * (rstd * x) rounded to x's dtype."""
    f32, f64 = np.float32, np.float64
    xs = x.float().numpy().reshape(-1, x.shape[-1])
    wf = w.float().numpy()
    n = xs.shape[1]
    out = np.empty_like(xs)
    t = np.arange(512)
    for r, row in enumerate(xs):
        s = np.zeros(512, dtype=f32)
        for i in range(-(-n // 2048)):
            for k in range(4):
                idx = (i * 512 + t) * 4 + k
                v = np.where(idx < n, row[np.minimum(idx, n - 1)], f32(0)).astype(f64)
                s = (v * v + s.astype(f64)).astype(f32)
        s = s.reshape(16, 32)
        for half in (16, 8, 4, 2, 1):
            s = s[:, :half] + s[:, half : 2 * half]
        s = s[:, 0]
        for half in (8, 4, 2, 1):
            s = s[:half] + s[half : 2 * half]
        rstd = f32(1) / np.sqrt(f32(s[0] / f32(n)) + f32(EPS))
        out[r] = wf * (rstd * row)
    return torch.from_numpy(out).reshape(x.shape).to(x.dtype)


def _run(x, w, scale, transpose=True):
    amax = torch.zeros(1, device=x.device)
    out = rmsnorm_cast_triton(x, w, EPS, scale, E4M3, amax, transpose=transpose, write_y=True)
    return (*out, amax)


@pytest.mark.skipif(DEVICE != "cpu", reason="the interpreter's arithmetic (numpy) is checked here")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("shape", [(3, 2052), (2, 5, 64), (1, 4)])
def test_kernel_sums_in_the_stated_order_and_casts_its_output_in_the_interpreter(shape, dtype):
    g = torch.Generator().manual_seed(shape[-1])
    x = (torch.randn(shape, generator=g) * 3).to(dtype)
    w = (torch.rand(shape[-1], generator=g) + 0.5).to(dtype)
    scale = torch.tensor([2.0])
    y, q, q_t, scale_inv, rstd, amax = _run(x, w, scale)
    assert_bitwise_equal(y, _numpy_rms_norm(x, w), "y")
    want = (y.float() * scale).clamp(-448, 448).to(E4M3)  # torch's own cast of the output
    assert_bitwise_equal(q, want, "q")
    assert_bitwise_equal(q_t, want.reshape(-1, shape[-1]).t().contiguous(), "q_t")
    assert_bitwise_equal(amax, y.float().abs().max().reshape(1), "amax")
    assert_bitwise_equal(scale_inv, torch.tensor([0.5]), "scale_inv")
    assert rstd.shape == (y.numel() // shape[-1],)


def test_shapes_off_torchs_vectorised_path_are_refused():
    with pytest.raises(ValueError, match="multiple of 4"):
        _run(torch.zeros(2, 6), torch.ones(6), torch.ones(1))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("shape", [(8192, 4096), (2, 1000, 8192), (3, 4), (5, 6144 + 4)])
def test_kernel_equals_torch_cuda_rms_norm_then_the_cast_bit_for_bit(shape, dtype):
    """The proof the module path waits for (torch's CUDA F.rms_norm, then delayed_cast)."""
    g = torch.Generator().manual_seed(shape[-1])
    x = (torch.randn(shape, generator=g) * 3).to(dtype).cuda()
    w = (torch.rand(shape[-1], generator=g) + 0.5).to(dtype).cuda()
    scale = torch.tensor([2.0], device="cuda")
    y, q, q_t, scale_inv, _, amax = _run(x, w, scale)
    want_y = F.rms_norm(x, (shape[-1],), w, EPS)
    assert_bitwise_equal(y, want_y, "F.rms_norm")
    want_amax = torch.zeros(1, device="cuda")
    want = K.delayed_cast(want_y, scale, E4M3, want_amax, transpose=True)
    assert_bitwise_equal(q, want.data, "q")
    assert_bitwise_equal(q_t, want.data_t, "q_t")
    assert_bitwise_equal(amax, want_amax, "amax")
