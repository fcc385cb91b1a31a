"""Host time of one eager call of each public kernel function (GPU): the dispatch and launch cost a
training step pays per cast, on tensors small enough that the GPU never holds the host back.
Prints only.

    python bench/bench_dispatch.py

Uses only the public names of ``dist_quant.kernels``, so the same file times any tree: copy it
next to another checkout's ``bench/`` and run it there to compare two trees on one lease (run each
twice, alternating: the host's speed drifts between runs more than between neighbouring rounds).
"""

from __future__ import annotations

import statistics
import subprocess
import time

import torch

from dist_quant import kernels as K

E4M3 = torch.float8_e4m3fn


def calls(size: int) -> dict[str, object]:
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(size, size, device="cuda", generator=g, dtype=torch.bfloat16)
    w = torch.nn.Parameter(x.clone())
    scale = torch.ones(1, device="cuda")
    history = torch.zeros(16, 3, device="cuda")
    slot = history[0, 0:1]
    scales, limits = torch.ones(3, device="cuda"), torch.full((3,), 448.0, device="cuda")
    groups = [(history, scales, limits, 0.0, "max")]
    q = K.cast_to_fp8(x, scale, E4M3)
    return {
        "delayed_cast": lambda: K.delayed_cast(x, scale, E4M3, slot, transpose=False),
        "delayed_cast transpose": lambda: K.delayed_cast(x, scale, E4M3, slot, transpose=True),
        "delayed_cast parameter": lambda: K.delayed_cast(w, scale, E4M3, slot, transpose=True),
        "current_scaling_cast": lambda: K.current_scaling_cast(x, E4M3),
        "current_scaling_cast transpose": lambda: K.current_scaling_cast(x, E4M3, transpose=True),
        "amax": lambda: K.amax(x),
        "current_scale": lambda: K.current_scale(scale, E4M3),
        "cast_to_fp8": lambda: K.cast_to_fp8(x, scale, E4M3),
        "mxfp8_cast": lambda: K.mxfp8_cast(x, E4M3),
        "block_cast": lambda: K.block_cast(x, E4M3, block_dim=1),
        "dequantize": lambda: K.dequantize(q, scale, torch.bfloat16),
        "delayed_scaling_update_groups": lambda: K.delayed_scaling_update_groups(groups),
    }


def host_us(fn, n_calls: int, rounds: int) -> float:
    """Median over rounds of the host time per call (the GPU drained between rounds)."""
    for _ in range(10):
        fn()
    torch.cuda.synchronize()
    per_call = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        for _ in range(n_calls):
            fn()
        per_call.append((time.perf_counter() - t0) / n_calls * 1e6)
        torch.cuda.synchronize()
    return statistics.median(per_call)


CALLS, ROUNDS, SIZE = 200, 15, 256


def main() -> None:
    if not torch.cuda.is_available():
        raise SystemExit("bench_dispatch: needs a CUDA device")
    head = subprocess.run(
        ["git", "log", "-1", "--format=%h %s"], capture_output=True, text=True, check=False
    ).stdout.strip()
    print(f"tree: {head or '?'}; torch {torch.__version__}; {torch.cuda.get_device_name()}")
    print(f"{SIZE}x{SIZE} bf16, host us per call, median of {ROUNDS} rounds of {CALLS} calls")
    for name, fn in calls(SIZE).items():
        print(f"{host_us(fn, CALLS, ROUNDS):8.2f} us  {name}")


if __name__ == "__main__":
    main()
