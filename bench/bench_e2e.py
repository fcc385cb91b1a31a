"""End to end: a stack of Llama-3 blocks, forward + backward, BF16 vs torchao vs Transformer Engine
vs dist-quant, one process per variant, one table.

The stacks (`--model`, see `e2e_models.py`): "8b" (Llama-3-8B layer dims, 2 layers) and "70b-tp8"
(one TP=8 rank of a Llama-3-70B layer, 4 layers), seq 8192, batch 1; `--layers`, `--seq`,
`--batch` and `--dims DIM,FFN,HEADS,KV_HEADS,HEAD_DIM` override them. Variants (`--variants`):

    bf16-compiled, bf16-eager                 torch blocks (nn.Linear, nn.RMSNorm, SDPA)
    torchao-tensorwise, torchao-rowwise       the blocks' Linears as torchao Float8Linear, compiled
    dq-{delayed,current,mxfp8,block}          the blocks' Linears swapped by dq.convert_model, compiled
    dq-{...}-eager                            the same, eager
    dq-layer-delayed[-fp8attn]                dq.TransformerLayer (num_gqa_groups), eager; with FP8 attention
                                              (the default path: docs/fp8_attention.md)
    dq-layer-delayed-fp8attn-{cudnn,triton}   the same on cuDNN's FP8 attention / the Triton kernels
    te-layer-delayed, te-linear-delayed       TE's TransformerLayer / te.Linear swapped in, eager
    te-layer-delayed-fp8dpa                   TE's TransformerLayer with its FP8 attention (fp8_dpa)

"compiled" is `torch.compile` of each block (torchtitan's way); every eager variant runs its
backward on the calling thread (`torch.autograd.set_multithreading_enabled(False)`, see
docs/performance.md), BF16 eager included. A variant whose package is not importable (torchao,
transformer_engine) is skipped with a note, as is one that fails (its error is the note).

Each variant runs in a fresh process (`--worker`, started by this script): nothing compiled,
cached or allocated by one variant helps or hurts another. Per variant: the median time of a
step (CUDA events around each of `--steps` back-to-back steps after `--warmup`; on the CPU wall
time), tokens/s, the first step's seconds (compilation included), peak memory (CUDA: max
allocated; CPU: the process's peak RSS) and the median host time to issue a step (no sync). The
table gives each variant's speed over BF16 compiled.

    python bench/bench_e2e.py --model 8b [--variants bf16-compiled,dq-delayed] [--json out.json]
    python bench/bench_e2e.py --device cpu --tiny     # tiny dims, every variant path, CPU
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import resource
import subprocess
import sys
import time
from collections.abc import Callable

import torch
from e2e_models import MODELS, TINY, VARIANTS, Dims, build, missing

BASELINE = "bf16-compiled"
RESULT_TAG = "E2E_RESULT "


def dims_from(args: argparse.Namespace) -> Dims:
    d = TINY if args.tiny else MODELS[args.model]
    if args.dims:
        dim, ffn, heads, kv_heads, head_dim = (int(v) for v in args.dims.split(","))
        d = dataclasses.replace(
            d, dim=dim, ffn=ffn, heads=heads, kv_heads=kv_heads, head_dim=head_dim
        )
    for field in ("layers", "seq", "batch"):
        if getattr(args, field) is not None:
            d = dataclasses.replace(d, **{field: getattr(args, field)})
    return d


# ---- one variant, in its own process ------------------------------------------------------------
def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def _peak_mib(device: str) -> float:
    if device == "cuda":
        return torch.cuda.max_memory_allocated() / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB


def measure(step, device: str, warmup: int, steps: int) -> dict:
    _sync(device)
    t0 = time.perf_counter()
    step()
    _sync(device)
    first_s = time.perf_counter() - t0
    for _ in range(warmup):
        step()
    _sync(device)
    if device == "cuda":
        events = []
        for _ in range(steps):
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record()
            step()
            e.record()
            events.append((s, e))
        torch.cuda.synchronize()
        step_ms = sorted(s.elapsed_time(e) for s, e in events)[steps // 2]
    host = []
    for _ in range(steps):  # issue only: the GPU runs behind (on the CPU this is the step)
        t0 = time.perf_counter()
        step()
        host.append((time.perf_counter() - t0) * 1e3)
    _sync(device)
    host_ms = sorted(host)[steps // 2]
    return {
        "ms_per_step": step_ms if device == "cuda" else host_ms,
        "host_ms_per_step": host_ms,
        "first_step_s": first_s,
    }


def variant_step(name: str, d: Dims, device: str, backend: str = "inductor") -> Callable[[], None]:
    """One forward + backward of variant `name` on fixed random input (a fresh model)."""
    built = build(name, d, device, backend)
    g = torch.Generator(device="cpu").manual_seed(1)
    shape = (d.seq, d.batch, d.dim) if built.sbhd else (d.batch, d.seq, d.dim)
    x = torch.randn(shape, generator=g).to(device, torch.bfloat16).requires_grad_(True)
    dy = torch.randn(shape, generator=g).to(device, torch.bfloat16)
    caller = not VARIANTS[name].compiled

    def step() -> None:
        x.grad = None
        for p in built.model.parameters():
            p.grad = None
        with built.context():
            y = built.model(x)
        with torch.autograd.set_multithreading_enabled(not caller):
            y.backward(dy)

    return step


def run_variant(name: str, d: Dims, device: str, backend: str, warmup: int, steps: int) -> dict:
    step = variant_step(name, d, device, backend)
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    out = measure(step, device, warmup, steps)
    out["tokens_per_s"] = d.batch * d.seq / (out["ms_per_step"] / 1e3)
    out["peak_mib"] = _peak_mib(device)
    return out


def worker(args: argparse.Namespace) -> None:
    d = dims_from(args)
    try:
        result = {"status": "ok", **run_variant(
            args.worker, d, args.device, args.compile_backend, args.warmup, args.steps
        )}  # fmt: skip
    except Exception as e:  # reported as the variant's note; the table goes on
        result = {"status": "failed", "note": f"{type(e).__name__}: {str(e)[:300]}"}
    print(RESULT_TAG + json.dumps(result), flush=True)


# ---- the driver ---------------------------------------------------------------------------------
def spawn(name: str, argv: list[str], device: str, timeout_s: float) -> dict:
    env = dict(os.environ) | dict(VARIANTS[name].env)
    if device == "cpu":
        env.setdefault("TRITON_INTERPRET", "1")  # no GPU: Triton kernels run in its interpreter
    cmd = [sys.executable, os.path.abspath(__file__), *argv, "--worker", name]
    try:
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return {"status": "failed", "note": f"timed out after {timeout_s:.0f} s"}
    for line in proc.stdout.splitlines():
        if line.startswith(RESULT_TAG):
            return json.loads(line[len(RESULT_TAG) :])
    tail = (proc.stderr or proc.stdout).strip().splitlines()[-1:] or ["no output"]
    return {"status": "failed", "note": f"exit {proc.returncode}: {tail[0][:300]}"}


def table(results: dict[str, dict]) -> str:
    base = results.get(BASELINE, {}).get("ms_per_step")
    lines = [
        f"| variant | ms/step | tokens/s | vs {BASELINE} | first step s | peak MiB | host ms/step "
        "| note |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name, r in results.items():
        if r["status"] != "ok":
            lines.append(f"| {name} | - | - | - | - | - | - | {r['status']}: {r['note']} |")
            continue
        ratio = f"{base / r['ms_per_step']:.2f}x" if base else "-"
        lines.append(
            f"| {name} | {r['ms_per_step']:.2f} | {r['tokens_per_s']:.0f} | {ratio} | "
            f"{r['first_step_s']:.1f} | {r['peak_mib']:.0f} | {r['host_ms_per_step']:.2f} | |"
        )
    return "\n".join(lines)


def add_dims_arguments(p: argparse.ArgumentParser) -> None:
    """The model options `dims_from` reads (shared with profile_e2e.py and gaps_e2e.py)."""
    p.add_argument("--model", choices=sorted(MODELS), default="8b")
    p.add_argument("--tiny", action="store_true", help="tiny dims (a smoke run), 2 steps")
    p.add_argument("--dims", help="DIM,FFN,HEADS,KV_HEADS,HEAD_DIM")
    p.add_argument("--layers", type=int)
    p.add_argument("--seq", type=int)
    p.add_argument("--batch", type=int)


def parse(argv: list[str] | None = None) -> tuple[argparse.ArgumentParser, argparse.Namespace]:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add_dims_arguments(p)
    p.add_argument("--variants", default=",".join(VARIANTS))
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    p.add_argument("--compile-backend", default="inductor", help="torch.compile backend")
    p.add_argument("--warmup", type=int)
    p.add_argument("--steps", type=int)
    p.add_argument("--timeout", type=float, default=900.0, help="seconds per variant")
    p.add_argument("--json", help="also write the results to this file")
    p.add_argument("--worker", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    args.warmup = args.warmup if args.warmup is not None else (0 if args.tiny else 3)
    args.steps = args.steps if args.steps is not None else (2 if args.tiny else 10)
    return p, args


def main(argv: list[str] | None = None) -> None:
    p, args = parse(argv)
    if args.worker:
        worker(args)
        return
    names = args.variants.split(",")
    unknown = [n for n in names if n not in VARIANTS]
    if unknown:
        p.error(f"unknown variants {unknown}; known: {', '.join(VARIANTS)}")
    if args.device == "cuda" and not torch.cuda.is_available():
        p.error("no CUDA device: run with --device cpu (and --tiny)")
    d = dims_from(args)
    given = sys.argv[1:] if argv is None else argv
    forwarded = _without(given, ("--variants", "--json", "--timeout"))
    gpu = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
    print(f"{datetime.date.today()}  {gpu}  torch {torch.__version__}  ({d.describe()})")
    results: dict[str, dict] = {}
    for name in names:
        why = missing(VARIANTS[name])
        results[name] = (
            {"status": "skipped", "note": why}
            if why
            else spawn(name, forwarded, args.device, args.timeout)
        )
        print(
            f"  {name}: {results[name].get('ms_per_step', results[name].get('note'))}", flush=True
        )
    print(table(results))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {
                    "date": str(datetime.date.today()),
                    "device": gpu,
                    "torch": torch.__version__,
                    "dims": dataclasses.asdict(d),
                    "compile_backend": args.compile_backend,
                    "warmup": args.warmup,
                    "steps": args.steps,
                    "baseline": BASELINE,
                    "results": results,
                },
                f,
                indent=1,
            )


def _without(argv: list[str], options: tuple[str, ...]) -> list[str]:
    """`argv` less the driver-only options (and their values), for the workers."""
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
            continue
        if a in options:
            skip = True
            continue
        if a.split("=", 1)[0] in options:
            continue
        out.append(a)
    return out


if __name__ == "__main__":
    main()
