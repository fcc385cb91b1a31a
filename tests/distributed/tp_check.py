"""Helpers for the tensor-parallel tests: record every FP8 cast, compare TP shards with a reference.

`Recorder` wraps the per-tensor quantizers (delayed and current scaling) at class level inside a rank
process and records, for each labelled quantizer, the high-precision input, the FP8 bytes (as uint8)
and the scale_inv of every `quantize` call. Labels `(module name, "fwd" | "bwd", slot)` are attached
to a module's runtime quantizers after `apply_recipe`; the TP modules' copies of current-scaling
quantizers (`copy.copy`) keep them. The same labels on the single-rank reference and on the TP model
pair each TP cast with the reference cast of the same tensor.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

import torch
import torch.distributed as dist

import dist_quant as dq
from dist_quant import kernels as fp8_kernels
from dist_quant.quantizers import Float8CurrentScalingQuantizer, Float8Quantizer
from dist_quant.runtime import dist_quant_modules

FP8_MAX = {torch.float8_e4m3fn: 448.0, torch.float8_e5m2: 57344.0}


@dq.quantizer_factory(key="tests.tp.mixed")
def mixed_factory(role):
    """Current scaling for activations and gradients, runtime-owned delayed scaling for weights."""
    if role is not None and role.tensor_type == "weight":
        return dq.DelayedScalingRequest(amax_history_len=4)
    if role is not None and role.tensor_type in ("input", "grad_output"):
        fmt = torch.float8_e5m2 if role.tensor_type == "grad_output" else torch.float8_e4m3fn
        return dq.Float8CurrentScalingQuantizer(fmt)
    return dq.IdentityQuantizer()


RECIPES = {
    "delayed": lambda: dq.DelayedScaling(amax_history_len=4),
    "current": lambda: dq.Float8CurrentScaling(),
    "custom": lambda: dq.CustomRecipe(mixed_factory),
}


class Recorder:
    def __init__(self) -> None:
        self.log: dict[tuple, list[dict]] = defaultdict(list)
        for cls in (Float8Quantizer, Float8CurrentScalingQuantizer):
            self._wrap(cls)

    def _wrap(self, cls: type) -> None:
        # `cast` is where every per-tensor cast goes: `quantize` wraps its result, and the
        # per-tensor linear path calls it directly. The fused SwiGLU casts do not pass through it:
        # they are logged with the activation they stand for, swiglu(h) or swiglu_backward(dy, h)
        original = cls.cast
        fused, fused_backward = cls.cast_swiglu, cls.cast_swiglu_backward
        record = self._record

        def cast(q, x, *, transpose, _original=original):
            return record(q, x, _original(q, x, transpose=transpose))

        def cast_swiglu(q, h, *, transpose, _original=fused):
            before = self._logged()
            out = _original(q, h, transpose=transpose)
            if self._logged() == before:  # not fallen back to `cast`, which logged it
                record(q, fp8_kernels.swiglu(h), out)
            return out

        def cast_swiglu_backward(q, dy, h, *, transpose, _original=fused_backward):
            before = self._logged()
            out = _original(q, dy, h, transpose=transpose)
            if self._logged() == before:
                record(q, fp8_kernels.swiglu_backward(dy, h), out)
            return out

        cls.cast, cls.cast_swiglu, cls.cast_swiglu_backward = (
            cast,
            cast_swiglu,
            cast_swiglu_backward,
        )

    def _logged(self) -> int:
        return sum(map(len, self.log.values()))

    def _record(self, q: Any, x: torch.Tensor, out: Any) -> Any:
        label = getattr(q, "_rec_label", None)
        if label is not None:
            self.log[label].append(
                {
                    "x": x.detach().clone(),
                    "bytes": out.data.view(torch.uint8).clone(),
                    "scale_inv": out.scale_inv.detach().clone().reshape(1),
                    # delayed scaling casts with its scale buffer (not 1 / scale_inv)
                    "scale": q.scale.detach().clone().reshape(1)
                    if isinstance(q, Float8Quantizer)
                    else None,
                    "fp8_dtype": out.data.dtype,
                }
            )
        return out

    def take(self) -> dict[tuple, list[dict]]:
        out = dict(self.log)
        self.log.clear()
        return out


def run_step(
    model: torch.nn.Module, x: torch.Tensor, dy: torch.Tensor, group: Any
) -> tuple[torch.Tensor, torch.Tensor]:
    """One forward and backward under autocast with amaxes reduced over `group` (None: this rank
    alone): `(y, dx)`, so a TP model and its single-rank reference take the same step."""
    x = x.clone().requires_grad_(True)
    model.zero_grad(set_to_none=True)
    with dq.autocast(amax_reduction_group=group):
        y = model(x)
    y.backward(dy)
    return y.detach(), x.grad


def label_quantizers(model: torch.nn.Module) -> None:
    """Call after `apply_recipe(model, ...)`: tag every runtime quantizer with its label."""
    for m in dist_quant_modules(model):
        rt = m.quant_binding.runtime
        for direction, quantizers in (("fwd", rt.fwd_quantizers), ("bwd", rt.bwd_quantizers)):
            for slot, q in enumerate(quantizers):
                q._rec_label = (m.role_name, direction, slot)


def gather_objects(obj: Any, group: Any = None) -> list[Any]:
    out: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, obj, group=group)
    return out


def shard(t: torch.Tensor, dim: int | None, rank: int, size: int) -> torch.Tensor:
    return t if dim is None else t.chunk(size, dim=dim)[rank]


def check_exact(ref: dict, tp: dict, specs: dict, rank: int, size: int, where: str) -> int:
    """Every TP cast of every labelled tensor equals the reference cast's shard, bit for bit:
    same FP8 bytes and same scale_inv. `specs[label]` is the shard dim (None: replicated).
    Returns how many casts were compared."""
    compared = 0
    for label, dim in specs.items():
        refs, tps = ref.get(label, []), tp.get(label, [])
        if not refs or len(refs) != len(tps):
            raise AssertionError(
                f"{where} {label}: {len(refs)} reference casts, {len(tps)} TP casts on rank {rank}"
            )
        for call, (r, t) in enumerate(zip(refs, tps)):
            want = shard(r["bytes"], dim, rank, size)
            ok_bytes = t["bytes"].shape == want.shape and torch.equal(t["bytes"], want)
            ok_scale = torch.equal(t["scale_inv"], r["scale_inv"])
            if not (ok_bytes and ok_scale):
                diff = (t["bytes"] != want).sum().item() if t["bytes"].shape == want.shape else "-"
                raise AssertionError(
                    f"{where} {label} call {call} rank {rank}: bytes equal {ok_bytes} "
                    f"({diff} differ), scale_inv {t['scale_inv'].item()} vs reference "
                    f"{r['scale_inv'].item()}"
                )
            compared += 1
    return compared


def check_logical(tp_all: list[dict], specs: dict, where: str) -> int:
    """For casts downstream of a cross-rank sum, whose values may differ from the single-rank
    reference in the last fp32 bit: every rank's shard is the exact cast of the *logical* tensor
    (the ranks' shards put together). Re-derived here: one scale on every rank; for current
    scaling `fp8_max / max|logical|` in fp32; bytes = saturating torch cast of `x * scale`."""
    compared = 0
    size = len(tp_all)
    for label, dim in specs.items():
        calls = len(tp_all[0][label])
        for call in range(calls):
            recs = [tp_all[r][label][call] for r in range(size)]
            scale_inv = recs[0]["scale_inv"]
            for r, rec in enumerate(recs):
                if not torch.equal(rec["scale_inv"], scale_inv):
                    raise AssertionError(f"{where} {label} call {call}: rank {r} has another scale")
            fp8 = recs[0]["fp8_dtype"]
            fmax = FP8_MAX[fp8]
            if dim is None:
                whole = recs[0]["x"]
            else:
                whole = torch.cat([rec["x"] for rec in recs], dim=dim)
            if recs[0]["scale"] is None:  # current scaling: re-derive from the logical amax
                amax = whole.abs().max().float()
                scale = torch.tensor(fmax, dtype=torch.float32) / amax
                if not torch.equal(scale_inv, (1.0 / scale).reshape(1)):
                    raise AssertionError(f"{where} {label} call {call}: scale is not max/amax")
            else:
                scale = recs[0]["scale"]
            for r, rec in enumerate(recs):
                want = (rec["x"].float() * scale).clamp(-fmax, fmax).to(fp8).view(torch.uint8)
                if not torch.equal(rec["bytes"], want):
                    raise AssertionError(f"{where} {label} call {call}: rank {r} bytes differ")
                compared += 1
    return compared


def assert_close(got: torch.Tensor, want: torch.Tensor, rtol: float, what: str) -> None:
    """max |got - want| <= rtol * max |want| (a normwise bound: fp32 reassociation errors scale
    with the magnitude of the whole sum, not of each element)."""
    if got.shape != want.shape:
        raise AssertionError(f"{what}: shape {tuple(got.shape)} vs {tuple(want.shape)}")
    err = (got.double() - want.double()).abs().max().item()
    scale = want.double().abs().max().item()
    if not err <= rtol * scale:
        raise AssertionError(f"{what}: max error {err:.3e} > {rtol} * {scale:.3e}")


class CountMaxAllReduce:
    """Counts all-reduce(MAX) calls while active: `calls` all of them, `packed` those of the packed
    delayed-scaling buffer (a current-scaling quantizer reduces a single amax element instead)."""

    def __init__(self) -> None:
        self.calls = 0
        self.packed = 0

    def __enter__(self) -> CountMaxAllReduce:
        self.orig = dist.all_reduce

        def counting(tensor, op=dist.ReduceOp.SUM, group=None, async_op=False):
            if op == dist.ReduceOp.MAX:
                self.calls += 1
                self.packed += tensor.numel() > 1
            return self.orig(tensor, op=op, group=group, async_op=async_op)

        dist.all_reduce = counting
        return self

    def __exit__(self, *exc) -> None:
        dist.all_reduce = self.orig
