"""The Triton NVFP4 cast (kernels/nvfp4.py) against the reference, bit for bit: rowwise, columnwise
(read in place), 16x16 blocks, RHT and stochastic rounding, on odd row counts, bf16/fp32/fp16,
non-contiguous inputs, NaN/inf and the special amaxes. Runs compiled on a GPU, else under
``TRITON_INTERPRET=1``; ``test_triton_gpu_nvfp4`` repeats it at real sizes on the H200."""

import pytest
import torch
from dist_quant.kernels import reference_nvfp4 as ref
from dist_quant.kernels.nvfp4 import nvfp4_cast_op, nvfp4_cast_triton
from triton_cases import DEVICE, assert_bitwise_equal, on_device, random_values, with_specials

from dist_quant import kernels as K

MODES = {
    "rowwise": {},
    "columnwise": {"columnwise": True},
    "2d": {"block_2d": True},
    "2d_columnwise": {"block_2d": True, "columnwise": True},
    "rht_columnwise": {"rht": True, "columnwise": True},
    "sr": {"stochastic": True, "seed": 2**40 + 7, "offset": 2**33 + 1},
    "sr_2d_columnwise": {"stochastic": True, "block_2d": True, "columnwise": True, "seed": 3},
    "rht_sr_columnwise": {"rht": True, "stochastic": True, "columnwise": True, "seed": 9},
}


def _amax_of(x: torch.Tensor, mode: dict) -> torch.Tensor:
    src = x.t() if mode.get("columnwise") else x
    if mode.get("rht"):
        src = ref.random_hadamard_transform(src)
    return src.float().abs().amax().reshape(1)


def _check(x: torch.Tensor, mode: dict, amax: torch.Tensor | None = None, xd=None) -> None:
    amax = _amax_of(x, mode) if amax is None else amax
    xd = on_device(x)[0] if xd is None else xd
    out = nvfp4_cast_triton(xd, amax.to(DEVICE), **mode)
    exp = ref.nvfp4_cast(x, amax, **mode)
    assert out.data.is_contiguous() and out.scales.is_contiguous()
    assert_bitwise_equal(out.data, exp.data, "data")
    assert_bitwise_equal(out.scales, exp.scales, "scales")
    assert_bitwise_equal(out.s_dec, exp.s_dec, "s_dec")


@pytest.mark.parametrize("mode", MODES.values(), ids=MODES.keys())
@pytest.mark.parametrize("shape", [(16, 32), (37, 48), (1, 64), (48, 160)])
def test_cast_matches_reference_in_every_mode(shape, mode):
    if mode.get("columnwise"):
        shape = (shape[1], shape[0])  # the transposed operand needs 16 | rows of x
    x = random_values(shape, torch.bfloat16, seed=sum(shape))
    _check(x, mode)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_cast_of_fp32_and_fp16_inputs_with_nan_inf_and_signed_zero(dtype):
    x = with_specials(random_values((32, 64), torch.float32, seed=4).clamp(-6e4, 6e4)).to(dtype)
    for mode in (MODES["rowwise"], MODES["columnwise"], MODES["2d"], MODES["sr"]):
        _check(x, mode)
        _check(x, mode, amax=torch.tensor([float("nan")]))


@pytest.mark.parametrize("amax", [0.0, float("inf"), 1e-40, 3.0e38])
def test_cast_with_special_and_mismatched_amax(amax):
    x = random_values((20, 32), torch.float32, seed=5)
    _check(x, MODES["rowwise"], amax=torch.tensor([amax]))
    _check(torch.zeros(20, 32), MODES["2d"], amax=torch.tensor([amax]))


def test_noncontiguous_inputs_are_read_in_place():
    base = random_values((96, 80), torch.bfloat16, seed=6).to(DEVICE, copy=True)
    for view in (base.t(), base[:, 8:72], base[::2, :48]):
        for mode in (MODES["rowwise"], MODES["columnwise"], MODES["rht_columnwise"]):
            if (view.shape[0] if mode.get("columnwise") else view.shape[1]) % 16 == 0:
                _check(view.cpu(), mode, xd=view)


def test_empty_input_gives_empty_outputs_and_the_global_decode_scale():
    out = nvfp4_cast_triton(torch.empty(0, 32, device=DEVICE), torch.tensor([3.0], device=DEVICE))
    assert out.data.shape == (0, 16) and out.scales.shape == (0, 2)
    assert out.s_dec.item() == ref.nvfp4_global_scales(3.0)[1].item()


def test_dispatcher_and_op_fake_agree_with_the_reference():
    x = random_values((32, 48), torch.float32, seed=7)
    got = K.nvfp4_cast(x.to(DEVICE), 11.0, columnwise=True, stochastic=True, seed=1, offset=2)
    exp = ref.nvfp4_cast(x, 11.0, columnwise=True, stochastic=True, seed=1, offset=2)
    for a, e, name in zip(got, exp, ("data", "scales", "s_dec")):
        assert_bitwise_equal(a, e, name)
    args = (x, torch.tensor([11.0]), True, True, False, False, 0, 0)
    torch.library.opcheck(nvfp4_cast_op.op, args, test_utils=("test_schema", "test_faketensor"))


def test_bad_inputs_raise_value_errors_naming_the_op_and_the_shape():
    one = torch.ones(1, device=DEVICE)
    with pytest.raises(
        ValueError, match=r"nvfp4_cast: x.shape\[1\] must be a multiple of 16.*\(4, 24\)"
    ):
        nvfp4_cast_triton(torch.ones(4, 24, device=DEVICE), one)
    with pytest.raises(ValueError, match=r"x.shape\[0\] \(columnwise\) must be a multiple of 16"):
        nvfp4_cast_triton(torch.ones(24, 32, device=DEVICE), one, columnwise=True)
    with pytest.raises(ValueError, match="amax must be one fp32 value"):
        nvfp4_cast_triton(torch.ones(4, 32, device=DEVICE), torch.ones(2, device=DEVICE))
    with pytest.raises(ValueError, match="offset must be an int in"):
        nvfp4_cast_triton(torch.ones(4, 32, device=DEVICE), one, stochastic=True, offset=2**63)
