"""Block-scaled FP8 GEMM (Float8BlockScaling: 1x128 activations x 128x128 weights) on one GPU.

For each M = N = K, one run times, as medians of ``triton.testing.do_bench``:

- ``triton``: ``block_scaled_gemm_triton`` on the FP8 operands (bf16 output);
- ``deq+bf16``: ``block_dequantize`` of both operands to bf16, then a bf16 matmul: what the
  emulated path costs on a GPU when it dequantizes to bf16 instead of fp32;
- ``deq+fp32``: the emulated path exactly as ``dist_quant.gemm`` runs it off Hopper (fp32
  dequantize, fp32 matmul, no TF32);
- ``bf16``: a plain bf16 matmul of the unquantized operands;
- ``scaled_mm``: ``torch._scaled_mm`` with per-tensor scales, the cuBLAS FP8 ceiling.

It also prints the error of each path against a float64 product of the dequantized operands, as
max |out - exact| / (|A| @ |B|.T) (the tests' bound is relative to the same quantity), on random
and on same-sign data. ``--sweep`` times the kernel's launch configurations (first = default).

    python bench/bench_block_gemm.py [--sizes 4096,8192] [--sweep]
"""

from __future__ import annotations

import argparse
from collections.abc import Callable

import torch
from dist_quant.kernels import block_gemm
from dist_quant.kernels.block_gemm import block_scaled_gemm_triton
from triton.testing import do_bench

from dist_quant import kernels as K

E4M3 = torch.float8_e4m3fn
SWEEP = [  # first = default; comments: shared memory of the FP8 stages, CTAs per SM it allows
    {"BM": 128, "BN": 128, "GROUP_M": 8, "num_warps": 8, "num_stages": 4},  # 128 KiB: 1 CTA
    {"BM": 128, "BN": 128, "GROUP_M": 8, "num_warps": 8, "num_stages": 3},
    {"BM": 64, "BN": 128, "GROUP_M": 8, "num_warps": 4, "num_stages": 3},  # 72 KiB: 3 CTAs
    {"BM": 64, "BN": 128, "GROUP_M": 8, "num_warps": 4, "num_stages": 4},  # 96 KiB: 2 CTAs
    {"BM": 128, "BN": 64, "GROUP_M": 8, "num_warps": 4, "num_stages": 4},  # 96 KiB: 2 CTAs
    {"BM": 64, "BN": 256, "GROUP_M": 8, "num_warps": 8, "num_stages": 3},
    {"BM": 128, "BN": 256, "GROUP_M": 8, "num_warps": 8, "num_stages": 3},  # b scales as a vector
]


def _ms(fn: Callable[[], object]) -> float:
    return do_bench(fn, warmup=25, rep=200, return_mode="median")


def _operands(m: int, n: int, k: int, same_sign: bool = False):
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(m, k, device="cuda", generator=g, dtype=torch.bfloat16)
    w = torch.randn(n, k, device="cuda", generator=g, dtype=torch.bfloat16)
    if same_sign:
        x, w = x.abs(), w.abs()
    qa, sa = K.block_cast(x, E4M3, block_dim=1)
    qb, sb = K.block_cast(w, E4M3, block_dim=2)
    return x, w, (qa, sa, 1), (qb, sb, 2)


def _deq(op, dtype: torch.dtype) -> torch.Tensor:
    q, s, dim = op
    return K.block_dequantize(q, s, block_dim=dim, dtype=dtype)


def _errors(m: int, same_sign: bool) -> dict[str, float]:
    """max |out - exact| / (|A| @ |B|.T) per path, exact = float64 product of the fp32 operands."""
    _, _, a, b = _operands(m, m, m, same_sign)
    a64, b64 = _deq(a, torch.float32).double(), _deq(b, torch.float32).double()
    exact = a64 @ b64.T
    mag = a64.abs() @ b64.abs().T
    outs = {
        "triton fp32 out": block_scaled_gemm_triton(*a, *b, out_dtype=torch.float32),
        "deq+fp32": _deq(a, torch.float32) @ _deq(b, torch.float32).T,
        "deq+bf16 (bf16 out)": _deq(a, torch.bfloat16) @ _deq(b, torch.bfloat16).T,
    }
    return {name: ((o.double() - exact).abs() / mag).max().item() for name, o in outs.items()}


def _bench_size(size: int, sweep: bool) -> None:
    x, w, a, b = _operands(size, size, size)
    flop = 2.0 * size**3
    one = torch.ones((), device="cuda")

    def triton_gemm() -> torch.Tensor:
        return block_scaled_gemm_triton(*a, *b, out_dtype=torch.bfloat16)

    times = {
        "triton": _ms(triton_gemm),
        "deq+bf16": _ms(lambda: _deq(a, torch.bfloat16) @ _deq(b, torch.bfloat16).T),
        "deq+fp32": _ms(lambda: _deq(a, torch.float32) @ _deq(b, torch.float32).T),
        "bf16": _ms(lambda: x @ w.T),
        # cuBLASLt wants b column-major: b's (N, K) rows transposed, no copy
        "scaled_mm": _ms(
            lambda: torch._scaled_mm(
                a[0], b[0].t(), scale_a=one, scale_b=one, out_dtype=torch.bfloat16
            )
        ),
    }
    t = times["triton"]
    cells = [f"{size}"] + [f"{v:.3f}" for v in times.values()]
    print(
        " | ".join(cells) + f" | {flop / t / 1e9:.0f} | {times['deq+bf16'] / t:.2f}"
        f" | {times['bf16'] / t:.2f} | {100 * times['scaled_mm'] / t:.0f}"
    )
    if not sweep:
        return
    default = dict(block_gemm.GPU_CONFIG)
    reference_out = triton_gemm()
    for cfg in SWEEP:
        block_gemm.GPU_CONFIG = cfg
        try:
            ms = _ms(triton_gemm)
            same = torch.equal(triton_gemm(), reference_out)
            print(
                f"  sweep {cfg}: {ms:.3f} ms, {flop / ms / 1e9:.0f} TFLOP/s, "
                f"output {'byte-identical to' if same else 'DIFFERS from'} the default's"
            )
        except Exception as exc:  # a config that cannot compile must not end the run
            print(f"  sweep {cfg}: failed ({type(exc).__name__}: {str(exc)[:100]})")
        finally:
            block_gemm.GPU_CONFIG = default


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sizes", default="4096,8192")
    p.add_argument("--sweep", action="store_true")
    args = p.parse_args()
    torch.backends.cuda.matmul.allow_tf32 = False
    print(f"GPU: {torch.cuda.get_device_name()}, torch {torch.__version__}")
    print(f"default config: {block_gemm.GPU_CONFIG}")
    head = ["M=N=K", "triton ms", "deq+bf16 ms", "deq+fp32 ms", "bf16 ms", "scaled_mm ms"]
    print(" | ".join(head) + " | TFLOP/s triton | x deq+bf16 | x bf16 | % scaled_mm")
    for size in (int(s) for s in args.sizes.split(",")):
        _bench_size(size, args.sweep)
    for same_sign in (False, True):
        errs = _errors(2048, same_sign)
        what = "same-sign" if same_sign else "random"
        print(f"error / (|A|@|B|^T), 2048^3 {what}: " + ", ".join(
            f"{k} {v:.2e} (2^{torch.tensor(v).log2().item():.1f})" for k, v in errs.items()
        ))  # fmt: skip


if __name__ == "__main__":
    main()
