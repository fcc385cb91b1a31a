"""SwiGLU -> fc2's per-tensor FP8 input cast, fused vs unfused, one run, one GPU.

Unfused is what LayerNormMLP(activation="swiglu") ran before the fusion: ``K.swiglu(h)`` writes
the activation in bf16, then the fc2 input quantizer's ``cast`` reads it (delayed: one pass;
current: the amax pass and the cast pass). Fused is ``Quantizer.cast_swiglu(h)``, what the module
runs now for per-tensor fc2 inputs. Both produce the transpose (the wgrad operand), as a training
step does. The script checks the two give the same bytes, scale inverse and amax, then prints the
median GPU time of each and the ratio. Default shape: Llama-3-8B's MLP at seq 8192, batch 1.

    python bench/bench_swiglu_cast.py [--tokens 8192] [--ffn 14336]
"""

from __future__ import annotations

import argparse

import torch
from bench_linear import cuda_median_ms

import dist_quant as dq
from dist_quant import kernels as K


def _quantizers() -> dict[str, tuple]:
    """Two equal quantizers per recipe (their amax slots are compared after one cast each)."""

    def delayed() -> dq.Float8Quantizer:
        return dq.Float8Quantizer(
            torch.full((1,), 0.5, device="cuda"), torch.zeros(1, device="cuda"), torch.float8_e4m3fn
        )

    def current() -> dq.Float8CurrentScalingQuantizer:
        return dq.Float8CurrentScalingQuantizer(torch.float8_e4m3fn)

    return {"delayed": (delayed(), delayed()), "current": (current(), current())}


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--tokens", type=int, default=8192)
    p.add_argument("--ffn", type=int, default=14336)
    args = p.parse_args()
    print(f"GPU: {torch.cuda.get_device_name()}  torch {torch.__version__}")
    print(f"h: ({args.tokens}, 2 * {args.ffn}) bf16 -> fc2 input ({args.tokens}, {args.ffn}) E4M3")
    h = torch.randn(args.tokens, 2 * args.ffn, device="cuda", dtype=torch.bfloat16) * 3
    print(f"{'recipe':>8} | {'unfused us':>10} | {'fused us':>8} | {'speedup':>7} | same bits")
    for name, (q_unfused, q_fused) in _quantizers().items():
        want = q_unfused.cast(K.swiglu(h), transpose=True)
        got = q_fused.cast_swiglu(h, transpose=True)
        same = all(
            torch.equal(a.view(torch.uint8), b.view(torch.uint8)) for a, b in zip(got[:2], want[:2])
        ) and torch.equal(got.scale_inv, want.scale_inv)
        if name == "delayed":
            same = same and torch.equal(q_fused.amax, q_unfused.amax)
        unfused_ms = cuda_median_ms(lambda q=q_unfused: q.cast(K.swiglu(h), transpose=True))
        fused_ms = cuda_median_ms(lambda q=q_fused: q.cast_swiglu(h, transpose=True))
        print(
            f"{name:>8} | {unfused_ms * 1e3:>10.1f} | {fused_ms * 1e3:>8.1f} | "
            f"{unfused_ms / fused_ms:>6.2f}x | {same}"
        )


if __name__ == "__main__":
    main()
