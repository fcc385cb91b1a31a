"""Every `FastLaunch` call hands its kernel the runtime arguments in order, then every constexpr.

On a GPU, `FastLaunch` launches a compiled kernel through its launcher with the runtime arguments
followed by the constexprs in the kernel's parameter order, read from the call's `LaunchConfig`;
a constexpr missing from the config makes it fall back to Triton's slow JIT path for good,
silently. The interpreter (CPU) never takes that path, so this pins the calling convention on the
CPU: each launcher is run once on small inputs and every call it made is checked against its
kernel's signature. Every `FastLaunch` of the kernels package must have been called. Where CUDA is
available the inputs are CUDA tensors: Triton's JIT (no interpreter there) cannot read CPU
memory, and the compiled launch path is then exercised as well.
"""

from __future__ import annotations

import importlib
import inspect

import torch
from dist_quant.kernels import block, block_gemm, cast, current, delayed, delayed_update, mxfp8
from dist_quant.kernels._launch import PLAN_LIMIT, FastLaunch, remember

# the package exports a `dequantize` function, which hides the submodule's attribute
dequantize = importlib.import_module("dist_quant.kernels.dequantize")
E4M3 = torch.float8_e4m3fn
MODULES = (block, block_gemm, cast, current, delayed_update, dequantize, mxfp8)


def _constexprs(kernel) -> list[str]:
    params = inspect.signature(kernel.fn).parameters.values()
    return [p.name for p in params if p.annotation in ("tl.constexpr", "constexpr")]


DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _run_every_launcher() -> None:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(96, 160, generator=g).to(DEVICE, torch.bfloat16)
    scale, slot = torch.tensor([0.5], device=DEVICE), torch.zeros(1, device=DEVICE)
    cast.cast_to_fp8_triton(x, scale, E4M3, amax_out=slot)
    delayed.delayed_cast_triton(x, scale, E4M3, slot, transpose=True)
    current.current_scaling_cast_triton(x, E4M3, transpose=True)
    current.amax_triton(x)
    current.current_scale_triton(torch.tensor([3.0], device=DEVICE), E4M3)
    q_mx, e_mx = mxfp8.mxfp8_cast_triton(x, E4M3)
    mxfp8.mxfp8_cast_triton(x, E4M3, columnwise=True)
    q_b, s_b = block.block_cast_triton(x.float(), E4M3, block_dim=1)
    w_b, ws_b = block.block_cast_triton(x.float(), E4M3, block_dim=2)
    dequantize.dequantize_triton(cast.cast_to_fp8_triton(x, scale, E4M3), 2.0, torch.bfloat16)
    dequantize.mxfp8_dequantize_triton(q_mx, e_mx, dtype=torch.bfloat16)
    dequantize.block_dequantize_triton(q_b, s_b, block_dim=1, dtype=torch.bfloat16)
    block_gemm.block_scaled_gemm_triton(q_b, s_b, 1, w_b, ws_b, 2, out_dtype=torch.float32)
    history = torch.rand(4, 3, generator=g).to(DEVICE)
    scales = torch.ones(3, device=DEVICE)
    delayed_update.delayed_scaling_update_groups_triton([(history, scales, 448.0, 0, "max")])


def test_every_fast_launch_passes_runtime_arguments_then_every_constexpr(monkeypatch) -> None:
    calls = []
    original = FastLaunch.__call__

    def spy(self, grid, args, config, *, interpreted):
        calls.append((self.kernel, len(args), dict(config.constexprs)))
        return original(self, grid, args, config, interpreted=interpreted)

    monkeypatch.setattr(FastLaunch, "__call__", spy)
    _run_every_launcher()
    for kernel, n_args, constexprs in calls:
        names = list(kernel.arg_names)
        declared = _constexprs(kernel)
        name = kernel.fn.__name__
        assert names[n_args:] == declared, (
            f"{name}: runtime arguments are not all before constexprs"
        )
        assert sorted(constexprs) == sorted(declared), f"{name}: config {sorted(constexprs)}"
    launched = {kernel for kernel, _, _ in calls}
    every = {v.kernel for m in MODULES for v in vars(m).values() if isinstance(v, FastLaunch)}
    missed = sorted(k.fn.__name__ for k in every - launched)
    assert not missed, f"launchers not exercised: {missed}"


def test_a_full_table_of_prepared_launches_is_emptied_before_it_grows() -> None:
    table: dict = {}
    for i in range(PLAN_LIMIT):
        remember(table, i, str(i))
    assert len(table) == PLAN_LIMIT and table[PLAN_LIMIT - 1] == str(PLAN_LIMIT - 1)
    remember(table, "next", "kept")
    assert table == {"next": "kept"}
