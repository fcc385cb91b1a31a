"""Triton kernels through the ``dist_quant.kernels`` dispatchers at real sizes on a CUDA device.

The dispatchers must route CUDA tensors to Triton and match the reference (run on the CPU, where it
is the definition) bit for bit on 1D/2D/3D and non-contiguous inputs of millions of elements.
"""

import pytest
import torch
from dist_quant.kernels import reference as ref
from triton_cases import assert_bitwise_equal, random_values, with_specials

from dist_quant import kernels as K

pytestmark = pytest.mark.gpu

SHAPES = [(2**22 + 3,), (4096, 4100), (3, 1000, 1537)]


def _inputs(dtype: torch.dtype = torch.bfloat16, specials: bool = True):
    """(cpu, cuda) pairs: the SHAPES, plus a transposed and a sliced 2D view made on the device."""
    pairs = []
    for i, shape in enumerate(SHAPES):
        x = random_values(shape, dtype, seed=200 + i)
        x = with_specials(x) if specials else x
        pairs.append((x, x.cuda()))
    base = random_values((3000, 2050), dtype, seed=210).cuda()
    for view in (base.t(), base[7:2900, 1:2001:2]):
        pairs.append((view.cpu(), view))
    return pairs


@pytest.mark.parametrize("fp8_dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_per_tensor_casts_and_amax(fp8_dtype):
    for x, xd in _inputs():
        scale = torch.tensor([0.37])
        slot = torch.tensor([1.0], device="cuda")
        q = K.cast_to_fp8_with_amax(xd, scale.cuda(), fp8_dtype, slot)
        assert_bitwise_equal(q, ref.cast_to_fp8(x, scale, fp8_dtype), "cast")
        exp_amax = ref.amax(x)
        assert_bitwise_equal(K.amax(xd), exp_amax, "amax")
        assert_bitwise_equal(slot, torch.maximum(torch.tensor([1.0]), exp_amax), "amax slot")
        q, q_t = K.cast_transpose(xd, scale.cuda(), fp8_dtype)
        exp_q, exp_t = ref.cast_transpose(x, scale, fp8_dtype)
        assert_bitwise_equal(q, exp_q, "cast_transpose q")
        assert_bitwise_equal(q_t, exp_t, "cast_transpose q_t")
        assert_bitwise_equal(K.dequantize(q, 2.7), ref.dequantize(exp_q, 2.7), "dequantize")
        slot = torch.tensor([1.0], device="cuda")
        out = K.delayed_cast(xd, scale.cuda(), fp8_dtype, slot, transpose=True)
        assert_bitwise_equal(out.data, exp_q, "delayed_cast q")
        assert_bitwise_equal(out.data_t, exp_t, "delayed_cast q_t")
        assert_bitwise_equal(out.scale_inv, torch.reciprocal(scale), "delayed_cast scale_inv")
        assert_bitwise_equal(slot, torch.maximum(torch.tensor([1.0]), exp_amax), "its amax slot")


@pytest.mark.parametrize("transpose", [False, True])
def test_current_scaling_cast(transpose):
    for x, xd in _inputs(specials=False):  # a planted NaN/inf would force scale 1
        out = K.current_scaling_cast(
            xd, torch.float8_e4m3fn, use_power_2_scales=not transpose, transpose=transpose
        )
        a = ref.amax(x)
        scale, scale_inv = ref.current_scale(
            a, torch.float8_e4m3fn, use_power_2_scales=not transpose
        )
        assert_bitwise_equal(out.amax, a, "amax")
        assert_bitwise_equal(out.scale, scale.reshape(1), "scale")
        assert_bitwise_equal(out.scale_inv, scale_inv.reshape(1), "scale_inv")
        if transpose:
            exp_q, exp_t = ref.cast_transpose(x, scale, torch.float8_e4m3fn)
            assert_bitwise_equal(out.data_t, exp_t, "q_t")
        else:
            exp_q = ref.cast_to_fp8(x, scale, torch.float8_e4m3fn)
        assert_bitwise_equal(out.data, exp_q, "q")


@pytest.mark.parametrize("columnwise", [False, True])
def test_mxfp8_cast_and_dequantize(columnwise):
    for x, xd in _inputs():
        q, e8m0 = K.mxfp8_cast(xd, torch.float8_e4m3fn, columnwise=columnwise)
        exp_q, exp_e = ref.mxfp8_cast(x, torch.float8_e4m3fn, columnwise=columnwise)
        assert_bitwise_equal(q, exp_q.contiguous(), "q")
        assert_bitwise_equal(e8m0, exp_e, "e8m0")
        got = K.mxfp8_dequantize(q, e8m0, columnwise=columnwise, dtype=torch.bfloat16)
        exp = ref.mxfp8_dequantize(exp_q, exp_e, columnwise=columnwise, dtype=torch.bfloat16)
        assert_bitwise_equal(got, exp.contiguous() if not columnwise else exp, "dequantize")


@pytest.mark.parametrize("block_dim", [1, 2])
def test_block_cast_and_dequantize(block_dim):
    for x, xd in _inputs(torch.float32):
        q, s_inv = K.block_cast(xd, torch.float8_e4m3fn, block_dim=block_dim)
        exp_q, exp_s = ref.block_cast(x, torch.float8_e4m3fn, block_dim=block_dim)
        assert_bitwise_equal(q, exp_q.contiguous(), "q")
        assert_bitwise_equal(s_inv, exp_s, "scale_inv")
        got = K.block_dequantize(q, s_inv, block_dim=block_dim, dtype=torch.bfloat16)
        exp = ref.block_dequantize(exp_q, exp_s, block_dim=block_dim, dtype=torch.bfloat16)
        assert_bitwise_equal(got, exp, "dequantize")


def test_delayed_update_of_a_model_in_one_launch():
    g = torch.Generator().manual_seed(220)
    groups_cpu = []
    for i in range(200):  # 100 modules x 2 directions, 3 slots each, 1024-step history
        h = torch.rand(1024, 3, generator=g) * 10
        h[5, i % 3] = float("nan") if i % 7 == 0 else h[5, i % 3]
        scale = torch.rand(3, generator=g) + 0.5
        limit = 448.0 if i % 2 else 57344.0
        groups_cpu.append((h, scale, limit, i % 3, ("max", "most_recent")[i % 2]))
    groups = [(h.cuda(), s.cuda(), lim, m, a) for h, s, lim, m, a in groups_cpu]
    for _ in range(2):
        K.delayed_scaling_update_groups(groups)
        for h, s, lim, m, a in groups_cpu:
            ref.delayed_scaling_update(h, s, lim, margin=m, algo=a)
        for (h, s, *_), (eh, es, *_) in zip(groups, groups_cpu):
            assert_bitwise_equal(h, eh, "history")
            assert_bitwise_equal(s, es, "scale")


def test_repeated_launches_of_one_specialisation_stay_exact():
    # the first call of a shape compiles through Triton's JIT, later ones take the compiled
    # kernel's launcher directly (kernels/_launch.py): every one must match the reference
    scale = torch.tensor([0.37])
    for seed in range(4):
        x = random_values((1024, 512), torch.bfloat16, seed=300 + seed)
        slot = torch.tensor([0.0], device="cuda")
        out = K.delayed_cast(x.cuda(), scale.cuda(), torch.float8_e4m3fn, slot, transpose=True)
        exp_q, exp_t = ref.cast_transpose(x, scale, torch.float8_e4m3fn)
        assert_bitwise_equal(out.data, exp_q, f"q, call {seed}")
        assert_bitwise_equal(out.data_t, exp_t, f"q_t, call {seed}")
        assert_bitwise_equal(slot, ref.amax(x).reshape(1), f"amax, call {seed}")
        cur = K.current_scaling_cast(x.cuda(), torch.float8_e4m3fn, transpose=False)
        assert_bitwise_equal(cur.amax, ref.amax(x), f"current amax, call {seed}")


@pytest.mark.parametrize("transpose", [False, True])
def test_delayed_casts_relaunched_from_their_prepared_plan_stay_exact(transpose):
    # the first delayed cast of a layout prepares its launch (kernels/cast.py), the next ones of
    # the same key relaunch it: every call, every layout, and amax slots at aligned and unaligned
    # addresses (a history row's slots sit 4 bytes apart) must match the reference
    history = torch.zeros(2, 3, device="cuda")
    scale = torch.ones(1, device="cuda")
    for x_cpu, x in _inputs():
        for call, (value, slot) in enumerate(((0.37, 0), (3.0, 0), (0.37, 1), (2.0**-5, 1))):
            scale.fill_(value)
            history.zero_()
            amax_slot = history[0, slot]
            out = K.delayed_cast(x, scale, torch.float8_e4m3fn, amax_slot, transpose=transpose)
            what = f"{tuple(x.shape)} stride {x.stride()}, call {call}"
            if transpose:
                exp_q, exp_t = ref.cast_transpose(x_cpu, scale.cpu(), torch.float8_e4m3fn)
                assert_bitwise_equal(out.data_t, exp_t, f"q_t, {what}")
            else:
                exp_q, exp_t = ref.cast_to_fp8(x_cpu, scale.cpu(), torch.float8_e4m3fn), None
                assert out.data_t is None
            assert_bitwise_equal(out.data, exp_q, f"q, {what}")
            assert_bitwise_equal(history[0, slot], ref.amax(x_cpu), f"amax, {what}")
            assert_bitwise_equal(out.scale_inv, torch.reciprocal(scale.cpu()), f"scale_inv, {what}")


@pytest.mark.parametrize("transpose", [False, True])
def test_current_scaling_casts_relaunched_from_their_prepared_plan_stay_exact(transpose):
    # as above for current scaling's two launches (amax pass, cast): new values in the same
    # layouts on every call, and an amax epsilon that changes the key (and the scale)
    e4m3 = torch.float8_e4m3fn
    for x_cpu, x in _inputs(specials=False):
        for call, (factor, eps) in enumerate(((1.0, 0.0), (-3.0, 0.0), (0.25, 0.0), (1.0, 1e3))):
            x.mul_(factor)  # in place: the layout stays
            x_cpu = x.cpu()
            out = K.current_scaling_cast(x, e4m3, amax_epsilon=eps, transpose=transpose)
            a = ref.amax(x_cpu)
            scale, scale_inv = ref.current_scale(a, e4m3, amax_epsilon=eps)
            what = f"{tuple(x.shape)} stride {x.stride()}, call {call}"
            assert_bitwise_equal(out.amax, a, f"amax, {what}")
            assert_bitwise_equal(out.scale, scale.reshape(1), f"scale, {what}")
            assert_bitwise_equal(out.scale_inv, scale_inv.reshape(1), f"scale_inv, {what}")
            if transpose:
                exp_q, exp_t = ref.cast_transpose(x_cpu, scale, e4m3)
                assert_bitwise_equal(out.data_t, exp_t, f"q_t, {what}")
            else:
                exp_q = ref.cast_to_fp8(x_cpu, scale, e4m3)
                assert out.data_t is None
            assert_bitwise_equal(out.data, exp_q, f"q, {what}")


def test_a_parameter_casts_like_its_values_on_every_call():
    # eager casts of plain tensors and parameters (a module's weight) go straight to the
    # launcher, undetached, and relaunch its prepared kernel from the second call: the outputs
    # must match the reference and carry no autograd history
    e4m3 = torch.float8_e4m3fn
    values = random_values((1024, 512), torch.bfloat16, seed=330)
    weight = torch.nn.Parameter(values.cuda())
    scale, slot = torch.full((1,), 0.37, device="cuda"), torch.zeros(1, device="cuda")
    exp_q, exp_t = ref.cast_transpose(values, scale.cpu(), e4m3)
    a = ref.amax(values)
    cur_scale, _ = ref.current_scale(a, e4m3)
    cur_q = ref.cast_to_fp8(values, cur_scale, e4m3)
    for call in range(3):
        out = K.delayed_cast(weight, scale, e4m3, slot, transpose=True)
        assert_bitwise_equal(out.data, exp_q, f"delayed q, call {call}")
        assert_bitwise_equal(out.data_t, exp_t, f"delayed q_t, call {call}")
        assert_bitwise_equal(slot, a.reshape(1), f"amax, call {call}")
        cur = K.current_scaling_cast(weight, e4m3, transpose=False)
        assert_bitwise_equal(cur.data, cur_q, f"current q, call {call}")
        for t in (out.data, out.data_t, out.scale_inv, cur.data, cur.scale_inv):
            assert not t.requires_grad and t.grad_fn is None


def test_an_installed_triton_launch_hook_sees_every_relaunch():
    # prepared and fast launches pass no hook while Triton's hook chains are empty (kernels/
    # _launch.py); a profiler that installs one (proton does) must still see every cast
    triton_knobs = pytest.importorskip("triton.knobs")
    chain = triton_knobs.runtime.launch_enter_hook
    if not hasattr(chain, "add"):
        pytest.skip("this Triton keeps a single launch hook, not a chain")
    x = random_values((1024, 512), torch.bfloat16, seed=320).cuda()
    scale, slot = torch.ones(1, device="cuda"), torch.zeros(1, device="cuda")
    K.delayed_cast(x, scale, torch.float8_e4m3fn, slot, transpose=True)  # prepares the launch
    seen = []
    hook = seen.append
    chain.add(hook)
    try:
        for _ in range(3):
            K.delayed_cast(x, scale, torch.float8_e4m3fn, slot, transpose=True)
            K.current_scaling_cast(x, torch.float8_e4m3fn, transpose=True)
    finally:
        chain.remove(hook)
    assert len(seen) == 3 * 3, f"the hook saw {len(seen)} of 9 launches"
    K.delayed_cast(x, scale, torch.float8_e4m3fn, slot, transpose=True)
    assert len(seen) == 9, "a removed hook was still called"


def _every_bf16() -> torch.Tensor:
    """All 65536 bf16 bit patterns as a (256, 256) matrix: both signs, every exponent (FP8
    subnormals, normals, saturation), every mantissa (each FP8 rounding tie of both formats that
    bf16 can hold), inf and NaN."""
    bits = torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16)
    return bits.view(torch.bfloat16).reshape(256, 256)


