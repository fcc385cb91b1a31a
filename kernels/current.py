"""Current scaling: the amax pass, the scale on the GPU, the cast (+ transpose) pass with no host
sync, and the ops ``amax``, ``current_scale`` and ``current_scaling_cast`` (``_op.py``).

Matches ``reference.amax`` and ``reference.current_scale`` bit for bit, and
``current_scaling_cast_triton`` equals ``amax`` -> ``current_scale`` -> ``cast_to_fp8`` /
``cast_transpose`` of the reference.

The amax pass is a persistent kernel: each of P programs writes the int32 bits of its own
``max|x|`` to ``partials[pid]`` (integer max of non-negative fp32 bits = float max, NaN on top), so
no buffer needs zeroing and there is no atomic. ``amax_triton`` reduces the partials with one tiny
program; the fused current-scaling cast lets every cast program reduce them itself (P is at most a
few hundred int32 read from L2) and compute the scale, so the whole path is two launches.
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import torch
from dist_quant.kernels import reference
from dist_quant.kernels._fp8_round import (
    abs_bits,
    amax_from_bits,
    cdiv,
    current_scale_from_amax,
    dense_flat,
    flat_pair,
    fp8_spec,
    is_gpu,
    next_pow2,
    reciprocal,
)
from dist_quant.kernels._launch import (
    EAGER_TENSOR_TYPES,
    FastLaunch,
    PreparedLaunch,
    launch_config,
    remember,
)
from dist_quant.kernels._op import distinct, fake_rows_cols, register_op
from dist_quant.kernels._triton import tl, triton
from dist_quant.kernels.cast import AmaxPartials, cast_args, launch_cast
from torch import Tensor

# GPU amax pass: BLOCK elements per loop step, PROGRAMS_PER_SM persistent programs per SM
# (bench/bench_cast.py --sweep measures the alternatives). The interpreter uses 4 programs.
# H200, 2026-12-02, 64M / 256M bf16: 8192 x 8 warps x 4 per SM 46.5 / 135.0 us, best of 7
# (4096 x 8 x 4: 54.3 / 157.9; 16384 x 8 x 2: 79.0 / 135.4).
GPU_AMAX = {"BLOCK": 8192, "num_warps": 8, "PROGRAMS_PER_SM": 4}


class CurrentScalingCast(NamedTuple):
    """Everything a current-scaling quantizer needs from one call."""

    data: torch.Tensor  # FP8, x's shape
    data_t: torch.Tensor | None  # FP8 (cols, rows) when transpose=True
    scale: torch.Tensor  # (1,) fp32
    scale_inv: torch.Tensor  # (1,) fp32
    amax: torch.Tensor  # 0-dim fp32


@triton.jit
def _amax_partials_kernel(x_ptr, partials_ptr, n, iters, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    acc = tl.zeros([BLOCK], dtype=tl.int32)
    for i in range(0, iters):
        offs = (pid + i * nprog).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        x = tl.load(x_ptr + offs, mask=offs < n, other=0.0).to(tl.float32)
        acc = tl.maximum(acc, abs_bits(x))
    tl.store(partials_ptr + pid, tl.max(acc, axis=0))


@triton.jit
def _amax_finalize_kernel(partials_ptr, n_partials, out_ptr, P_BLOCK: tl.constexpr):
    offs = tl.arange(0, P_BLOCK)
    bits = tl.load(partials_ptr + offs, mask=offs < n_partials, other=0)
    tl.store(out_ptr, amax_from_bits(tl.max(bits, axis=0)))


@triton.jit
def _current_scale_kernel(
    amax_ptr,
    scale_ptr,
    scale_inv_ptr,
    n,
    eps,
    FP8_MAX: tl.constexpr,
    POW2: tl.constexpr,
    BLOCK: tl.constexpr,
):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    a = tl.load(amax_ptr + offs, mask=mask, other=0.0)
    s = current_scale_from_amax(a, eps, FP8_MAX, POW2)
    tl.store(scale_ptr + offs, s, mask=mask)
    tl.store(scale_inv_ptr + offs, reciprocal(s), mask=mask)


def _amax_partials(x: torch.Tensor, prepare: bool = False) -> tuple[torch.Tensor, Any]:
    """int32 ``(P,)``: bits of each persistent program's ``max|x|`` (x non-empty); with
    ``prepare`` (GPU), also the launch prepared for ``(x, partials)`` (None where x was copied)."""
    x_flat = dense_flat(x)
    n = x_flat.numel()
    gpu = is_gpu(x)
    if gpu:
        block, warps = GPU_AMAX["BLOCK"], GPU_AMAX["num_warps"]
        programs = min(cdiv(n, block), _sm_count(x.device) * GPU_AMAX["PROGRAMS_PER_SM"])
    else:
        block, warps = 1 << 15, 1
        programs = min(cdiv(n, block), 4)
    partials = torch.empty(programs, dtype=torch.int32, device=x.device)
    iters = cdiv(cdiv(n, block), programs)
    args = (x_flat, partials, n, iters)
    config = launch_config((("BLOCK", block),), (("num_warps", warps),))
    _launch_partials((programs,), args, config, interpreted=not gpu)
    prepared = None
    if prepare and x_flat.data_ptr() == x.data_ptr():
        prepared = _launch_partials.prepare((programs,), args, config, 2)
    return partials, prepared


_launch_partials = FastLaunch(_amax_partials_kernel)
_launch_finalize = FastLaunch(_amax_finalize_kernel)
_launch_scale = FastLaunch(_current_scale_kernel)


@functools.cache
def _sm_count(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


def _check_float(x: torch.Tensor, what: str) -> None:
    if x.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"kernels.current.{what}: x must be fp32/bf16/fp16, got {x.dtype}")


def amax_triton(x: torch.Tensor) -> torch.Tensor:
    """``reference.amax``: fp32 0-dim ``max|x|``; NaN propagates; empty -> 0."""
    _check_float(x, "amax")
    out = torch.zeros((), dtype=torch.float32, device=x.device)
    if x.numel() == 0:
        return out
    partials, _ = _amax_partials(x.detach())
    p_block = next_pow2(partials.numel())
    _launch_finalize.launch(
        (1,), (partials, partials.numel(), out), {"P_BLOCK": p_block}, interpreted=not is_gpu(x)
    )
    return out


def current_scale_triton(
    amax: torch.Tensor,
    fp8_dtype: torch.dtype,
    *,
    amax_epsilon: float = 0.0,
    use_power_2_scales: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``reference.current_scale``: ``(scale, scale_inv)`` with ``amax``'s shape, on the GPU."""
    spec = fp8_spec(fp8_dtype, "kernels.current.current_scale")
    if not amax_epsilon >= 0.0:
        raise ValueError(
            f"kernels.current.current_scale: amax_epsilon must be >= 0, got {amax_epsilon!r}"
        )
    a_flat, scale, scale_flat = flat_pair(amax.detach().float(), torch.float32)
    scale_inv = torch.empty_like(scale)
    n = a_flat.numel()
    if n:
        block = 1024
        _launch_scale.launch(
            (cdiv(n, block),),
            (a_flat, scale_flat, scale_inv.as_strided((n,), (1,)), n, float(amax_epsilon)),
            {"FP8_MAX": spec.max, "POW2": bool(use_power_2_scales), "BLOCK": block},
            interpreted=not is_gpu(amax),
        )
    return scale, scale_inv


