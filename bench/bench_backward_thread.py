"""How much slower Python runs inside a CUDA backward on the autograd engine's worker thread.

The same work is timed three ways, in one process: outside any backward (the calling thread),
inside the backward of an `autograd.Function` run by the engine's per-device worker thread (the
default for CUDA tensors), and inside one run on the calling thread
(`torch.autograd.set_multithreading_enabled(False)`). The work is a loop of plain interpreter
operations and a loop of `torch.empty(1)` on the GPU (a small torch call, like the many a
dist-quant backward makes). Prints the median time per unit of work.

    python bench/bench_backward_thread.py [--units 50] [--samples 200]
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import torch


def interpreter_work(units: int) -> None:
    total = 0
    for i in range(units * 20):
        total += i


def torch_calls(units: int) -> None:
    for _ in range(units):
        torch.empty(1, device="cuda")


def time_outside_backward(work: Callable[[], None], samples: int) -> list[float]:
    times = []
    for _ in range(samples):
        t0 = time.perf_counter()
        work()
        times.append(time.perf_counter() - t0)
    return times


def time_inside_backward(work: Callable[[], None], samples: int, *, on_caller: bool) -> list[float]:
    times: list[float] = []

    class Timed(torch.autograd.Function):
        @staticmethod
        def forward(ctx, t: torch.Tensor) -> torch.Tensor:
            return t.view_as(t)

        @staticmethod
        def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
            t0 = time.perf_counter()
            work()
            times.append(time.perf_counter() - t0)
            return grad

    x = torch.randn(256, 256, device="cuda", requires_grad=True)
    grad = torch.randn(256, 256, device="cuda")
    with torch.autograd.set_multithreading_enabled(not on_caller):
        for _ in range(samples):
            x.grad = None
            Timed.apply(x).backward(grad)
    torch.cuda.synchronize()
    return times


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--units", type=int, default=50, help="units of work per sample")
    p.add_argument("--samples", type=int, default=200)
    a = p.parse_args()
    print(f"GPU: {torch.cuda.get_device_name()}  torch {torch.__version__}")
    print(f"{'work':>20} | {'outside':>8} | {'worker':>8} | {'caller':>8} | worker / caller")
    for name, fn in (("interpreter", interpreter_work), ("torch.empty(1)", torch_calls)):

        def work(fn: Callable[[int], None] = fn) -> None:
            fn(a.units)

        work()  # warm
        medians = []
        for times in (
            time_outside_backward(work, a.samples),
            time_inside_backward(work, a.samples, on_caller=False),
            time_inside_backward(work, a.samples, on_caller=True),
        ):
            medians.append(sorted(times)[len(times) // 2] / a.units * 1e6)
        outside, worker, caller = medians
        print(
            f"{name:>20} | {outside:8.2f} | {worker:8.2f} | {caller:8.2f} | "
            f"{worker / caller:.2f}x   (us per unit)"
        )


if __name__ == "__main__":
    main()
