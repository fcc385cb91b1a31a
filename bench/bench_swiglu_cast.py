"""SwiGLU and its backward fused with the neighbouring per-tensor FP8 casts, vs unfused, one GPU.

Forward: unfused is ``K.swiglu(h)`` writing the activation in bf16, then fc2's input quantizer's
``cast`` reading it (delayed: one pass; current: the amax pass and the cast pass); fused is
``Quantizer.cast_swiglu(h)``. Backward: unfused is ``K.swiglu_backward(dy, h)`` writing ``dh`` in
bf16, then fc1's grad-output quantizer (E5M2) casting it; fused is
``Quantizer.cast_swiglu_backward(dy, h)``. Every cast also writes the transpose (the wgrad
operand), as a training step does. The script checks each pair gives the same bytes, scale
inverse and amax, then prints the median GPU time of each and the ratio. Default shape:
Llama-3-8B's MLP at seq 8192, batch 1. ``--sweep`` also times the fused delayed kernels' tiles
(``swiglu_cast.GPU_SWIGLU_TILE``, ``swiglu_backward_cast.GPU_SWIGLU_BWD_TILE``) and the current-
scaling amax pass's programs per SM (``swiglu_cast.GPU_SWIGLU_AMAX``), each configuration's
bytes checked against the default's. The "op alone" column is ``K.swiglu`` /
``K.swiglu_backward`` by itself: per element of the (tokens, ffn) grid the fused delayed kernels
move the bytes it moves (forward 4 read, 1 + 1 FP8 written vs 2 bf16; backward 6 read, 2 + 2 FP8
written vs 4 bf16), so it is the mark they can reach.

    python bench/bench_swiglu_cast.py [--tokens 8192] [--ffn 14336] [--sweep]
"""

from __future__ import annotations

import argparse
from collections.abc import Callable

import torch
from bench_linear import cuda_median_ms
from dist_quant.kernels import swiglu_backward_cast, swiglu_cast

import dist_quant as dq
from dist_quant import kernels as K

# (BM, BN, num_warps) of the delayed kernels' tiles, the default first; sm_90 registers per
# thread of each: bench/swiglu_cast_registers.py
SWEEP_FWD_TILES = [
    (64, 64, 16), (32, 128, 16), (32, 64, 8), (64, 32, 8), (16, 128, 8), (8, 256, 8),
    (32, 128, 8), (128, 128, 8),
]  # fmt: skip
SWEEP_BWD_TILES = [
    (32, 64, 16), (64, 32, 16), (16, 128, 16), (32, 128, 32), (16, 64, 8), (64, 64, 16),
    (32, 128, 8),
]  # fmt: skip


def _quantizers(fp8: torch.dtype) -> dict[str, tuple]:
    """Two equal quantizers per recipe (their amax slots are compared after one cast each)."""

    def delayed() -> dq.Float8Quantizer:
        return dq.Float8Quantizer(
            torch.full((1,), 0.5, device="cuda"), torch.zeros(1, device="cuda"), fp8
        )

    def current() -> dq.Float8CurrentScalingQuantizer:
        return dq.Float8CurrentScalingQuantizer(fp8)

    return {"delayed": (delayed(), delayed()), "current": (current(), current())}


def _same(got, want, q_got, q_want, delayed: bool) -> bool:
    same = all(
        torch.equal(a.view(torch.uint8), b.view(torch.uint8)) for a, b in zip(got[:2], want[:2])
    ) and torch.equal(got.scale_inv, want.scale_inv)
    return same and (not delayed or torch.equal(q_got.amax, q_want.amax))


def _pair(direction: str, h: torch.Tensor, dy: torch.Tensor) -> tuple[Callable, Callable]:
    """(unfused, fused) calls of one direction, each taking a quantizer."""
    if direction == "fwd":
        return (
            lambda q: q.cast(K.swiglu(h), transpose=True),
            lambda q: q.cast_swiglu(h, transpose=True),
        )
    return (
        lambda q: q.cast(K.swiglu_backward(dy, h), transpose=True),
        lambda q: q.cast_swiglu_backward(dy, h, transpose=True),
    )