def current_scaling_cast_triton(
    x: torch.Tensor,
    fp8_dtype: torch.dtype,
    amax_epsilon: float = 0.0,
    use_power_2_scales: bool = False,
    transpose: bool = False,
) -> CurrentScalingCast:
    """amax -> current scale -> cast (and transpose) of ``x``, in two launches, no host sync.

    As for the delayed cast (``delayed.delayed_cast_triton``), the first cast of a layout leaves
    its two launches prepared, and later casts of the same key only allocate and relaunch."""
    key = None
    if type(x) in EAGER_TENSOR_TYPES and x.is_cuda:  # eager (under tracing: a fake tensor)
        key = (
            x.shape, x.stride(), x.dtype, fp8_dtype, transpose, amax_epsilon, use_power_2_scales,
            torch._C._cuda_getDevice(), x.get_device(), x.data_ptr() & 15,
        )  # fmt: skip
        plan = _current_plans.get(key)
        if plan is not None:
            return _relaunch(plan, x, fp8_dtype, key[7])
    what = "current_scaling_cast"
    fp8_spec(fp8_dtype, f"kernels.current.{what}")
    _check_float(x, what)
    if not amax_epsilon >= 0.0:
        raise ValueError(f"kernels.current.{what}: amax_epsilon must be >= 0, got {amax_epsilon!r}")
    x = x.detach()
    dev = x.device
    if x.numel() == 0:
        amax = torch.zeros((), dtype=torch.float32, device=dev)
        scale, scale_inv = current_scale_triton(
            amax.reshape(1), fp8_dtype, amax_epsilon=amax_epsilon,
            use_power_2_scales=use_power_2_scales,
        )  # fmt: skip
        q, q_t = launch_cast(x, fp8_dtype, transpose=transpose, scale=scale)
        return CurrentScalingCast(q, q_t, scale, scale_inv, amax)
    amax = torch.empty((), dtype=torch.float32, device=dev)  # program 0 of the cast writes it
    scale = torch.empty(1, dtype=torch.float32, device=dev)
    scale_inv = torch.empty(1, dtype=torch.float32, device=dev)
    partials_t, amax_pass = _amax_partials(x, prepare=key is not None)
    partials = AmaxPartials(
        partials=partials_t,
        amax_epsilon=amax_epsilon,
        use_power_2_scales=use_power_2_scales,
        amax_out=amax.reshape(1),
        scale_out=scale,
        scale_inv_out=scale_inv,
    )

    def store(cast_pass: PreparedLaunch, q_t_shape: tuple[int, int] | None) -> None:
        if amax_pass is not None:
            plan = _CurrentPlan(
                amax_pass, cast_pass, partials_t.numel(), float(amax_epsilon), q_t_shape
            )
            remember(_current_plans, key, plan)

    q, q_t = launch_cast(
        x, fp8_dtype, transpose=transpose, partials=partials,
        prepare=None if key is None else store,
    )  # fmt: skip
    return CurrentScalingCast(q, q_t, scale, scale_inv, amax)


