"""Linear forward+backward at the issue-17 shapes: eager, CUDA-graphed and torch.compile'd, one run.

For each shape M x K x N (tokens x in x out, bf16 activations and weights, no bias) it measures,
in one process on one GPU:

- BF16 `nn.Linear`, dist-quant delayed scaling and current scaling, each eager, CUDA-graphed
  (`torch.cuda.make_graphed_callables` / `dist_quant.make_graphed_callables`: the forward and
  backward graphed, autocast's bookkeeping and the delayed update eager around them), whole-step
  graphed (`dist_quant.GraphedStep` over the step: autocast, forward, backward and the delayed
  update in one graph, the same for BF16), `torch.compile(fullgraph=True)`'d, and compiled with
  `mode="reduce-overhead"` (inductor's CUDA graphs: "compiled-ro"); "eager-caller" is the eager
  step with its backward run on the calling thread (`torch.autograd.set_multithreading_enabled(False)`,
  every variant alike) instead of the autograd engine's CUDA device thread;
- torchao's `Float8Linear` (tensorwise scaling) compiled both ways, when torchao is installed
  (else "-");

and prints the median GPU time of a step (`triton.testing.do_bench`), the host time to issue one
step (Python + launches, no sync), and each variant's ratio over BF16 run the same way. The first
step of each dist-quant variant in this fresh process is timed separately (it includes Triton's
compilation of the kernels it is the first to use; later variants reuse them).

    python bench/bench_shapes.py [--shapes 4096x4096x4096,...] [--modes eager,compiled-ro,...]
    python bench/bench_shapes.py --dry-run      # tiny CPU run of every eager path, no timing
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import torch
from bench_linear import make_step

import dist_quant as dq

SHAPES = [
    (4096, 4096, 4096),
    (8192, 4096, 4096),
    (8192, 8192, 1024),  # a TP=8 shard
    (8192, 1024, 8192),  # a TP=8 shard
    (8192, 4096, 1792),  # Llama MLP, TP=8
    (8192, 8192, 8192),
]
MODES = ("eager", "eager-caller", "graphed", "step", "compiled", "compiled-ro")
COMPILE_MODES = {"compiled": None, "compiled-ro": "reduce-overhead"}
RECIPES = {"dq delayed": dq.DelayedScaling(), "dq current": dq.Float8CurrentScaling()}
HOST_STEPS = 20


def _torchao_float8(k: int, n: int, device: str) -> torch.nn.Module | None:
    """torchao's Float8Linear with its default (tensorwise, dynamic) scaling; None without torchao."""
    try:
        from torchao.float8.config import Float8LinearConfig
        from torchao.float8.float8_linear import Float8Linear
    except ImportError:
        return None
    linear = torch.nn.Linear(k, n, bias=False, device=device, dtype=torch.bfloat16)
    return Float8Linear.from_float(linear, config=Float8LinearConfig())


def _variant(label: str, mode: str, k: int, n: int, x: torch.Tensor, device: str):
    """(module, recipe) of one variant, graphed or compiled as `mode` asks; None if unavailable."""
    if label == "torchao tensorwise":
        if mode not in COMPILE_MODES:
            return None
        model = _torchao_float8(k, n, device)
        compile_mode = COMPILE_MODES[mode]
        return (
            None
            if model is None
            else (torch.compile(model, fullgraph=True, mode=compile_mode), None)
        )
    recipe = RECIPES.get(label)
    if recipe is None:  # bf16
        module = torch.nn.Linear(k, n, bias=False, device=device, dtype=torch.bfloat16)
    else:
        module = dq.Linear(k, n, bias=False, params_dtype=torch.bfloat16, device=device)
        dq.apply_recipe(module, recipe)  # planned and pinned: a compiled forward needs no planning
    if mode == "graphed":
        graph = (
            dq.make_graphed_callables if recipe is not None else torch.cuda.make_graphed_callables
        )
        module = graph(module, (x,))
    elif mode in COMPILE_MODES:
        module = torch.compile(module, fullgraph=True, mode=COMPILE_MODES[mode])
    return module, recipe


