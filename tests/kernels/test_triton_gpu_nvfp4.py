"""The NVFP4 cast compiled for a CUDA device against the reference run on the CPU, at real sizes, on
every bf16 value and on every E2M1 rounding tie at many block scales; and the reference itself run
on CUDA tensors, which must give the CPU's bits (it is the GEMM emulation on GPUs without FP4
tensor cores)."""

import pytest
import torch
from dist_quant.kernels import reference_nvfp4 as ref
from test_triton_nvfp4 import MODES, _amax_of
from triton_cases import assert_bitwise_equal, random_values, with_specials

from dist_quant import kernels as K

pytestmark = pytest.mark.gpu


def _check_cuda(x: torch.Tensor, mode: dict, amax: torch.Tensor, xd: torch.Tensor) -> None:
    out = K.nvfp4_cast(xd, amax.cuda(), **mode)
    exp = ref.nvfp4_cast(x, amax, **mode)
    for got, want, name in zip(out, exp, ("data", "scales", "s_dec")):
        assert_bitwise_equal(got, want, name)


@pytest.mark.parametrize("mode", MODES.values(), ids=MODES.keys())
def test_cast_at_real_sizes_and_on_views(mode):
    base = random_values((2000, 3104), torch.bfloat16, seed=300)
    x = with_specials(base[:, :1552].contiguous())  # NaN and inf in a few blocks
    _check_cuda(x, mode, _amax_of(base[:, :1552], mode), x.cuda())
    view = base.cuda()[::1, 1552:]  # rows of 3104 elements: a strided input
    _check_cuda(view.cpu(), mode, _amax_of(view.cpu(), mode), view)


@pytest.mark.parametrize("mode", MODES.values(), ids=MODES.keys())
def test_cast_of_every_bf16_value(mode):
    x = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
    x = x.reshape(4096, 16)[:, torch.randperm(16, generator=torch.Generator().manual_seed(1))]
    x = x.reshape(1024, 64) if not mode.get("columnwise") else x.reshape(64, 1024)
    for amax in (torch.tensor([3.0e38]), torch.tensor([1.0]), torch.tensor([float("nan")])):
        _check_cuda(x, mode, amax, x.cuda())


def test_every_e2m1_tie_at_many_block_scales():
    # rows: a block amax 6 * 2**e (so s_b runs over E4M3's range) and every tie and its neighbours
    ties = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0])
    up, down = torch.nextafter(ties, torch.tensor(9.0)), torch.nextafter(ties, torch.tensor(0.0))
    row = torch.cat([torch.tensor([6.0]), ties, up, down[:-1] * -1])[:16]
    rows = torch.stack([row * 2.0**e for e in range(-20, 20)])
    for mode in (MODES["rowwise"], MODES["sr"]):
        for amax in (torch.tensor([2688.0]), torch.tensor([2688.0 * 3])):
            _check_cuda(rows, mode, amax, rows.cuda())


def test_reference_on_cuda_tensors_gives_the_cpu_bits():
    x = random_values((96, 256), torch.float32, seed=301)
    w = random_values((80, 256), torch.float32, seed=302)
    amax_x, amax_w = x.abs().amax(), w.abs().amax()
    for kw in ({}, {"block_2d": True}, {"stochastic": True, "seed": 5, "offset": 7}):
        cpu = ref.quantize_nvfp4(x, amax_x, **kw)
        gpu = ref.quantize_nvfp4(x.cuda(), amax_x.cuda(), **kw)
        for got, want, name in zip(gpu, cpu, ("data", "scales", "s_dec")):
            assert_bitwise_equal(got, want, name)
    assert_bitwise_equal(
        ref.random_hadamard_transform(x.cuda()), ref.random_hadamard_transform(x), "rht"
    )
    qx, qw = ref.quantize_nvfp4(x, amax_x), ref.quantize_nvfp4(w, amax_w, block_2d=True)
    assert_bitwise_equal(
        ref.dequantize_nvfp4(*(t.cuda() for t in qx), dtype=torch.bfloat16),
        ref.dequantize_nvfp4(*qx, dtype=torch.bfloat16),
        "dequantize",
    )
    a, b = (qx.data, qx.scales, amax_x), (qw.data, qw.scales, amax_w)
    on_gpu = ref.nvfp4_gemm(tuple(t.cuda() for t in a), tuple(t.cuda() for t in b))
    assert_bitwise_equal(on_gpu, ref.nvfp4_gemm(a, b), "ordered gemm")