class _CurrentPlan(NamedTuple):
    amax_pass: PreparedLaunch
    cast_pass: PreparedLaunch
    n_partials: int
    eps: float
    q_t_shape: tuple[int, int] | None


# key (see current_scaling_cast_triton) -> the two prepared launches of that cast
_current_plans: dict[tuple, _CurrentPlan] = {}


def _relaunch(
    plan: _CurrentPlan, x: torch.Tensor, fp8_dtype: torch.dtype, device: int
) -> CurrentScalingCast:
    amax_pass, cast_pass, n_partials, eps, q_t_shape = plan
    dev = x.device
    partials = torch.empty(n_partials, dtype=torch.int32, device=dev)
    amax = torch.empty((), dtype=torch.float32, device=dev)
    scale = torch.empty(1, dtype=torch.float32, device=dev)
    scale_inv = torch.empty(1, dtype=torch.float32, device=dev)
    q = torch.empty_like(x, dtype=fp8_dtype)
    stream = torch._C._cuda_getCurrentRawStream(device)
    q_t = None if q_t_shape is None else torch.empty(q_t_shape, dtype=fp8_dtype, device=dev)
    amax_pass.launch(stream, x, partials)
    outs = (amax, scale, scale_inv)
    # the cast reads its scale from scale_out (written by its program 0) and folds no amax
    cast_pass.launch(stream, *cast_args(x, q, q_t, scale, scale, partials, n_partials, eps, outs))
    return CurrentScalingCast(q, q_t, scale, scale_inv, amax)


# ---- the ops: reference calls, fakes, registration ---------------------------------------------
def _amax_fake(x: Tensor) -> Tensor:
    return x.new_empty((), dtype=torch.float32)


def _current_scale_ref(
    amax: Tensor, fp8_dtype: torch.dtype, amax_epsilon: float, use_power_2_scales: bool
) -> tuple[Tensor, Tensor]:
    s, s_inv = reference.current_scale(
        amax, fp8_dtype, amax_epsilon=amax_epsilon, use_power_2_scales=use_power_2_scales
    )
    return s.contiguous(), s_inv.contiguous()


def _current_scale_cuda(
    amax: Tensor, fp8_dtype: torch.dtype, amax_epsilon: float, use_power_2_scales: bool
) -> tuple[Tensor, Tensor]:
    s, s_inv = current_scale_triton(
        amax, fp8_dtype, amax_epsilon=amax_epsilon, use_power_2_scales=use_power_2_scales
    )
    return s.contiguous(), s_inv.contiguous()


def _current_scale_fake(
    amax: Tensor, fp8_dtype: torch.dtype, amax_epsilon: float, use_power_2_scales: bool
) -> tuple[Tensor, Tensor]:
    return amax.new_empty(amax.shape, dtype=torch.float32), amax.new_empty(
        amax.shape, dtype=torch.float32
    )


def _reference_cast(
    x: Tensor, fp8_dtype: torch.dtype, eps: float, pow2: bool, transpose: bool
) -> tuple[Tensor, ...]:
    """``(q, [q_t,] scale (1,), scale_inv (1,), amax ())``: amax -> current scale -> cast."""
    a = reference.amax(x)
    scale, scale_inv = reference.current_scale(
        a, fp8_dtype, amax_epsilon=eps, use_power_2_scales=pow2
    )
    if transpose:
        q = distinct(*reference.cast_transpose(x, scale, fp8_dtype))
    else:
        q = (reference.cast_to_fp8(x, scale, fp8_dtype),)
    return (*q, scale.reshape(1), scale_inv.reshape(1), a)


