"""Where an NVFP4 `Linear` step on CUDA first leaves the CPU step's bits (issue 33, the "plain"
recipe of tests/test_nvfp4_gpu.py).

Runs the test's step (Linear(96, 48, bias=False), 64 tokens, two steps) on the CPU and on the
GPU with the same recipe, recording every NVFP4 stage the quantizer and the GEMM go through, in
call order: each amax (its input and result), each cast (its input, amax, options, then S_dec,
the E4M3 block scales and the packed E2M1 bytes), each Hadamard transform, each `nvfp4_gemm`
(both operands and its output), then y, dx and dw. Stages are paired by call order and compared
bit for bit; the first stage that differs is printed with where (indices, both values). Every GPU
cast and GEMM is also recomputed by the CPU reference on the GPU's own inputs, which separates
"the kernel computes something else" from "it was fed something else".

What it found (H200, torch 2.11, 2026-12-04): every amax, cast and `nvfp4_gemm` of that recipe
matched, and the weight gradient's GEMM never reached `nvfp4_gemm`: with `input_rht=False` and
`grad_output_rht` on, its operands' transforms differed, so `gemm` dequantized both (the
transform undone by a 16x16 matmul) and ran torch's fp32 matmul, whose accumulation order is the
device's (3904 of 4608 dw elements differed). `nvfp4_gemm` now takes such a pair itself (the
untransformed operand's E2M1 values transformed exactly), and the step matches.

    python bench/diag_nvfp4_plain.py                 # input_rht off, grad_output_rht on
    python bench/diag_nvfp4_plain.py --recipe plain  # no transform, no SR, 1x16 weights
    python bench/diag_nvfp4_plain.py --recipe plain --tokens 64 --in-features 96 --out-features 48
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import types
from collections.abc import Callable
from typing import Any

import torch
from dist_quant.kernels import reference_nvfp4 as ref

import dist_quant as dq
import dist_quant.gemm as dq_gemm
import dist_quant.modules.functional as dq_functional
import dist_quant.nvfp4 as dq_nvfp4
from dist_quant import kernels as K
from dist_quant.kinds import OperandLayout
from dist_quant.tensor import GemmOperand

RECIPES = {
    # what tests/test_nvfp4_gpu.py called "plain" while it was an open xfail: the input's wgrad
    # copy untransformed, the output gradient's transformed (grad_output_rht stays on)
    "one-side-rht": dq.NVFP4BlockScaling(
        input_rht=False, stochastic_rounding=False, weight_2d=False
    ),
    "plain": dq.NVFP4BlockScaling(
        input_rht=False, grad_output_rht=False, stochastic_rounding=False, weight_2d=False
    ),
    "default": dq.NVFP4BlockScaling(),
}


def _cpu(t: Any) -> Any:
    if isinstance(t, torch.Tensor):
        t = t.detach().cpu()
        return t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t
    if isinstance(t, (tuple, list)):
        return type(t)(_cpu(v) for v in t)
    return t


class Recorder:
    """Wraps the kernel entry points the NVFP4 quantizer and the GEMM call, recording stages."""

    def __init__(self) -> None:
        self.stages: list[tuple[str, dict[str, Any]]] = []

    def wrap_kernels(self) -> types.SimpleNamespace:
        def amax(x: torch.Tensor) -> torch.Tensor:
            out = K.amax(x)
            self.stages.append(("amax", {"in": _cpu(x), "amax": _cpu(out)}))
            return out

        def rht(x: torch.Tensor, *args: Any) -> torch.Tensor:
            out = K.random_hadamard_transform(x, *args)
            self.stages.append(("rht", {"in": _cpu(x), "out": _cpu(out)}))
            return out

        def cast(x: torch.Tensor, amax: torch.Tensor, **opts: Any) -> Any:
            out = K.nvfp4_cast(x, amax, **opts)
            rec = {"in": _cpu(x), "amax_in": _cpu(amax), "opts": dict(opts)}
            rec.update(s_dec=_cpu(out.s_dec), scales=_cpu(out.scales), data=_cpu(out.data))
            self.stages.append(("cast", rec))
            return out

        ns = types.SimpleNamespace(**{n: getattr(K, n) for n in dir(K) if not n.startswith("__")})
        ns.amax, ns.random_hadamard_transform, ns.nvfp4_cast = amax, rht, cast
        return ns

    def wrap_gemm(self, fn: Callable) -> Callable:
        def gemm(a: Any, b: Any, **kw: Any) -> torch.Tensor:
            out = fn(a, b, **kw)
            self.stages.append(
                ("gemm", {"a": _cpu(tuple(a)), "b": _cpu(tuple(b)), "out": _cpu(out)})
            )
            return out

        return gemm

    def wrap_linear_gemm(self, fn: Callable) -> Callable:
        """The module's GEMM call: which route its operands take, what each dequantizes to (the
        transform undone) and the result, so a GEMM that never reaches `nvfp4_gemm` shows."""

        def gemm(a: Any, b: Any, **kw: Any) -> torch.Tensor:
            out = fn(a, b, **kw)
            ops = [v for v in (a, b) if isinstance(v, GemmOperand)]
            rhts = tuple(v.rht for v in ops)
            nvfp4 = len(ops) == 2 and all(v.scaling is OperandLayout.NVFP4 for v in ops)
            route = "nvfp4_gemm" if nvfp4 else "dequantize+matmul"
            rec = {"route": f"{route} (rht {rhts})", "a": _operand(a), "b": _operand(b)}
            rec["a_hp"], rec["b_hp"] = _dequantized(a), _dequantized(b)
            rec["out"], rec["kw"] = _cpu(out), kw
            self.stages.append(("linear gemm", rec))
            return out

        return gemm


def _operand(v: Any) -> Any:
    if isinstance(v, GemmOperand):
        return dataclasses.replace(
            v, data=_cpu(v.data), scale_inv=v.scale_inv.detach().cpu(), amax=_cpu(v.amax)
        )
    return _cpu(v)


def _dequantized(v: Any) -> torch.Tensor:
    return _cpu(v.dequantize(torch.float32) if isinstance(v, GemmOperand) else v.float())


def run_step(device: str, recipe: Any, m0: torch.nn.Module, x: torch.Tensor, dy: torch.Tensor):
    rec = Recorder()
    saved = dq_nvfp4.fp8_kernels, dq_gemm.nvfp4_gemm, dq_functional.gemm
    dq_nvfp4.fp8_kernels, dq_gemm.nvfp4_gemm = rec.wrap_kernels(), rec.wrap_gemm(saved[1])
    dq_functional.gemm = rec.wrap_linear_gemm(saved[2])
    try:
        m = copy.deepcopy(m0).to(device)
        xd = x.detach().clone().to(device).requires_grad_(True)
        dq.apply_recipe(m, recipe)
        for step in range(2):
            m.zero_grad(set_to_none=True)
            xd.grad = None
            with dq.autocast():
                y = m(xd)
            y.backward(dy.to(device))
            for name, t in (("y", y), ("dx", xd.grad), ("dw", m.weight.grad)):
                rec.stages.append((f"result {name}@step{step}", {"value": _cpu(t)}))
    finally:
        dq_nvfp4.fp8_kernels, dq_gemm.nvfp4_gemm, dq_functional.gemm = saved
    return rec.stages


def where_differs(a: torch.Tensor, b: torch.Tensor, limit: int = 6) -> str:
    if a.shape != b.shape or a.dtype != b.dtype:
        return f"shape/dtype {tuple(a.shape)} {a.dtype} vs {tuple(b.shape)} {b.dtype}"
    if a.dtype.is_floating_point:
        diff = ~((a == b) | (a.isnan() & b.isnan())) | (torch.signbit(a) != torch.signbit(b))
    else:
        diff = a != b
    idx = diff.nonzero()
    lines = [f"{idx.shape[0]} of {a.numel()} elements differ"]
    for i in idx[:limit].tolist():
        va, vb = a[tuple(i)].item(), b[tuple(i)].item()
        extra = ""
        if a.dtype == torch.uint8:
            extra = f" (nibbles lo/hi cpu {va & 15}/{va >> 4}, gpu {vb & 15}/{vb >> 4})"
        if a.dtype == torch.float32:
            ba = torch.tensor([va], dtype=torch.float32).view(torch.int32).item()
            bb = torch.tensor([vb], dtype=torch.float32).view(torch.int32).item()
            extra = f" (bits {ba:#010x} vs {bb:#010x})"
        lines.append(f"    at {tuple(i)}: cpu {va!r} gpu {vb!r}{extra}")
    return "\n".join(lines)


INFO_ONLY = ("a_hp", "b_hp")
"""A linear GEMM stage's dequantized operands: read by the dequantize route only (their transform
is undone by a 16x16 matmul, whose order is the device's), shown but not a stage's verdict."""


def first_difference(
    rec_a: dict[str, Any], rec_b: dict[str, Any], skip: tuple[str, ...] = ()
) -> tuple[str, str] | None:
    for key, va in rec_a.items():
        if key in skip:
            continue
        vb = rec_b[key]
        if isinstance(va, torch.Tensor):
            if va.shape != vb.shape or not torch.equal(va, vb):
                return key, where_differs(va, vb)
        elif isinstance(va, tuple):
            for j, (ta, tb) in enumerate(zip(va, vb)):
                if not isinstance(ta, torch.Tensor):
                    if ta != tb:
                        return f"{key}[{j}]", f"{ta!r} vs {tb!r}"
                elif not torch.equal(ta, tb):
                    return f"{key}[{j}]", where_differs(ta, tb)
        elif isinstance(va, GemmOperand):
            continue  # its bytes are the cast stages'; its dequantized values are a_hp / b_hp
        elif va != vb:
            return key, f"{va!r} vs {vb!r}"
    return None


def replay_on_cpu(kind: str, gpu_rec: dict[str, Any]) -> str:
    """The CPU reference on the GPU stage's own inputs, compared with the GPU's outputs."""
    if kind == "cast":
        out = ref.nvfp4_cast(gpu_rec["in"], gpu_rec["amax_in"], **gpu_rec["opts"])
        want = {"s_dec": out.s_dec, "scales": out.scales.view(torch.uint8), "data": out.data}
    elif kind == "gemm":
        a, b = (
            ref.NVFP4Operand(data, scales.view(torch.float8_e4m3fn), *rest)
            for data, scales, *rest in (gpu_rec["a"], gpu_rec["b"])
        )
        want = {"out": ref.nvfp4_gemm(a, b)}
    elif kind == "linear gemm":
        want = {"out": dq_gemm.gemm(gpu_rec["a"], gpu_rec["b"], **gpu_rec["kw"])}
    elif kind == "amax":
        want = {"amax": gpu_rec["in"].abs().amax().float()}
    elif kind == "rht":
        want = {"out": ref.random_hadamard_transform(gpu_rec["in"])}
    else:
        return ""
    for key, w in want.items():
        got = gpu_rec[key]
        if w.reshape(got.shape).dtype != got.dtype or not torch.equal(w.reshape(got.shape), got):
            return f"GPU {kind} != CPU reference on the GPU's inputs in {key}:\n  " + where_differs(
                w.reshape(got.shape), got
            )
    return f"GPU {kind} == CPU reference on the GPU's inputs"


def describe(kind: str, rec: dict[str, Any]) -> str:
    if kind == "cast":
        o = rec["opts"]
        flags = ",".join(k for k in ("columnwise", "block_2d", "rht", "stochastic") if o.get(k))
        return f"cast in {tuple(rec['in'].shape)} [{flags or 'rowwise'}] offset={o.get('offset')}"
    if kind == "gemm":
        return f"nvfp4_gemm a {tuple(rec['a'][0].shape)} b {tuple(rec['b'][0].shape)}"
    if kind == "linear gemm":
        return f"linear gemm via {rec['route']}"
    if kind in ("amax", "rht"):
        return f"{kind} of {tuple(rec['in'].shape)}"
    return kind


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--recipe", choices=sorted(RECIPES), default="one-side-rht")
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--in-features", type=int, default=96)
    p.add_argument("--out-features", type=int, default=48)
    args = p.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("diag_nvfp4_plain: needs a CUDA device")
    print(f"torch {torch.__version__}, {torch.cuda.get_device_name()}, recipe {args.recipe}")
    torch.manual_seed(0)  # the test's module and inputs
    m0 = dq.Linear(args.in_features, args.out_features, bias=False)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(args.tokens, args.in_features, generator=g)
    dy = torch.randn(args.tokens, args.out_features, generator=g)
    cpu = run_step("cpu", RECIPES[args.recipe], m0, x, dy)
    gpu = run_step("cuda", RECIPES[args.recipe], m0, x, dy)
    if [k for k, _ in cpu] != [k for k, _ in gpu]:
        print("the stage sequences differ:", [k for k, _ in cpu], [k for k, _ in gpu])
    first = None
    for i, ((kind, rc), (_, rg)) in enumerate(zip(cpu, gpu)):
        diff = first_difference(rc, rg, skip=INFO_ONLY)
        status = "same" if diff is None else f"DIFFERS in {diff[0]}"
        replay = replay_on_cpu(kind, rg)
        print(f"[{i:2d}] {describe(kind, rc):55s} {status}; {replay}")
        if diff is not None:
            print("     " + diff[1].replace("\n", "\n     "))
            first = i if first is None else first
        info = first_difference(*({k: r[k] for k in INFO_ONLY if k in r} for r in (rc, rg)))
        if info is not None:
            print(
                f"     (the dequantized operand {info[0]} differs: " + info[1].split("\n")[0] + ")"
            )
    if first is None:
        print("every stage is bit-identical")
    else:
        print(f"first differing stage: [{first}] {describe(cpu[first][0], cpu[first][1])}")


if __name__ == "__main__":
    main()
