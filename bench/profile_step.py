"""Where the host time of one eager dq Linear step goes (GPU): kernels per step, host us per step,
cProfile's top entries. Diagnostic, prints only.

    python bench/profile_step.py [--shape 4096x4096x4096] [--top 30] [--prepared-ab]
        [--per-tensor-ab] [--floor] [--backward-on-caller]

`--per-tensor-ab` alternates the per-tensor linear path with the general one in this process;
`--floor` times the delayed step's kernels issued by one bare `autograd.Function` (the host time
no Python around the kernels could go below), next to BF16 `nn.Linear` and a BF16 `Function`.
`--backward-on-caller` runs every step's backward on the calling thread
(`torch.autograd.set_multithreading_enabled(False)`) instead of the autograd engine's CUDA device
thread; cProfile sees only the thread it runs on, so its table includes the backward only then.
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import time

import torch
import torch.nn.functional as F
from bench_linear import make_step
from dist_quant.kernels import cast, current, delayed, delayed_update

import dist_quant as dq
from dist_quant.modules import functional, linear


def host_us(step, n=30):
    step()
    torch.cuda.synchronize()
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
    torch.cuda.synchronize()
    return sorted(times)[n // 2] * 1e6


def kernels_per_step(step):
    from torch.profiler import ProfilerActivity, profile

    step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    # (kernel name, GPU us) in launch order
    return [(e.name, e.device_time) for e in prof.events() if e.device_type.name == "CUDA"]


def print_compact(stats: pstats.Stats, sort: str, top: int, steps: int) -> None:
    """One line per function: us per step (own, cumulative), calls per step, short name."""
    rows = []
    for (path, line, func), (_, ncalls, tottime, cumtime, _) in stats.stats.items():
        short = f"{'/'.join(path.split('/')[-2:])}:{line}({func})"
        rows.append((tottime, cumtime, ncalls, short[-70:]))
    key = 0 if sort == "tottime" else 1
    print(f"{'own us':>8} {'cum us':>8} {'calls':>6}  (per step)")
    for tottime, cumtime, ncalls, name in sorted(rows, key=lambda r: -r[key])[:top]:
        print(
            f"{tottime / steps * 1e6:8.1f} {cumtime / steps * 1e6:8.1f} {ncalls / steps:6.1f}  {name}"
        )


class _NeverStored(dict):
    """A plan table that keeps nothing: every cast takes the full, validated launch path."""

    def __setitem__(self, key, value) -> None:
        pass


def prepared_against_full(step, rounds: int = 5) -> str:
    """Host us per step and Python calls per step of `step` with the casts' prepared launches
    (the default) against the full launch path, alternating in this process (the host's speed
    drifts between runs, not between neighbouring rounds)."""
    tables = ((delayed, "_delayed_plans"), (current, "_current_plans"))
    kept = [getattr(module, name) for module, name in tables]

    def use(prepared: bool) -> None:
        for (module, name), plans in zip(tables, kept):
            setattr(module, name, plans if prepared else _NeverStored())

    times = {True: [], False: []}
    calls = {}
    try:
        for _ in range(rounds):
            for prepared in (True, False):
                use(prepared)
                times[prepared].append(host_us(step, n=50))
        for prepared in (True, False):
            use(prepared)
            pr = cProfile.Profile()
            pr.enable()
            for _ in range(10):
                step()
            pr.disable()
            calls[prepared] = sum(v[1] for v in pstats.Stats(pr).stats.values()) / 10
    finally:
        use(True)
    return "; ".join(
        f"{'prepared' if p else 'full path'}: host us/step min {min(times[p]):.0f} median "
        f"{sorted(times[p])[rounds // 2]:.0f}, {calls[p]:.0f} Python calls/step"
        for p in (True, False)
    )


def _general_path(x, weight, bias, slots, weight_q, **boundaries):
    """`quantized_linear` forced onto the general path (one rank, no FP8 boundary)."""
    return functional._QuantizedLinear.apply(x, weight, bias, slots, weight_q, False, False, None)


def per_tensor_against_general(step, rounds: int = 6) -> str:
    """Host us per step with the per-tensor linear path (the default for per-tensor recipes)
    against the general path, alternating in this process."""
    times = {True: [], False: []}
    try:
        for _ in range(rounds):
            for per_tensor in (True, False):
                linear.quantized_linear = (
                    functional.quantized_linear if per_tensor else _general_path
                )
                times[per_tensor].append(host_us(step, n=40))
    finally:
        linear.quantized_linear = functional.quantized_linear
    return "; ".join(
        f"{'per-tensor path' if p else 'general path'}: host us/step min {min(times[p]):.0f} "
        f"median {sorted(times[p])[rounds // 2]:.0f}"
        for p in (True, False)
    )


class _BareStep(torch.autograd.Function):
    """The kernels of a delayed Linear step and nothing else: the prepared casts of `plans`
    (e4m3 for x and W, e5m2 for dy; fresh outputs, fixed scale and amax buffers), three
    `_scaled_mm`."""

    @staticmethod
    def forward(ctx, x, w, plans, buffers):
        xq, xqt, xsi = _bare_cast(plans[0], x, buffers[0])
        wq, wqt, wsi = _bare_cast(plans[0], w, buffers[1])
        y = torch._scaled_mm(xq, wq.t(), scale_a=xsi, scale_b=wsi, out_dtype=x.dtype)
        ctx.save_for_backward(xqt, xsi, wqt, wsi)
        ctx.plans, ctx.buffers = plans, buffers
        return y

    @staticmethod
    def backward(ctx, dy):
        xqt, xsi, wqt, wsi = ctx.saved_tensors
        gq, gqt, gsi = _bare_cast(ctx.plans[1], dy, ctx.buffers[2])
        dx = torch._scaled_mm(gq, wqt.t(), scale_a=gsi, scale_b=wsi, out_dtype=dy.dtype)
        dw = torch._scaled_mm(gqt, xqt.t(), scale_a=gsi, scale_b=xsi, out_dtype=dy.dtype)
        return dx, dw, None, None


def _bare_cast(plan, t, scale_and_amax):
    prepared, q_t_shape, fp8_dtype = plan
    scale, amax = scale_and_amax
    scale_inv = torch.empty(1, dtype=torch.float32, device=t.device)
    q = torch.empty_like(t, dtype=fp8_dtype)
    q_t = torch.empty(q_t_shape, dtype=fp8_dtype, device=t.device)
    stream = torch._C._cuda_getCurrentRawStream(t.get_device())
    outs = (scale, scale, scale_inv)
    prepared.launch(stream, *cast.cast_args(t, q, q_t, scale, amax, scale, 0, 0.0, outs))
    return q, q_t, scale_inv


class _BareBf16(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w):
        ctx.save_for_backward(x, w)
        return x @ w.t()

    @staticmethod
    def backward(ctx, dy):
        x, w = ctx.saved_tensors
        return dy @ w, dy.t() @ x


def host_floor(x, dy) -> str:
    """After a delayed step of this shape ran (its casts and updates are prepared): host us per
    step of the bare kernels, of BF16 `nn.Linear` and of a BF16 `Function`."""
    plans = {}
    for key, (prepared, q_t_shape) in delayed._delayed_plans.items():
        if key[4] and key[0] == x.shape:  # transposed casts of this shape, by FP8 format
            plans[key[3]] = (prepared, q_t_shape, key[3])
    e4m3, e5m2 = torch.float8_e4m3fn, torch.float8_e5m2
    updates = [plan for plan in delayed_update._PLANS.values() if plan.prepared is not None]
    if e4m3 not in plans or e5m2 not in plans or len(updates) < 2:
        return "floor: no prepared delayed casts and updates of this shape (run delayed first)"
    buffers = [(torch.ones(1, device=x.device), torch.zeros(1, device=x.device)) for _ in range(3)]
    w = torch.randn(dy.shape[1], x.shape[1], device=x.device, dtype=x.dtype, requires_grad=True)

    def bare():
        x.grad = w.grad = None
        y = _BareStep.apply(x, w, (plans[e4m3], plans[e5m2]), buffers)
        updates[0].launch()
        y.backward(dy)
        updates[1].launch()

    def bf16_function():
        x.grad = w.grad = None
        _BareBf16.apply(x, w).backward(dy)

    def bf16_linear():
        x.grad = w.grad = None
        F.linear(x, w).backward(dy)

    steps = {
        "bare delayed kernels": bare,
        "BF16 Function": bf16_function,
        "BF16 F.linear": bf16_linear,
    }
    return "floor, host us/step: " + ", ".join(
        f"{k} {host_us(f, n=60):.0f}" for k, f in steps.items()
    )


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--shape", default="4096x4096x4096")
    p.add_argument("--top", type=int, default=25)
    p.add_argument("--recipes", default="off,bf16,delayed,current")
    p.add_argument("--graphed", action="store_true", help="dq.make_graphed_callables the Linear")
    p.add_argument("--sort", default="tottime", help="cProfile sort key (tottime, cumulative)")
    p.add_argument("--kernel-times", action="store_true", help="each kernel's GPU time")
    p.add_argument("--no-cprofile", action="store_true", help="skip the cProfile table")
    p.add_argument(
        "--prepared-ab",
        action="store_true",
        help="FP8 recipes: prepared cast launches against the full launch path, same process",
    )
    p.add_argument(
        "--per-tensor-ab",
        action="store_true",
        help="FP8 recipes: the per-tensor linear path against the general path, same process",
    )
    p.add_argument(
        "--floor", action="store_true", help="after delayed: the bare kernels' host floor"
    )
    p.add_argument(
        "--backward-on-caller",
        action="store_true",
        help="run each backward on the calling thread, not the engine's device thread",
    )
    a = p.parse_args()
    torch.autograd.set_multithreading_enabled(not a.backward_on_caller)
    m, k, n = (int(v) for v in a.shape.split("x"))
    torch.manual_seed(0)
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn(m, n, device="cuda", dtype=torch.bfloat16)
    recipes = {
        "off": None,
        "bf16": dq.recipe_from_dict("bf16"),
        "delayed": dq.DelayedScaling(),
        "current": dq.Float8CurrentScaling(),
    }
    summary = []
    for label in a.recipes.split(","):
        recipe = recipes[label]
        lin = dq.Linear(k, n, bias=False, params_dtype=torch.bfloat16, device="cuda")
        if recipe is not None:
            dq.apply_recipe(lin, recipe)
            if a.graphed:
                lin = dq.make_graphed_callables(lin, (x,))
        step = make_step(lin, x, dy, recipe)
        for _ in range(3):
            step()
        torch.cuda.synchronize()
        h = host_us(step)
        ks = kernels_per_step(step)
        gpu = sum(us for _, us in ks)
        summary.append(
            f"{a.shape} {label}: host {h:.0f} us/step, {len(ks)} kernels, {gpu:.0f} us of kernels"
        )
        if a.kernel_times:
            for name, us in ks:
                print(f"  {us:8.1f} us  {name[:90]}")
        print("==", summary[-1])
        if a.prepared_ab and recipe is not None:
            summary.append(f"{a.shape} {label}: {prepared_against_full(step)}")
            print("==", summary[-1])
        if a.per_tensor_ab and recipe is not None:
            summary.append(f"{a.shape} {label}: {per_tensor_against_general(step)}")
            print("==", summary[-1])
        if a.floor and label == "delayed":
            summary.append(f"{a.shape}: {host_floor(x, dy)}")
            print("==", summary[-1])
        if a.no_cprofile:
            continue
        pr = cProfile.Profile()
        pr.enable()
        for _ in range(20):
            step()
        pr.disable()
        torch.cuda.synchronize()
        print_compact(pstats.Stats(pr), a.sort, a.top, steps=20)
    print("\n".join(summary))


if __name__ == "__main__":
    main()
