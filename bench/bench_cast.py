"""FP8 cast benchmark: Triton kernels vs eager torch vs torch.compile of the reference math.

For each size (bf16 elements; default 64M and 256M) and each operation, one run measures the
Triton kernel (through the ``dist_quant.kernels`` dispatcher), the reference functions run eagerly
on the GPU, and ``torch.compile`` of the same reference functions, plus a device-to-device copy of
the same bf16 tensor as the bandwidth ceiling. Times are medians of ``triton.testing.do_bench``.

Bandwidth counts the bytes an operation must move: every input read once and every output written
once, except the current-scaling casts, which read ``x`` twice (the amax must be complete before
the first element is cast), and say so in their name.

    python bench/bench_cast.py                  # the table
    python bench/bench_cast.py --sweep          # also sweep the Triton launch configurations
    python bench/bench_cast.py --sizes 64 --json out.json
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys
from collections.abc import Callable
from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from dist_quant.kernels import block, cast, current, mxfp8
from dist_quant.kernels import reference as ref
from triton.testing import do_bench

from dist_quant import kernels as K

# the kernels package exports a `dequantize` function, which hides the submodule's attribute
dequantize = importlib.import_module("dist_quant.kernels.dequantize")
E4M3 = torch.float8_e4m3fn
M = 1 << 20


def _ms(fn: Callable[[], object]) -> float:
    return do_bench(fn, warmup=10, rep=60, return_mode="median")


@dataclass
class Case:
    name: str
    bytes_moved: int
    triton: Callable[[], object]
    eager: Callable[[], object]
    compiled: Callable[[], object] | None


def _compiled(fn: Callable, *args) -> Callable[[], object]:
    c = torch.compile(fn, dynamic=False)
    return lambda: c(*args)


def _try_ms(fn: Callable[[], object] | None, what: str) -> float:
    """Median ms, or NaN (with the reason printed) when the variant fails, e.g. cannot compile."""
    if fn is None:
        return float("nan")
    try:
        return _ms(fn)
    except Exception as exc:  # a failed baseline must not end the whole run
        print(f"  ({what} failed: {type(exc).__name__}: {str(exc).splitlines()[0][:120]})")
        return float("nan")


def _delayed_cast_ref(x, scale, slot):
    q = ref.cast_to_fp8(x, scale, E4M3)
    slot.copy_(torch.maximum(slot, ref.amax(x)))
    return q


def _delayed_cast_t_ref(x, scale, slot):
    q, q_t = ref.cast_transpose(x, scale, E4M3)
    slot.copy_(torch.maximum(slot, ref.amax(x)))
    return q, q_t


def _current_ref(x, transpose: bool):
    a = ref.amax(x)
    scale, scale_inv = ref.current_scale(a, E4M3)
    if transpose:
        return ref.cast_transpose(x, scale, E4M3), scale_inv
    return ref.cast_to_fp8(x, scale, E4M3), scale_inv


def _update_ref(groups):
    for h, s, lim, margin, algo in groups:
        ref.delayed_scaling_update(h, s, lim, margin=margin, algo=algo)


def build_cases(n: int, with_compile: bool) -> list[Case]:
    cols = 8192
    x = torch.randn(n // cols, cols, device="cuda", dtype=torch.bfloat16)
    scale = torch.tensor([0.5], device="cuda")
    slot = torch.zeros(1, device="cuda")
    q = ref.cast_to_fp8(x, scale, E4M3)
    q_mx, e_mx = K.mxfp8_cast(x, E4M3)
    q_b, s_b = K.block_cast(x, E4M3, block_dim=1)
    cc = (lambda fn, *a: _compiled(fn, *a)) if with_compile else (lambda fn, *a: None)
    cases = [
        Case("amax", 2 * n, lambda: K.amax(x), lambda: ref.amax(x), cc(ref.amax, x)),
        Case(
            "delayed cast + amax",
            3 * n,
            lambda: K.cast_to_fp8_with_amax(x, scale, E4M3, slot),
            lambda: _delayed_cast_ref(x, scale, slot),
            cc(_delayed_cast_ref, x, scale, slot),
        ),
        Case(
            "delayed cast + transpose + amax",
            4 * n,
            lambda: K.cast_transpose_with_amax(x, scale, E4M3, slot),
            lambda: _delayed_cast_t_ref(x, scale, slot),
            cc(_delayed_cast_t_ref, x, scale, slot),
        ),
        Case(
            "current cast (reads x twice)",
            5 * n,
            lambda: K.current_scaling_cast(x, E4M3),
            lambda: _current_ref(x, False),
            cc(_current_ref, x, False),
        ),
        Case(
            "current cast + transpose (reads x twice)",
            6 * n,
            lambda: K.current_scaling_cast(x, E4M3, transpose=True),
            lambda: _current_ref(x, True),
            cc(_current_ref, x, True),
        ),
        Case(
            "mxfp8 rowwise",
            3 * n + n // 32,
            lambda: K.mxfp8_cast(x, E4M3),
            lambda: ref.mxfp8_cast(x, E4M3),
            cc(ref.mxfp8_cast, x, E4M3),
        ),
        Case(
            "mxfp8 columnwise",
            3 * n + n // 32,
            lambda: K.mxfp8_cast(x, E4M3, columnwise=True),
            lambda: ref.mxfp8_cast(x, E4M3, columnwise=True),
            cc(lambda t: ref.mxfp8_cast(t, E4M3, columnwise=True), x),
        ),
        Case(
            "block 1x128",
            3 * n + n // 32,
            lambda: K.block_cast(x, E4M3, block_dim=1),
            lambda: ref.block_cast(x, E4M3, block_dim=1),
            cc(lambda t: ref.block_cast(t, E4M3, block_dim=1), x),
        ),
        Case(
            "block 128x128",
            3 * n,
            lambda: K.block_cast(x, E4M3, block_dim=2),
            lambda: ref.block_cast(x, E4M3, block_dim=2),
            cc(lambda t: ref.block_cast(t, E4M3, block_dim=2), x),
        ),
        Case(
            "dequantize per-tensor -> bf16",
            3 * n,
            lambda: K.dequantize(q, scale, torch.bfloat16),
            lambda: ref.dequantize(q, scale, torch.bfloat16),
            cc(lambda a, b: ref.dequantize(a, b, torch.bfloat16), q, scale),
        ),
        Case(
            "mxfp8 dequantize -> bf16",
            3 * n + n // 32,
            lambda: K.mxfp8_dequantize(q_mx, e_mx, dtype=torch.bfloat16),
            lambda: ref.mxfp8_dequantize(q_mx, e_mx, dtype=torch.bfloat16),
            cc(lambda a, b: ref.mxfp8_dequantize(a, b, dtype=torch.bfloat16), q_mx, e_mx),
        ),
        Case(
            "block 1x128 dequantize -> bf16",
            3 * n + n // 32,
            lambda: K.block_dequantize(q_b, s_b, block_dim=1, dtype=torch.bfloat16),
            lambda: ref.block_dequantize(q_b, s_b, block_dim=1, dtype=torch.bfloat16),
            cc(
                lambda a, b: ref.block_dequantize(a, b, block_dim=1, dtype=torch.bfloat16), q_b, s_b
            ),
        ),
    ]
    return cases


def update_case() -> Case:
    """100 modules x 2 directions, 3 slots, 1024-step history: one launch vs a loop."""
    groups = [
        (torch.rand(1024, 3, device="cuda"), torch.ones(3, device="cuda"), 448.0, 0, "max")
        for _ in range(200)
    ]
    nbytes = sum(2 * h.numel() * 4 + 2 * s.numel() * 4 for h, s, *_ in groups)
    return Case(
        "delayed update, 200 groups x (1024, 3)",
        nbytes,
        lambda: K.delayed_scaling_update_groups(groups),
        lambda: _update_ref(groups),
        None,
    )


def copy_ms(n: int) -> float:
    src = torch.randn(n, device="cuda", dtype=torch.bfloat16)
    dst = torch.empty_like(src)
    return _ms(lambda: dst.copy_(src))


def run_table(sizes: list[int], with_compile: bool) -> list[dict]:
    rows = []
    for n in sizes:
        copy = copy_ms(n)
        copy_bw = 4 * n / copy / 1e6  # ms -> GB/s
        print(f"\n## {n // M}M bf16 elements: device copy {copy * 1e3:.1f} us = {copy_bw:.0f} GB/s")
        print(
            f"{'operation':44s} {'triton us':>10s} {'eager us':>10s} {'compile us':>10s} "
            f"{'vs eager':>9s} {'vs compile':>10s} {'GB/s':>7s} {'% copy':>7s}"
        )
        cases = build_cases(n, with_compile) + ([update_case()] if n == sizes[0] else [])
        for case in cases:
            t = _ms(case.triton)
            e = _try_ms(case.eager, f"{case.name} eager")
            c = _try_ms(case.compiled, f"{case.name} torch.compile")
            bw = case.bytes_moved / t / 1e6
            print(
                f"{case.name:44s} {t * 1e3:10.1f} {e * 1e3:10.1f} {c * 1e3:10.1f} "
                f"{e / t:8.2f}x {c / t:9.2f}x {bw:7.0f} {100 * bw / copy_bw:6.0f}%",
                flush=True,
            )
            rows.append(
                dict(n=n, op=case.name, triton_us=t * 1e3, eager_us=e * 1e3, compile_us=c * 1e3,
                     gbps=bw, copy_gbps=copy_bw)
            )  # fmt: skip
            torch._dynamo.reset()
    return rows


@triton.jit
def _probe_bytes_kernel(x_ptr, q_ptr, n, BLOCK: tl.constexpr):
    """Data movement of a per-tensor cast without any rounding: bf16 in, its high byte out."""
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    x = tl.load(x_ptr + offs, mask=mask, other=0.0)
    tl.store(q_ptr + offs, (x.to(tl.int16, bitcast=True) >> 8).to(tl.uint8), mask=mask)


@triton.jit
def _probe_hw_cast_kernel(x_ptr, q_ptr, scale_ptr, acc_ptr, n, BLOCK: tl.constexpr):
    """Saturating cast through the GPU's FP8 conversion instruction, plus the amax atomic."""
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    v = tl.minimum(tl.maximum(x * tl.load(scale_ptr), -448.0), 448.0)
    tl.store(q_ptr + offs, v.to(tl.float8e4nv), mask=mask)
    bits = x.to(tl.int32, bitcast=True) & 0x7FFFFFFF
    tl.atomic_max(acc_ptr, tl.max(bits, axis=0), sem="relaxed")