def _host_us(step: Callable[[], None]) -> float:
    """Median host time to issue one step (no sync between steps: the GPU runs behind)."""
    torch.cuda.synchronize()
    times = []
    for _ in range(HOST_STEPS):
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
    torch.cuda.synchronize()
    return sorted(times)[len(times) // 2] * 1e6


def _first_step_s(step: Callable[[], None]) -> float:
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    step()
    torch.cuda.synchronize()
    return time.perf_counter() - t0


def bench_shape(m: int, k: int, n: int, modes: list[str], cold: dict[str, float]) -> list[tuple]:
    from triton.testing import do_bench

    rows = []
    torch._dynamo.reset()  # every variant is a new module: dynamo's per-code recompile limit is 8
    for mode in modes:
        for label in ("bf16", *RECIPES, "torchao tensorwise"):
            torch.manual_seed(0)
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16, requires_grad=True)
            dy = torch.randn(m, n, device="cuda", dtype=torch.bfloat16)
            built = _variant(label, mode, k, n, x, "cuda")
            if built is None:
                rows.append((mode, label, None, None))
                continue
            module, recipe = built
            step = make_step(module, x, dy, recipe, backward_on_caller=mode == "eager-caller")
            if mode == "step":  # the whole step in one CUDA graph; its warm-up steps are real
                step = dq.GraphedStep(step, module)
            key = f"{label} {mode}"
            if recipe is not None and key not in cold:
                cold[key] = _first_step_s(step)
            us = do_bench(step, return_mode="median") * 1e3
            rows.append((mode, label, us, _host_us(step)))
    return rows


def print_rows(shape: tuple[int, int, int], rows: list[tuple], eager_bf16: float | None) -> None:
    base = {mode: us for mode, label, us, _ in rows if label == "bf16"}
    name = "x".join(map(str, shape))
    for mode, label, us, host in rows:
        if us is None:
            print(
                f"{name:>16} | {mode:>8} | {label:>18} | {'-':>9} | {'-':>9} | {'-':>8} | {'-':>8}"
            )
            continue
        same = base[mode] / us
        vs_eager = f"{eager_bf16 / us:7.2f}x" if eager_bf16 else "-"
        print(
            f"{name:>16} | {mode:>8} | {label:>18} | {us:9.1f} | {host:9.1f} | {same:7.2f}x | "
            f"{vs_eager:>8}"
        )


def dry_run() -> None:
    """Every eager variant once on the CPU at a tiny shape: checks the paths, times nothing."""
    m, k, n = 64, 64, 32
    x = torch.randn(m, k, dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn(m, n, dtype=torch.bfloat16)
    for label in ("bf16", *RECIPES):
        module, recipe = _variant(label, "eager", k, n, x, "cpu")
        make_step(module, x, dy, recipe)()
        print(f"dry run: {label} eager step ran, dx {tuple(x.grad.shape)}")
    print("dry run: torchao", "available" if _torchao_float8(k, n, "cpu") is not None else "absent")


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--shapes", default=",".join("x".join(map(str, s)) for s in SHAPES))
    parser.add_argument(
        "--modes", default=",".join(MODES), help="comma list of " + ", ".join(MODES)
    )
    parser.add_argument("--dry-run", action="store_true", help="tiny CPU run, no GPU, no timing")
    args = parser.parse_args()
    shapes = [tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",")]
    modes = args.modes.split(",")
    bad = [m for m in modes if m not in MODES]
    if bad or any(len(s) != 3 for s in shapes):
        parser.error(f"--modes takes {', '.join(MODES)}; --shapes takes MxKxN,... (got {bad})")
    if args.dry_run:
        dry_run()
        return
    print(f"GPU: {torch.cuda.get_device_name()}  torch {torch.__version__}")
    print(f"{'shape MxKxN':>16} | {'mode':>8} | {'variant':>18} | {'median us':>9} | "
          f"{'host us':>9} | {'vs bf16':>8} | {'vs eager':>8}")  # fmt: skip
    cold: dict[str, float] = {}
    eager_bf16: dict[tuple, float] = {}
    # mode by mode over every shape, each row printed as soon as it is measured: the slow
    # compiled variants come last, and a run cut short keeps what it measured
    for mode in modes:
        for shape in shapes:
            rows = bench_shape(*shape, [mode], cold)
            if mode.startswith("eager"):
                eager_bf16.setdefault(
                    shape, next(us for _, label, us, _ in rows if label == "bf16")
                )
            print_rows(shape, rows, eager_bf16.get(shape))
    print("\nfirst step in this process (s; includes Triton compilation of kernels not yet used):")
    for key, s in cold.items():
        print(f"  {key:>24}: {s:7.3f}")


if __name__ == "__main__":
    main()
