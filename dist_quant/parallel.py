"""Tensor and sequence parallelism: the collectives of TP/SP layers and their autograd rules.

Layout (Megatron-LM's, as in Transformer Engine): activations are `(sequence, ..., hidden)`;
sequence parallelism shards dim 0 over the tensor-parallel group. A column-parallel GEMM shards its
weight's output features, a row-parallel one its input features:

    column:  x (replicated, or SP shard -> all-gather)  @ W[rows of rank]^T -> y sharded on features
    row:     x sharded on features @ W[:, cols of rank]^T -> partial sums -> all-reduce, or
             reduce-scatter to SP shards; the bias is added once, after the reduction

Each collective below says what it produces. FP8 tensors travel as uint8 (gloo cannot move
float8) together with their scale_inv; the quantizer must give every rank the same scale (current
scaling: amax reduced over the TP group; delayed: amax_reduction_group covering TP), and the gather
checks that it did.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from dist_quant.kinds import ParallelMode
from dist_quant.nvfp4 import NVFP4Quantizer
from dist_quant.quantizers import Float8CurrentScalingQuantizer, Quantizer
from dist_quant.tensor import Float8Tensor, QuantizedTensor


@dataclass(frozen=True)
class TPLayout:
    """How one GEMM is split over a tensor-parallel group of more than one rank."""

    group: Any
    mode: ParallelMode
    sequence_parallel: bool
    """Activations outside the GEMM are sharded along dim 0 (the sequence)."""
    owner: nn.Module
    """The owning module, named only in errors (`name`): a traced forward that formatted its name
    would be specialised on it, and identical blocks compiled one at a time could not share their
    graph."""

    @property
    def name(self) -> str:
        return getattr(self.owner, "role_name", "") or type(self.owner).__name__

    @property
    def size(self) -> int:
        return group_size(self.group)

    def gathers_input(self) -> bool:
        return self.mode is ParallelMode.COLUMN and self.sequence_parallel

    def gathers_grad_output(self) -> bool:
        return self.mode is ParallelMode.ROW and self.sequence_parallel

    def shard_quantizers(self, quantizers: dict[str, Quantizer | None]) -> dict[str, Any]:
        """The GEMM's quantizers by slot name (input, weight, output, grad_output, grad_input),
        with current-scaling ones reducing their amax over the TP group wherever the rank's
        tensor is a shard of a larger one: the all-gathered SP operands (required for an exact
        quantized all-gather) and every other sharded operand (weights, feature-sharded
        activations and gradients, SP-sharded outputs), so that TP quantizes each tensor with
        exactly the scale a single rank would use. Replicated tensors (a column GEMM's input and
        input gradient, a row GEMM's output and output gradient, without SP) are already whole."""
        sp = self.sequence_parallel
        if self.mode is ParallelMode.COLUMN:
            sharded = {"input": sp, "weight": True, "output": True, "grad_output": True}
            sharded["grad_input"] = sp
        else:
            sharded = {"input": True, "weight": True, "output": sp, "grad_output": sp}
            sharded["grad_input"] = True
        return {
            slot: tp_amax_quantizer(q, self.group) if q is not None and sharded[slot] else q
            for slot, q in quantizers.items()
        }


def group_size(group: Any) -> int:
    """Ranks in `group`; 1 without a group or without torch.distributed."""
    if group is None or not dist.is_available() or not dist.is_initialized():
        return 1
    return dist.get_world_size(group)


def group_rank(group: Any) -> int:
    if group is None or not dist.is_available() or not dist.is_initialized():
        return 0
    return dist.get_rank(group)


# ---- sharding of parameters ----------------------------------------------------------------------
def mark_tp_split(module: nn.Module, name: str, dim: int, parts: int | tuple[int, ...] = 1) -> None:
    """Record that parameter `name` of `module` is a TP shard: the full tensor is cut along `dim`
    into pieces and each piece is split over the ranks; the rank's shard is its chunk of every
    piece, concatenated. `parts` is the number of equal pieces (3 for fused QKV, 2 for SwiGLU's
    gate/up) or their relative sizes when they differ (`(4, 1, 1)`: a grouped-query QKV with four
    query heads per KV head, q rows then k and v rows); relative sizes are stored reduced by their
    common divisor, equal ones as their count, so a split has one spelling. The record sits on the module (`tp_splits` reads it) and on
    the parameter (`param.tp_split`): FSDP2's `fully_shard` replaces the parameter, dropping its
    attributes, but keeps the module."""
    split = (dim, _canonical_parts(parts))
    getattr(module, name).tp_split = split
    module.__dict__.setdefault("_tp_splits", {})[name] = split


def _canonical_parts(parts: int | tuple[int, ...]) -> int | tuple[int, ...]:
    """One spelling per split: an int stays; relative sizes are reduced by their common divisor,
    and equal ones become their count."""
    sizes = (parts,) if isinstance(parts, int) else tuple(parts)
    if not sizes or any(isinstance(p, bool) or not isinstance(p, int) or p < 1 for p in sizes):
        raise ValueError(
            f"mark_tp_split: parts must be an int >= 1 or a tuple of them, got {parts!r}"
        )
    if isinstance(parts, int):
        return parts
    common = math.gcd(*sizes)
    return len(sizes) if len(set(sizes)) == 1 else tuple(p // common for p in sizes)


def piece_sizes(length: int, parts: int | tuple[int, ...]) -> list[int]:
    """The lengths of the pieces of a dimension of `length` under a split's `parts`."""
    relative = [1] * parts if isinstance(parts, int) else list(parts)
    unit, rest = divmod(length, sum(relative))
    if rest:
        raise ValueError(
            f"cannot cut a dimension of {length} into pieces of relative sizes {relative}"
        )
    return [unit * r for r in relative]


def tp_splits(model: nn.Module) -> dict[str, tuple[int, int | tuple[int, ...]]]:
    """`(dim, parts)` of every parameter of `model` marked by `mark_tp_split`, by state-dict key;
    valid before and after `fully_shard`."""
    out = {}
    for prefix, module in model.named_modules():
        for name, split in module.__dict__.get("_tp_splits", {}).items():
            out[f"{prefix}.{name}" if prefix else name] = split
    return out


def mark_sequence_parallel(param: nn.Parameter) -> None:
    """`param`'s gradient is a partial sum over this rank's sequence shard (norm weights, the bias of
    a row-parallel GEMM under SP): `allreduce_sequence_parallel_grads` completes it."""
    param.sequence_parallel = True


def shard_of(
    full: torch.Tensor, dim: int, parts: int | tuple[int, ...], rank: int, size: int
) -> torch.Tensor:
    """The rank's shard of `full` under `mark_tp_split(dim, parts)`."""
    parts = _canonical_parts(parts)
    # every piece splits evenly over the ranks iff dim is a multiple of this (the relative sizes
    # are coprime once canonical)
    unit = (parts if isinstance(parts, int) else sum(parts)) * size
    if full.shape[dim] % unit:
        raise ValueError(
            f"cannot shard a tensor of shape {tuple(full.shape)} along dim {dim} into pieces "
            f"{parts} x {size} ranks: {full.shape[dim]} is not divisible by {unit}"
        )
    sizes = piece_sizes(full.shape[dim], parts)
    pieces = full.split(sizes, dim=dim)
    return torch.cat([p.chunk(size, dim=dim)[rank] for p in pieces], dim=dim)


def unshard(shards: list[torch.Tensor], dim: int, parts: int | tuple[int, ...]) -> torch.Tensor:
    """The full tensor from every rank's `shard_of` shard (in rank order): its inverse."""
    size = len(shards)
    cuts = [t.split(piece_sizes(t.shape[dim], parts), dim=dim) for t in shards]
    n_pieces = len(cuts[0])
    return torch.cat([cuts[r][i] for i in range(n_pieces) for r in range(size)], dim=dim)


def allreduce_sequence_parallel_grads(model: nn.Module, tp_group: Any) -> None:
    """Sum the gradients of parameters marked `sequence_parallel` over the TP group, in one
    all-reduce. Call after backward and before the optimizer step when sequence parallelism is on
    (Megatron-LM does the same for its norm weights)."""
    if group_size(tp_group) == 1:
        return
    for name, module in model.named_modules():
        sharded = any(isinstance(p, DTensor) for p in module.parameters(recurse=False))
        if getattr(module, "sequence_parallel", False) and sharded:
            # fully_shard replaced the parameters (dropping their marks) and reduce-scattered
            # the partial sums already: summing nothing here would leave them partial
            raise NotImplementedError(
                f"allreduce_sequence_parallel_grads: module {name!r} is sequence-parallel and its "
                "parameters are sharded by FSDP2 (fully_shard); sequence parallelism under FSDP2 "
                "is not supported"
            )
    grads = [
        p.grad
        for p in model.parameters()
        if getattr(p, "sequence_parallel", False) and p.grad is not None
    ]
    if not grads:
        return
    flat = torch.cat([g.reshape(-1).float() for g in grads])
    dist.all_reduce(flat, group=tp_group)  # per-shard partial grads -> full grads
    offset = 0
    for g in grads:
        g.copy_(flat[offset : offset + g.numel()].view_as(g))
        offset += g.numel()


# ---- raw collectives along dim 0 (the sequence) ---------------------------------------------------
def _all_gather_into(out: torch.Tensor, inp: torch.Tensor, group: Any) -> None:
    # torch 2.13 renamed all_gather_into_tensor to all_gather_single; 2.11 has only the old name
    fn = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    fn(out, inp, group=group)


def _reduce_scatter_into(out: torch.Tensor, inp: torch.Tensor, group: Any) -> None:
    fn = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    fn(out, inp, group=group)


def all_gather_seq(x: torch.Tensor, group: Any) -> torch.Tensor:
    """(s/tp, ...) on each rank -> (s, ...) on every rank, rank order along dim 0."""
    size = group_size(group)
    if size == 1:
        return x
    x = x.contiguous()
    out = torch.empty((size * x.shape[0], *x.shape[1:]), dtype=x.dtype, device=x.device)
    _all_gather_into(out, x, group)  # sequence shards -> full sequence
    return out


def reduce_scatter_seq(x: torch.Tensor, group: Any) -> torch.Tensor:
    """(s, ...) partial sums on each rank -> (s/tp, ...): this rank's rows, summed over ranks."""
    size = group_size(group)
    if size == 1:
        return x
    if x.shape[0] % size:
        raise ValueError(
            f"reduce-scatter along the sequence: dim 0 ({x.shape[0]}) is not divisible by the "
            f"tensor-parallel size {size}"
        )
    x = x.contiguous()
    out = torch.empty((x.shape[0] // size, *x.shape[1:]), dtype=x.dtype, device=x.device)
    _reduce_scatter_into(out, x, group)  # full-sequence partial sums -> own shard, summed
    return out


def all_reduce_sum(x: torch.Tensor, group: Any) -> torch.Tensor:
    """Partial sums on each rank -> the full sum on every rank (a new tensor)."""
    if group_size(group) == 1:
        return x
    out = x.contiguous().clone()
    dist.all_reduce(out, group=group)  # partial sums -> full sums
    return out


def split_seq(x: torch.Tensor, group: Any) -> torch.Tensor:
    """(s, ...) replicated -> this rank's (s/tp, ...) rows (no communication)."""
    size = group_size(group)
    if size == 1:
        return x
    if x.shape[0] % size:
        raise ValueError(
            f"sequence split: dim 0 ({x.shape[0]}) is not divisible by the tensor-parallel size "
            f"{size}"
        )
    return x.chunk(size, dim=0)[group_rank(group)].contiguous()


# ---- autograd primitives -------------------------------------------------------------------------
class _CopyToTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any) -> torch.Tensor:
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, dy: torch.Tensor) -> tuple:
        return all_reduce_sum(dy, ctx.group), None  # each rank's partial input grad -> full grad


class _ReduceFromTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any) -> torch.Tensor:
        return all_reduce_sum(x, group)  # partial sums -> full output

    @staticmethod
    def backward(ctx: Any, dy: torch.Tensor) -> tuple:
        return dy, None


class _GatherSeq(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any, reduce_grad: bool) -> torch.Tensor:
        ctx.group, ctx.reduce_grad = group, reduce_grad
        return all_gather_seq(x, group)

    @staticmethod
    def backward(ctx: Any, dy: torch.Tensor) -> tuple:
        if ctx.reduce_grad:  # every rank's grad covers the full sequence: sum, keep own rows
            return reduce_scatter_seq(dy, ctx.group), None, None
        return split_seq(dy, ctx.group), None, None  # the grad is replicated: keep own rows


class _ReduceScatterSeq(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any) -> torch.Tensor:
        ctx.group = group
        return reduce_scatter_seq(x, group)

    @staticmethod
    def backward(ctx: Any, dy: torch.Tensor) -> tuple:
        return all_gather_seq(dy, ctx.group), None  # shard grads -> full-sequence grad


def copy_to_tp_region(x: torch.Tensor, group: Any) -> torch.Tensor:
    """Enter a column-parallel GEMM with a replicated input: identity; backward sums the ranks'
    partial input gradients."""
    return _CopyToTP.apply(x, group) if group_size(group) > 1 else x


def reduce_from_tp_region(x: torch.Tensor, group: Any) -> torch.Tensor:
    """Leave a row-parallel GEMM: sum the partial outputs; backward passes the gradient through."""
    return _ReduceFromTP.apply(x, group) if group_size(group) > 1 else x


def gather_from_sequence_parallel_region(
    x: torch.Tensor, group: Any, *, reduce_grad: bool = True
) -> torch.Tensor:
    """Sequence shards -> the full sequence. Backward: reduce-scatter (`reduce_grad`, when each
    rank's consumer produced a partial gradient, e.g. a column-parallel GEMM), or keep this rank's
    rows of a replicated gradient (e.g. a loss computed identically on every rank)."""
    return _GatherSeq.apply(x, group, reduce_grad) if group_size(group) > 1 else x


def reduce_scatter_to_sequence_parallel_region(x: torch.Tensor, group: Any) -> torch.Tensor:
    """Leave a row-parallel GEMM under SP: partial sums -> this rank's summed sequence shard."""
    return _ReduceScatterSeq.apply(x, group) if group_size(group) > 1 else x


# ---- quantized all-gather ------------------------------------------------------------------------
def tp_amax_quantizer(q: Quantizer, group: Any) -> Quantizer:
    """`q` itself, or for a current-scaling quantizer without a group (or an NVFP4 one whose
    recipe reduces amaxes, `NVFP4BlockScaling.reduce_amax`) a copy that all-reduces its amax over
    `group`, so every rank casts its shard with the (global) scale of the whole tensor. A copy,
    because a factory may hand one quantizer object to several slots."""
    reduces = isinstance(q, Float8CurrentScalingQuantizer) or (
        isinstance(q, NVFP4Quantizer) and q.reduce_amax
    )
    if reduces and q.amax_reduction_group is None and group_size(group) > 1:
        return q.with_amax_reduction_group(group)
    return q


def all_gather_quantized(
    x: torch.Tensor,
    quantizer: Quantizer,
    group: Any,
    *,
    columnwise: bool,
    what: Callable[[], str],
) -> QuantizedTensor | torch.Tensor:
    """Quantize this rank's sequence shard `x` (s/tp, ...) and all-gather it: (s, ...) quantized.

    Per-tensor FP8 (delayed or current scaling) is quantized locally and its bytes gathered as
    uint8, with each rank's scale_inv in the same message; the scales must agree bit for bit (else
    ValueError naming `what()`, on every rank; on CUDA a device-side assert, to keep the host
    unsynchronised), so the result is exactly the quantization of the gathered tensor. Other
    quantizers (MXFP8, block, identity) gather the high-precision shards and quantize the whole
    tensor, which is exact by construction. `what` is called only to word the error (eagerly, on
    CUDA, for the assert's message; not while torch.compile traces: see `TPLayout.owner`).
    """
    size = group_size(group)
    quantizer = tp_amax_quantizer(quantizer, group)
    if not quantizer.scaling.per_tensor or size == 1:
        full = all_gather_seq(x, group)
        quantizer.set_usage(rowwise=True, columnwise=columnwise)
        return quantizer.quantize(full)
    # the shard's bytes only (the transpose is built from the whole), without touching the
    # quantizer's usage flags: this runs inside an autograd.Function that torch.compile traces
    q = quantizer.cast(x.contiguous(), transpose=False)
    data_u8 = q.data.reshape(-1).view(torch.uint8)
    scale_u8 = q.scale_inv.reshape(1).view(torch.uint8)  # fp32 -> 4 bytes
    packed = torch.cat([data_u8, scale_u8])
    out = torch.empty(size * packed.numel(), dtype=torch.uint8, device=x.device)
    _all_gather_into(out, packed, group)  # (bytes + scale_inv) of each shard -> of every shard
    rows = out.view(size, packed.numel())
    scales = rows[:, data_u8.numel() :]
    agree = (scales == scales[:1]).all()
    advice = (
        "the tensor-parallel ranks quantized their shards with different scales; a quantized "
        "all-gather needs one scale. Reduce the amax over the TP group: "
        "autocast(amax_reduction_group=...) covering the TP ranks for delayed scaling, "
        "amax_reduction_group on the quantizer for current scaling."
    )
    if x.device.type == "cuda" or torch.compiler.is_compiling():
        # no host sync in the hot path: a mismatch trips a device-side assert (the module has
        # already warned if autocast has no amax_reduction_group); traced, the check is an op
        # (on the CPU it raises when the graph runs), a bool() of it would be data-dependent
        where = "a sequence-parallel all-gather" if torch.compiler.is_compiling() else what()
        torch._assert_async(agree, f"{where}: {advice}")
    elif not bool(agree):
        got = scales.contiguous().view(torch.float32).reshape(-1).tolist()
        raise ValueError(f"{what()}: {advice} scale_inv per rank: {got}")
    data = rows[:, : data_u8.numel()].reshape(size * x.shape[0], *x.shape[1:])
    return Float8Tensor(data.view(q.data.dtype), q.scale_inv, dtype=x.dtype)
