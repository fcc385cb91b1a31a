"""NVFP4 cast and emulated GEMM on a CUDA device, side by side with MXFP8 and a device copy.

For each (rows, cols) bf16 shape, one run times the NVFP4 casts (rowwise, columnwise read in place,
16x16 blocks, RHT + stochastic rounding columnwise) through the ``dist_quant.kernels`` dispatcher,
the MXFP8 casts of the same tensor, and a device-to-device copy of it (the bandwidth ceiling), all
medians of ``triton.testing.do_bench``. Bytes moved: the bf16 input read once plus the outputs
written once (NVFP4: K/2 data bytes and K/16 scale bytes per row; MXFP8: K and K/32). The casts
take their amax as an input; the amax pass (``kernels.amax``, or the RHT then the amax for the
wgrad operand) is timed on its own line.

The GEMM section times bf16 ``torch.matmul`` against the emulated NVFP4 GEMM on the same shape:
``nvfp4_gemm(ordered=False)`` (one fp32 matmul of block-scaled values, what a GPU without FP4
tensor cores runs) and the ordered definition (one small matmul per 16-block).

    python bench/bench_nvfp4.py                        # the table
    python bench/bench_nvfp4.py --sweep                # also launch configurations of the casts
    python bench/bench_nvfp4.py --shapes 8192x8192 --json out.json
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable

import torch
import triton
from dist_quant.kernels import nvfp4
from dist_quant.kernels import reference_nvfp4 as ref
from triton.testing import do_bench

from dist_quant import kernels as K

E4M3 = torch.float8_e4m3fn


def _ms(fn: Callable[[], object], rep: int = 60) -> float:
    return do_bench(fn, warmup=10, rep=rep, return_mode="median")


def cast_cases(x: torch.Tensor) -> dict[str, tuple[int, Callable[[], object]]]:
    rows, cols = x.shape
    n = x.numel()
    amax = K.amax(x).reshape(1)
    amax_t = K.amax(ref.random_hadamard_transform(x.t())).reshape(1)
    nv_bytes, mx_bytes = 2 * n + n // 2 + n // 16, 2 * n + n + n // 32
    return {
        "amax (rowwise or columnwise operand)": (2 * n, lambda: K.amax(x)),
        "amax of RHT(x.t()) (torch reference)": (
            2 * n, lambda: K.amax(ref.random_hadamard_transform(x.t()))
        ),
        "mxfp8 rowwise": (mx_bytes, lambda: K.mxfp8_cast(x, E4M3)),
        "mxfp8 columnwise": (mx_bytes, lambda: K.mxfp8_cast(x, E4M3, columnwise=True)),
        "nvfp4 rowwise": (nv_bytes, lambda: K.nvfp4_cast(x, amax)),
        "nvfp4 columnwise": (nv_bytes, lambda: K.nvfp4_cast(x, amax, columnwise=True)),
        "nvfp4 16x16 (weight)": (nv_bytes, lambda: K.nvfp4_cast(x, amax, block_2d=True)),
        "nvfp4 rowwise + SR": (
            nv_bytes, lambda: K.nvfp4_cast(x, amax, stochastic=True, seed=1, offset=2)
        ),
        "nvfp4 columnwise RHT + SR (grad wgrad)": (
            nv_bytes,
            lambda: K.nvfp4_cast(
                x, amax_t, columnwise=True, rht=True, stochastic=True, seed=1, offset=2
            ),
        ),
        "nvfp4 columnwise RHT (input wgrad)": (
            nv_bytes, lambda: K.nvfp4_cast(x, amax_t, columnwise=True, rht=True)
        ),
    }  # fmt: skip


def run_casts(shapes: list[tuple[int, int]]) -> list[dict]:
    out = []
    for rows, cols in shapes:
        x = torch.randn(rows, cols, device="cuda", dtype=torch.bfloat16)
        dst = torch.empty_like(x)
        copy = _ms(lambda: dst.copy_(x))  # noqa: B023
        copy_bw = 4 * x.numel() / copy / 1e6
        print(f"\n## {rows}x{cols} bf16: device copy {copy * 1e3:.1f} us = {copy_bw:.0f} GB/s")
        print(f"{'operation':42s} {'us':>9s} {'GB/s':>7s} {'% copy':>7s} {'x copy time':>11s}")
        times = {}
        for name, (nbytes, fn) in cast_cases(x).items():
            t = _ms(fn)
            times[name] = t
            bw = nbytes / t / 1e6
            print(
                f"{name:42s} {t * 1e3:9.1f} {bw:7.0f} {100 * bw / copy_bw:6.0f}% {t / copy:10.2f}x"
            )
            out.append(dict(shape=[rows, cols], op=name, us=t * 1e3, gbps=bw, copy_gbps=copy_bw))
        for nv, mx in (
            ("nvfp4 rowwise", "mxfp8 rowwise"),
            ("nvfp4 columnwise", "mxfp8 columnwise"),
        ):
            print(f"{nv} / {mx}: {times[nv] / times[mx]:.2f}x the time")
    return out


def run_gemm(shapes: list[tuple[int, int, int]]) -> list[dict]:
    out = []
    for m, n, k in shapes:
        a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        b = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
        qa, qb = K.nvfp4_cast(a, K.amax(a)), K.nvfp4_cast(b, K.amax(b), block_2d=True)
        opa, opb = (qa.data, qa.scales, K.amax(a)), (qb.data, qb.scales, K.amax(b))
        bf16 = _ms(lambda: a @ b.t())  # noqa: B023
        fast = _ms(lambda: K.nvfp4_gemm(opa, opb, ordered=False))  # noqa: B023
        ordered = _ms(lambda: K.nvfp4_gemm(opa, opb), rep=20)  # noqa: B023
        print(
            f"\n## GEMM {m}x{n}x{k}: bf16 {bf16 * 1e3:.0f} us; emulated NVFP4 one matmul "
            f"{fast * 1e3:.0f} us ({fast / bf16:.1f}x), ordered per block {ordered * 1e3:.0f} us "
            f"({ordered / bf16:.0f}x)"
        )
        out.append(dict(shape=[m, n, k], bf16_us=bf16 * 1e3, emulated_us=fast * 1e3,
                        ordered_us=ordered * 1e3))  # fmt: skip
    return out


SWEEP = {  # kernel configuration attribute of kernels/nvfp4.py -> (cast options, configurations)
    "GPU_ROWWISE": ({}, [(16, 8, 4), (32, 4, 4), (8, 16, 4), (32, 8, 8)], ("BM", "NB")),
    "GPU_COLUMNWISE": ({"columnwise": True}, [(2, 64, 4), (1, 128, 4), (4, 32, 4), (2, 128, 8)],
                       ("NB", "BN")),
    "GPU_COLUMNWISE_RHT": ({"columnwise": True, "rht": True, "stochastic": True},
                           [(64, 2, 4), (128, 1, 4), (32, 4, 4), (128, 2, 8)], ("BM", "NB")),
}  # fmt: skip


def run_sweep(shape: tuple[int, int]) -> list[dict]:
    """Each launch configuration of each cast kernel, its bytes compared with the default's."""
    x = torch.randn(*shape, device="cuda", dtype=torch.bfloat16)
    amax = K.amax(x).reshape(1)
    out = []
    for attr, (options, configs, names) in SWEEP.items():
        default = getattr(nvfp4, attr)
        expected = nvfp4.nvfp4_cast_triton(x, amax, **options)
        for a, b, warps in configs:
            setattr(nvfp4, attr, {names[0]: a, names[1]: b, "num_warps": warps})
            got = nvfp4.nvfp4_cast_triton(x, amax, **options)
            same = torch.equal(got.data, expected.data) and torch.equal(
                got.scales.view(torch.uint8), expected.scales.view(torch.uint8)
            )
            t = _ms(lambda: nvfp4.nvfp4_cast_triton(x, amax, **options))  # noqa: B023
            print(f"sweep {attr:18s} {names[0]}={a:3d} {names[1]}={b:3d} warps={warps}: "
                  f"{t * 1e3:8.1f} us  same bytes as the default: {same}")  # fmt: skip
            out.append(dict(kernel=attr, config=[a, b, warps], us=t * 1e3, same=same))
        setattr(nvfp4, attr, default)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", default="4096x4096,8192x8192", help="rows x cols of bf16")
    parser.add_argument("--gemm", default="4096x4096x4096", help="M x N x K")
    parser.add_argument("--sweep", action="store_true", help="sweep launch configurations")
    parser.add_argument("--json", help="write the measurements here")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_nvfp4: needs a CUDA device", file=sys.stderr)
        return 2
    shapes = [tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",")]
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}")
    out = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
           "triton": triton.__version__}  # fmt: skip
    if args.sweep:
        out["sweep"] = run_sweep(shapes[-1])
    out["casts"] = run_casts(shapes)
    out["gemm"] = run_gemm([tuple(int(v) for v in s.split("x")) for s in args.gemm.split(",")])
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1, default=str)
    return 0


if __name__ == "__main__":
    sys.exit(main())