@pytest.mark.parametrize("fp8_dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
@pytest.mark.parametrize("scale", [1.0, 2.0**-5, 0.37, 3.0])
def test_every_bf16_value_casts_as_the_reference(fp8_dtype, scale):
    # the GPU kernels leave the rounding to the hardware conversion: this pins it to the contract
    x = _every_bf16()
    s = torch.tensor([scale])
    exp_q, exp_t = ref.cast_transpose(x, s, fp8_dtype)
    slot = torch.tensor([0.0], device="cuda")
    out = K.delayed_cast(x.cuda(), s.cuda(), fp8_dtype, slot, transpose=True)
    assert_bitwise_equal(out.data, exp_q, f"delayed_cast q, scale {scale}")
    assert_bitwise_equal(out.data_t, exp_t, f"delayed_cast q_t, scale {scale}")
    assert_bitwise_equal(K.cast_to_fp8(x.cuda(), s.cuda(), fp8_dtype), exp_q, "cast_to_fp8")
    q, _ = K.mxfp8_cast(x.cuda(), fp8_dtype)
    assert_bitwise_equal(q, ref.mxfp8_cast(x, fp8_dtype)[0].contiguous(), "mxfp8_cast q")


@pytest.mark.parametrize("fp8_dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_fp32_rounding_ties_go_to_the_even_code(fp8_dtype):
    # every midpoint between neighbouring FP8 values (exact in fp32: one bit past FP8's mantissa),
    # and the one past max, with both signs and one ulp either side of each
    grid = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(fp8_dtype).float()
    grid = grid[torch.isfinite(grid) & (grid >= 0)].unique().double()
    grid = torch.cat([grid, (2 * grid[-1] - grid[-2]).reshape(1)])  # one step past max
    mids = ((grid[1:] + grid[:-1]) / 2).float()
    near = torch.cat([mids, torch.nextafter(mids, mids * 2), torch.nextafter(mids, mids * 0)])
    x = torch.cat([near, -near]).reshape(-1, 1).expand(-1, 64).contiguous()  # (rows, 64)
    one = torch.tensor([1.0])
    exp_q, exp_t = ref.cast_transpose(x, one, fp8_dtype)
    slot = torch.tensor([0.0], device="cuda")
    out = K.delayed_cast(x.cuda(), one.cuda(), fp8_dtype, slot, transpose=True)
    assert_bitwise_equal(out.data, exp_q, "ties q")
    assert_bitwise_equal(out.data_t, exp_t, "ties q_t")