@triton.jit
def _probe_transpose_kernel(x_ptr, q_ptr, qt_ptr, rows, cols, BM: tl.constexpr, BN: tl.constexpr):
    """Data movement of cast+transpose without rounding: high bytes to q and to q^T."""
    pid = tl.program_id(0)
    n_col_tiles = tl.cdiv(cols, BN)
    r = ((pid // n_col_tiles) * BM + tl.arange(0, BM)).to(tl.int64)
    c = ((pid % n_col_tiles) * BN + tl.arange(0, BN)).to(tl.int64)
    mask = (r < rows)[:, None] & (c < cols)[None, :]
    x = tl.load(x_ptr + r[:, None] * cols + c[None, :], mask=mask, other=0.0)
    b = (x.to(tl.int16, bitcast=True) >> 8).to(tl.uint8)
    tl.store(q_ptr + r[:, None] * cols + c[None, :], b, mask=mask)
    tl.store(qt_ptr + c[None, :] * rows + r[:, None], b, mask=mask)


def _probe_cases(n: int) -> dict[str, tuple[int, Callable[[], object]]]:
    x = torch.randn(n // 8192, 8192, device="cuda", dtype=torch.bfloat16)
    q8 = torch.empty(x.shape, device="cuda", dtype=torch.uint8)
    qf = torch.empty(x.shape, device="cuda", dtype=E4M3)
    qt = torch.empty(x.shape[::-1], device="cuda", dtype=torch.uint8)
    scale, acc = torch.tensor([0.5], device="cuda"), torch.zeros(1, device="cuda")
    cfg, tile = dict(cast.GPU_FLAT), dict(cast.GPU_TILE)
    grid = (triton.cdiv(n, cfg["BLOCK"]),)
    t_grid = (triton.cdiv(x.shape[0], tile["BM"]) * triton.cdiv(x.shape[1], tile["BN"]),)
    return {
        "probe: bytes only, 3 B/elem": (
            3 * n, lambda: _probe_bytes_kernel[grid](x, q8, n, **cfg)),
        "probe: hardware FP8 cvt + amax, 3 B/elem": (
            3 * n, lambda: _probe_hw_cast_kernel[grid](x, qf, scale, acc, n, **cfg)),
        "probe: transpose bytes only, 4 B/elem": (
            4 * n, lambda: _probe_transpose_kernel[t_grid](x, q8, qt, *x.shape, **tile)),
        "triton delayed cast + amax (exact)": (
            3 * n, lambda: K.cast_to_fp8_with_amax(x, scale, E4M3, acc)),
        "triton delayed cast + transpose + amax (exact)": (
            4 * n, lambda: K.cast_transpose_with_amax(x, scale, E4M3, acc)),
    }  # fmt: skip


def run_probes(sizes: list[int]) -> list[dict]:
    """What the per-tensor casts cost without exact FP8 rounding, in the same run as the copy."""
    rows = []
    for n in sizes:
        copy_bw = 4 * n / copy_ms(n) / 1e6
        print(f"\n## probes, {n // M}M bf16 elements (copy {copy_bw:.0f} GB/s)")
        for name, (nbytes, fn) in _probe_cases(n).items():
            t = _ms(fn)
            bw = nbytes / t / 1e6
            print(f"{name:48s} {t * 1e3:8.1f} us {bw:7.0f} GB/s {100 * bw / copy_bw:5.0f}% copy")
            rows.append(dict(n=n, op=name, triton_us=t * 1e3, gbps=bw, copy_gbps=copy_bw))
    return rows


_SWEEPS = {
    # (module, config dict name, candidate configs, operation measured)
    "cast flat": (cast, "GPU_FLAT", [
        {"BLOCK": b, "num_warps": w} for b in (4096, 8192, 16384) for w in (4, 8, 16)]),
    "cast tile": (cast, "GPU_TILE", [
        {"BM": m, "BN": n, "num_warps": w}
        for m, n, w in ((64, 64, 4), (64, 128, 4), (128, 64, 4), (128, 128, 8), (32, 128, 4),
                        (128, 32, 4), (64, 64, 8), (64, 128, 8), (128, 64, 8), (64, 256, 8))]),
    "amax": (current, "GPU_AMAX", [
        {"BLOCK": b, "num_warps": w, "PROGRAMS_PER_SM": p}
        for b, w, p in ((4096, 8, 4), (8192, 8, 4), (4096, 4, 8), (8192, 8, 2), (16384, 8, 2),
                        (4096, 8, 8), (2048, 4, 8))]),
    "mxfp8 rowwise": (mxfp8, "GPU_ROWWISE", [
        {"BM": m, "NB": b, "num_warps": w}
        for m, b, w in ((32, 4, 4), (64, 4, 8), (16, 8, 4), (32, 8, 8), (64, 2, 4), (128, 2, 8))]),
    "mxfp8 columnwise": (mxfp8, "GPU_COLUMNWISE", [
        {"NB": b, "BN": n, "num_warps": w}
        for b, n, w in ((2, 64, 4), (4, 64, 8), (2, 128, 8), (1, 128, 4), (4, 32, 4),
                        (4, 128, 8))]),
    "block 1x128": (block, "GPU_1X128", [
        {"BM": m, "NB": b, "num_warps": w}
        for m, b, w in ((16, 2, 4), (32, 1, 4), (8, 4, 4), (32, 2, 8), (64, 1, 8))]),
    "block 128x128": (block, "GPU_128X128", [
        {"NB": b, "num_warps": w} for b, w in ((1, 8), (1, 4), (2, 8), (1, 16))]),
    "dequantize flat": (dequantize, "GPU_FLAT", [
        {"BLOCK": b, "num_warps": w} for b, w in ((8192, 8), (4096, 4), (16384, 8), (8192, 4))]),
    "dequantize grouped": (dequantize, "GPU_GROUPED", [
        {"BM": m, "num_warps": w} for m, w in ((32, 4), (64, 8), (16, 4), (32, 8))]),
}  # fmt: skip


def _sweep_op(name: str, x: torch.Tensor) -> Callable[[], object]:
    scale, slot = torch.tensor([0.5], device="cuda"), torch.zeros(1, device="cuda")
    q = ref.cast_to_fp8(x, scale, E4M3)
    q_mx, e_mx = K.mxfp8_cast(x, E4M3)
    return {
        "cast flat": lambda: K.cast_to_fp8_with_amax(x, scale, E4M3, slot),
        "cast tile": lambda: K.cast_transpose_with_amax(x, scale, E4M3, slot),
        "amax": lambda: K.amax(x),
        "mxfp8 rowwise": lambda: K.mxfp8_cast(x, E4M3),
        "mxfp8 columnwise": lambda: K.mxfp8_cast(x, E4M3, columnwise=True),
        "block 1x128": lambda: K.block_cast(x, E4M3, block_dim=1),
        "block 128x128": lambda: K.block_cast(x, E4M3, block_dim=2),
        "dequantize flat": lambda: K.dequantize(q, scale, torch.bfloat16),
        "dequantize grouped": lambda: K.mxfp8_dequantize(q_mx, e_mx, dtype=torch.bfloat16),
    }[name]


def _as_bytes(out: object) -> list[torch.Tensor]:
    """Every tensor in an op's output, as raw bytes (to compare configurations bit for bit)."""
    if isinstance(out, torch.Tensor):
        return [out.reshape(-1).contiguous().view(torch.uint8)]
    if isinstance(out, (tuple, list)):
        return [b for o in out for b in _as_bytes(o)]
    return []


def run_sweep(sizes: list[int]) -> dict:
    """Median us per configuration and size; every configuration's output must equal the default
    configuration's bytes. The launchers' defaults are restored afterwards."""
    results = {}
    xs = {n: torch.randn(n // 8192, 8192, device="cuda", dtype=torch.bfloat16) for n in sizes}
    for name, (module, attr, configs) in _SWEEPS.items():
        default = dict(getattr(module, attr))
        print(f"\n# sweep {name} ({module.__name__}.{attr}, default {default})")
        results[name] = []
        expected = _as_bytes(_sweep_op(name, xs[sizes[0]])())
        for cfg in configs:
            getattr(module, attr).clear()
            getattr(module, attr).update(cfg)
            got = _as_bytes(_sweep_op(name, xs[sizes[0]])())
            same = all(torch.equal(a, b) for a, b in zip(got, expected))
            times = [_ms(_sweep_op(name, xs[n])) * 1e3 for n in sizes]
            results[name].append((cfg, times, same))
            print(
                f"  {cfg}: "
                + ", ".join(f"{n // M}M {t:.1f} us" for n, t in zip(sizes, times))
                + ("" if same else "  OUTPUT DIFFERS FROM DEFAULT CONFIG")
            )
        getattr(module, attr).clear()
        getattr(module, attr).update(default)
    for flag in (True, False):
        cast.GPU_REVERSE_AFTER_AMAX = flag
        times = [
            _ms(lambda x=xs[n]: K.current_scaling_cast(x, E4M3, transpose=True)) * 1e3
            for n in sizes
        ]
        print(
            f"# current cast+transpose, reverse={flag}: " + ", ".join(f"{t:.1f} us" for t in times)
        )
    cast.GPU_REVERSE_AFTER_AMAX = True
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="64,256", help="millions of bf16 elements")
    parser.add_argument("--sweep", action="store_true", help="sweep launch configurations")
    parser.add_argument("--no-compile", action="store_true", help="skip torch.compile columns")
    parser.add_argument("--probes", action="store_true", help="data-movement-only probe kernels")
    parser.add_argument("--json", help="write the measurements here")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_cast: needs a CUDA device", file=sys.stderr)
        return 2
    sizes = [int(s) * M for s in args.sizes.split(",")]
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}")
    out = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
           "triton": triton.__version__}  # fmt: skip
    torch._dynamo.config.cache_size_limit = 64
    if args.probes:
        out["probes"] = run_probes(sizes)
    if args.sweep:
        out["sweep"] = run_sweep(sizes)
    out["table"] = run_table(sizes, with_compile=not args.no_compile)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1, default=str)
    return 0


if __name__ == "__main__":
    sys.exit(main())