def compare(h: torch.Tensor, dy: torch.Tensor) -> None:
    print(f"{'pass':>4} {'recipe':>8} | {'op alone us':>11} | {'unfused us':>10} | "
          f"{'fused us':>8} | {'speedup':>7} | same bits")  # fmt: skip
    for direction, fp8 in (("fwd", torch.float8_e4m3fn), ("bwd", torch.float8_e5m2)):
        unfused, fused = _pair(direction, h, dy)
        alone = (lambda: K.swiglu(h)) if direction == "fwd" else lambda: K.swiglu_backward(dy, h)
        alone_ms = cuda_median_ms(alone)
        for name, (q_unfused, q_fused) in _quantizers(fp8).items():
            same = _same(fused(q_fused), unfused(q_unfused), q_fused, q_unfused, name == "delayed")
            unfused_ms = cuda_median_ms(lambda q=q_unfused, f=unfused: f(q))
            fused_ms = cuda_median_ms(lambda q=q_fused, f=fused: f(q))
            print(
                f"{direction:>4} {name:>8} | {alone_ms * 1e3:>11.1f} | {unfused_ms * 1e3:>10.1f} | "
                f"{fused_ms * 1e3:>8.1f} | {unfused_ms / fused_ms:>6.2f}x | {same}"
            )


def _sweep(
    title: str, config: dict, candidates: list[dict], recipe: str, h: torch.Tensor,
    dy: torch.Tensor, directions: tuple = (("fwd", torch.float8_e4m3fn), ("bwd", torch.float8_e5m2)),
) -> None:  # fmt: skip
    """The fused ops of ``recipe`` under each candidate of ``config`` (a launcher's dict), bytes
    checked against the default's; the default is restored."""
    default = dict(config)
    print(f"\n# sweep {title} (default {default}), {recipe}, us")
    expected = {}
    for direction, fp8 in directions:
        q = _quantizers(fp8)[recipe][0]
        expected[direction] = [t.clone() for t in _pair(direction, h, dy)[1](q)[:2]]
    for candidate in candidates:
        config.update(candidate)
        row = []
        for direction, fp8 in directions:
            q = _quantizers(fp8)[recipe][0]
            fused = _pair(direction, h, dy)[1]
            same = all(torch.equal(a.view(torch.uint8), b.view(torch.uint8))
                       for a, b in zip(fused(q)[:2], expected[direction]))  # fmt: skip
            ms = cuda_median_ms(lambda q=q, f=fused: f(q))
            row.append(f"{direction} {ms * 1e3:7.1f}" + ("" if same else " BYTES DIFFER"))
        print(f"  {candidate}: " + " | ".join(row))
    config.update(default)


def sweep(h: torch.Tensor, dy: torch.Tensor) -> None:
    fwd_tiles, bwd_tiles = (
        [{"BM": m, "BN": n, "num_warps": w} for m, n, w in tiles]
        for tiles in (SWEEP_FWD_TILES, SWEEP_BWD_TILES)
    )
    fwd, bwd = (("fwd", torch.float8_e4m3fn),), (("bwd", torch.float8_e5m2),)
    _sweep("swiglu_cast.GPU_SWIGLU_TILE", swiglu_cast.GPU_SWIGLU_TILE, fwd_tiles, "delayed", h, dy,
           fwd)  # fmt: skip
    _sweep("swiglu_backward_cast.GPU_SWIGLU_BWD_TILE", swiglu_backward_cast.GPU_SWIGLU_BWD_TILE,
           bwd_tiles, "delayed", h, dy, bwd)  # fmt: skip
    programs = [{"PROGRAMS_PER_SM": p} for p in (4, 2, 8, 16)]
    _sweep("swiglu_cast.GPU_SWIGLU_AMAX", swiglu_cast.GPU_SWIGLU_AMAX, programs, "current", h, dy)


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--tokens", type=int, default=8192)
    p.add_argument("--ffn", type=int, default=14336)
    p.add_argument("--sweep", action="store_true", help="also sweep the fused tile configs")
    args = p.parse_args()
    print(f"GPU: {torch.cuda.get_device_name()}  torch {torch.__version__}")
    print(f"h: ({args.tokens}, 2 * {args.ffn}) bf16 -> fc2 input ({args.tokens}, {args.ffn}) E4M3;"
          f" dy: ({args.tokens}, {args.ffn}) bf16 -> fc1 grad output ({args.tokens}, "
          f"2 * {args.ffn}) E5M2")  # fmt: skip
    h = torch.randn(args.tokens, 2 * args.ffn, device="cuda", dtype=torch.bfloat16) * 3
    dy = torch.randn(args.tokens, args.ffn, device="cuda", dtype=torch.bfloat16) * 1e-3
    compare(h, dy)
    if args.sweep:
        sweep(h, dy)


if __name__ == "__main__":
    main()