def _current_scaling_cast_ref(
    x: Tensor, fp8_dtype: torch.dtype, amax_epsilon: float, use_power_2_scales: bool
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    return _reference_cast(x, fp8_dtype, amax_epsilon, use_power_2_scales, False)


def _current_scaling_cast_cuda(
    x: Tensor, fp8_dtype: torch.dtype, amax_epsilon: float, use_power_2_scales: bool
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    out = current_scaling_cast_triton(x, fp8_dtype, amax_epsilon, use_power_2_scales)
    return out.data, out.scale, out.scale_inv, out.amax


def _current_scaling_cast_fake(
    x: Tensor, fp8_dtype: torch.dtype, amax_epsilon: float, use_power_2_scales: bool
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    return (torch.empty_like(x, dtype=fp8_dtype), *_scales_fake(x))


def _current_scaling_cast_transpose_ref(
    x: Tensor, fp8_dtype: torch.dtype, amax_epsilon: float, use_power_2_scales: bool
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    return _reference_cast(x, fp8_dtype, amax_epsilon, use_power_2_scales, True)


def _current_scaling_cast_transpose_cuda(
    x: Tensor, fp8_dtype: torch.dtype, amax_epsilon: float, use_power_2_scales: bool
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    out = current_scaling_cast_triton(
        x, fp8_dtype, amax_epsilon, use_power_2_scales, transpose=True
    )
    return out.data, out.data_t, out.scale, out.scale_inv, out.amax


def _current_scaling_cast_transpose_fake(
    x: Tensor, fp8_dtype: torch.dtype, amax_epsilon: float, use_power_2_scales: bool
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    rows, cols = fake_rows_cols(x)
    q_t = x.new_empty((cols, rows), dtype=fp8_dtype)
    return (torch.empty_like(x, dtype=fp8_dtype), q_t, *_scales_fake(x))


def _scales_fake(x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """``(scale (1,), scale_inv (1,), amax ())``."""
    f32 = torch.float32
    return x.new_empty((1,), dtype=f32), x.new_empty((1,), dtype=f32), x.new_empty((), dtype=f32)


_amax = register_op("amax", (), reference.amax, amax_triton, _amax_fake)
_current_scale = register_op(
    "current_scale", (), _current_scale_ref, _current_scale_cuda, _current_scale_fake
)


def _current_scaling_cast_transpose_eager(
    x: Tensor, fp8_dtype: torch.dtype, amax_epsilon: float, use_power_2_scales: bool
) -> CurrentScalingCast:
    return current_scaling_cast_triton(x, fp8_dtype, amax_epsilon, use_power_2_scales, True)


# Eager CUDA calls go to current_scaling_cast_triton itself (as delayed_cast's to
# delayed.delayed_cast_triton): prepared launches, and the CurrentScalingCast it returns.
_current_scaling_cast = register_op(
    "current_scaling_cast", (), _current_scaling_cast_ref, _current_scaling_cast_cuda,
    _current_scaling_cast_fake, eager_cuda=current_scaling_cast_triton,
    pack=lambda out: CurrentScalingCast(out[0], None, *out[1:]),
)  # fmt: skip
_current_scaling_cast_transpose = register_op(
    "current_scaling_cast_transpose", (), _current_scaling_cast_transpose_ref,
    _current_scaling_cast_transpose_cuda, _current_scaling_cast_transpose_fake,
    eager_cuda=_current_scaling_cast_transpose_eager, pack=lambda out: CurrentScalingCast(*out),
)  # fmt: skip


# ---- public functions ----------------------------------------------------------------------------
def amax(x: Tensor) -> Tensor:
    """``reference.amax``: fp32 0-dim ``max|x|``."""
    return _amax(x)


def current_scale(
    amax: Tensor,
    fp8_dtype: torch.dtype,
    *,
    amax_epsilon: float = 0.0,
    use_power_2_scales: bool = False,
) -> tuple[Tensor, Tensor]:
    """``reference.current_scale``: ``(scale, scale_inv)`` with ``amax``'s shape."""
    return _current_scale(amax, fp8_dtype, float(amax_epsilon), bool(use_power_2_scales))


def current_scaling_cast(
    x: Tensor,
    fp8_dtype: torch.dtype,
    *,
    amax_epsilon: float = 0.0,
    use_power_2_scales: bool = False,
    transpose: bool = False,
) -> CurrentScalingCast:
    """``amax`` -> ``current_scale`` -> ``cast_to_fp8`` (``cast_transpose`` when ``transpose``):
    two launches and no host sync on CUDA."""
    op = _current_scaling_cast_transpose if transpose else _current_scaling_cast
    return op(x, fp8_dtype, float(amax_epsilon), bool(use_power_2_scales))
