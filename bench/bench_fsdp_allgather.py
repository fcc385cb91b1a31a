"""FSDP2 weight all-gather: FP8 (`dist_quant.fsdp.enable_fp8_all_gather`) vs BF16, on one GPU.

A stack of dq `LayerNormMLP` + `Linear` blocks (Llama-ish shapes) is sharded with `fully_shard` over
a 1-rank NCCL group, once with BF16 parameters (`MixedPrecisionPolicy(param_dtype=bfloat16)`,
FSDP2's usual high-precision all-gather) and once with FP8 all-gather. For each it reports the bytes
of the gathered parameters (what the all-gather moves), the median time of one NCCL all-gather of
that many bytes, and the median time of `unshard()` + `reshard()`
of every block under `dq.autocast`: for FP8 that is the shard's cast + uint8 pack, the all-gather
and the unpack; with one rank the collective itself is a local copy, so the time is mostly the
cast + pack path (multi-GPU bandwidth is a later run). Also `precompute_fp8_weight_scales` (current
scaling: the amaxes of every weight, one all-reduce). Needs CUDA.

    python bench/bench_fsdp_allgather.py
    python bench/bench_fsdp_allgather.py --hidden 8192 --ffn 28672 --blocks 4 --recipe delayed
"""

from __future__ import annotations

import argparse
import os
import statistics

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

import dist_quant as dq
from dist_quant.fsdp import enable_fp8_all_gather, precompute_fp8_weight_scales
from dist_quant.fsdp_tensor import GatheredFloat8Weight

RECIPES = {"current": dq.Float8CurrentScaling, "delayed": dq.DelayedScaling}


class Blocks(nn.Module):
    def __init__(self, hidden: int, ffn: int, blocks: int) -> None:
        super().__init__()
        self.layers = nn.ModuleList(
            nn.Sequential(
                dq.Linear(hidden, 3 * hidden, bias=False),
                dq.LayerNormMLP(hidden, ffn, bias=False, activation="swiglu"),
            )
            for _ in range(blocks)
        )


def gathered_bytes(model: Blocks) -> int:
    """Bytes of every block's unsharded parameters as FSDP2 gathered them (the FP8 weights count
    their bytes, not their high-precision dtype): what an all-gather over N ranks moves, times
    (N - 1) / N."""
    total = 0
    with dq.autocast():
        for layer in model.layers:
            layer.unshard()
            for p in layer.parameters():
                t = p.float8_tensor().data if isinstance(p, GatheredFloat8Weight) else p
                total += t.numel() * t.element_size()
            layer.reshard()
    return total


def time_collective(nbytes: int, dtype: torch.dtype, iters: int) -> float:
    """Median ms of one all_gather_into_tensor of `nbytes` in `dtype` (1 rank: a local copy)."""
    n = nbytes // torch.empty((), dtype=dtype).element_size()
    src = torch.empty(n, dtype=dtype, device="cuda")
    dst = torch.empty_like(src)
    times = []
    for i in range(iters + 3):
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dist.all_gather_into_tensor(dst, src)
        stop.record()
        torch.cuda.synchronize()
        if i >= 3:
            times.append(start.elapsed_time(stop))
    return statistics.median(times)


def build(args, fp8: bool) -> Blocks:
    torch.manual_seed(0)
    model = Blocks(args.hidden, args.ffn, args.blocks).cuda()
    dq.apply_recipe(model, RECIPES[args.recipe]())
    if fp8:
        enable_fp8_all_gather(model)
    # BF16 parameters for the baseline's all-gather; the FP8 path casts the shard to BF16 first too
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16)
    for layer in model.layers:
        fully_shard(layer, mp_policy=policy)
    fully_shard(model, mp_policy=policy)
    return model


def time_unshard(model: Blocks, iters: int) -> float:
    """Median ms of unshard + reshard of every block under autocast. With one rank FSDP2 skips the
    collective and builds the unsharded parameters from `fsdp_pre_all_gather`'s output directly,
    so this is the cast + pack (FP8) or the BF16 cast (baseline) and the unpack."""
    times = []
    with dq.autocast():
        for i in range(iters + 3):
            start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for layer in model.layers:
                layer.unshard()
                layer.reshard()
            stop.record()
            torch.cuda.synchronize()
            if i >= 3:  # warm-up: the first all-gathers allocate and plan
                times.append(start.elapsed_time(stop))
    return statistics.median(times)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--hidden", type=int, default=4096)
    p.add_argument("--ffn", type=int, default=14336)
    p.add_argument("--blocks", type=int, default=4)
    p.add_argument("--recipe", choices=sorted(RECIPES), default="current")
    p.add_argument("--iters", type=int, default=20)
    args = p.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_fsdp_allgather needs CUDA")
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29517")
    torch.cuda.set_device(0)
    dist.init_process_group("nccl", rank=0, world_size=1)
    try:
        rows = []
        for fp8 in (False, True):
            model = build(args, fp8)
            ms, nbytes = time_unshard(model, args.iters), gathered_bytes(model)
            dtype = torch.uint8 if fp8 else torch.bfloat16
            rows.append(
                ("fp8" if fp8 else "bf16", ms, nbytes, time_collective(nbytes, dtype, args.iters))
            )
            if fp8 and args.recipe == "current":
                start, stop = (
                    torch.cuda.Event(enable_timing=True),
                    torch.cuda.Event(enable_timing=True),
                )
                precompute_fp8_weight_scales(model)
                start.record()
                for _ in range(args.iters):
                    precompute_fp8_weight_scales(model)
                stop.record()
                torch.cuda.synchronize()
                pre_ms = start.elapsed_time(stop) / args.iters
            del model
            torch.cuda.empty_cache()
        print(
            f"{args.blocks} blocks, hidden {args.hidden}, ffn {args.ffn}, recipe {args.recipe}, "
            f"{torch.cuda.get_device_name()}"
        )
        print(
            f"{'all-gather':<12}{'bytes':>16}{'unshard+reshard ms':>22}{'1-rank collective ms':>24}"
        )
        for name, ms, nbytes, coll_ms in rows:
            print(f"{name:<12}{nbytes:>16,}{ms:>22.3f}{coll_ms:>24.3f}")
        print(f"bytes fp8 / bf16 = {rows[1][2] / rows[0][2]:.3f}")
        if args.recipe == "current":
            print(f"precompute_fp8_weight_scales: {pre_ms:.3f} ms")
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
