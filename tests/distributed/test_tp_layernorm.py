"""Tensor-parallel `LayerNormLinear` (column) and `LayerNormMLP` (fc1 column, fc2 row; gelu and
swiglu), with and without sequence parallelism, against a single-rank reference (gloo on CPU).

What it catches, beyond test_tp_linear: a norm applied to the wrong rows under SP (or its
parameter gradients left partial), SwiGLU's gate/up halves sharded as one block (a rank would pair
its gate rows with another rank's up rows), fc2's bias added on every rank before the reduction,
and the fc1 -> fc2 boundary quantized with a per-rank scale.

Exactness and tolerance as in test_tp_linear: every FP8 cast (fc1/fc2 inputs, weights and
grad_outputs) is bit-identical to the reference's shard in both steps; outputs and gradients differ
only by the order of fp32 additions (fc2's partial sums, the column input gradient), held to 1e-5
of the tensor's largest value.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from harness import run_ranks
from tp_check import RECIPES, Recorder, assert_close, check_exact, label_quantizers, run_step

import dist_quant as dq
from dist_quant.checkpoint import load_full_state_dict_into_shards
from dist_quant.parallel import allreduce_sequence_parallel_grads

pytestmark = pytest.mark.distributed

# FFN / tp stays a multiple of 32 features: PyTorch's CPU elementwise kernels (silu, gelu) run
# rows narrower than two SIMD vectors (2 x 16 floats on AVX-512) through scalar code whose last bit
# differs from the vectorized code, so a 16-wide SwiGLU gate shard would round differently from the
# reference's 32-wide gate. That is a CPU-emulation artifact, not a TP effect (GPU elementwise
# kernels do not depend on the row width), and these shapes keep both sides on the same code.
SEQ, BATCH, HIDDEN, FFN = 8, 2, 16, 128
RTOL = 1e-5


def piece_shard(t: torch.Tensor, dim: int, parts: int, rank: int, size: int) -> torch.Tensor:
    """The rank's rows of each of `parts` stacked blocks (SwiGLU's [gate; up])."""
    return torch.cat([p.chunk(size, dim)[rank] for p in t.chunk(parts, dim)], dim)


def build(kind: str, activation: str, tp: bool, sp: bool):
    kw = {}
    if tp:
        kw = {"tp_group": dist.group.WORLD, "sequence_parallel": sp}
        if kind == "lnl":
            kw["parallel_mode"] = "column"
    torch.manual_seed(0)
    if kind == "lnl":
        return dq.LayerNormLinear(HIDDEN, FFN, name="m", **kw)
    return dq.LayerNormMLP(HIDDEN, FFN, activation=activation, name="m", **kw)


def specs(kind: str, activation: str, sp: bool) -> dict:
    """label -> (shard dim, stacked parts) of the cast's 2D view; dim None: the whole tensor."""
    seq = (0, 1) if sp else (None, 1)
    if kind == "lnl":
        return {("m", "fwd", 0): seq, ("m", "fwd", 1): (0, 1), ("m", "bwd", 0): (1, 1)}
    parts = 2 if activation == "swiglu" else 1
    return {
        ("m", "fwd", 0): seq,  # fc1 input: the norm output, gathered under SP
        ("m", "fwd", 1): (0, parts),  # fc1 weight rows
        ("m", "fwd", 3): (1, 1),  # fc2 input: the activation, this rank's ffn features
        ("m", "fwd", 4): (1, 1),  # fc2 weight columns
        ("m", "bwd", 0): (1, parts),  # fc1 grad_output: this rank's fc1 output features
        ("m", "bwd", 2): seq,  # fc2 grad_output: the module's output gradient
    }


def param_shards(kind: str, activation: str) -> dict:
    if kind == "lnl":
        return {"weight": (0, 1), "bias": (0, 1)}
    parts = 2 if activation == "swiglu" else 1
    return {"fc1_weight": (0, parts), "fc1_bias": (0, parts), "fc2_weight": (1, 1)}


def data(step: int, kind: str):
    g = torch.Generator().manual_seed(step)
    x = torch.randn(SEQ, BATCH, HIDDEN, generator=g)
    out = FFN if kind == "lnl" else HIDDEN
    dy = torch.randn(SEQ, BATCH, out, generator=g) * 1e-2
    return x, dy


def compare(rec, kind, activation, sp, recipe_name, rank, size) -> int:
    group = dist.group.WORLD
    ref, tp = build(kind, activation, False, sp), build(kind, activation, True, sp)
    load_full_state_dict_into_shards(tp, ref.state_dict(), group)
    for m in (ref, tp):
        dq.apply_recipe(m, RECIPES[recipe_name]())
        label_quantizers(m)
    where = f"{kind}/{activation}{'+SP' if sp else ''} {recipe_name} TP={size}"
    label_specs = specs(kind, activation, sp)
    compared = 0
    for step in range(2):
        x, dy = data(step, kind)
        y_ref, dx_ref = run_step(ref, x, dy, None)
        ref_casts = rec.take()
        x_loc = x.chunk(size, 0)[rank] if sp else x
        if kind == "lnl":
            dy_loc, y_want = dy.chunk(size, -1)[rank], y_ref.chunk(size, -1)[rank]
        else:
            dy_loc = dy.chunk(size, 0)[rank] if sp else dy
            y_want = y_ref.chunk(size, 0)[rank] if sp else y_ref
        y_tp, dx_tp = run_step(tp, x_loc, dy_loc, group)
        tp_casts = rec.take()
        for label, (dim, parts) in label_specs.items():
            if parts > 1:  # pre-shard the reference to [gate_r; up_r] so check_exact compares as is
                for r in ref_casts[label]:
                    r["bytes"] = piece_shard(r["bytes"], dim, parts, rank, size)
        exact_specs = {
            label: (None if parts > 1 else dim) for label, (dim, parts) in label_specs.items()
        }
        compared += check_exact(ref_casts, tp_casts, exact_specs, rank, size, f"{where} {step}")
        assert_close(y_tp, y_want, RTOL, f"{where} y")
        assert_close(dx_tp, dx_ref.chunk(size, 0)[rank] if sp else dx_ref, RTOL, f"{where} dx")
        if sp:
            allreduce_sequence_parallel_grads(tp, group)  # norm (and fc2 bias) grads: own rows only
        ref_params = dict(ref.named_parameters())
        for name, p in tp.named_parameters():
            dim, parts = param_shards(kind, activation).get(name, (None, 1))
            want = ref_params[name].grad
            if dim is not None:
                want = piece_shard(want, dim, parts, rank, size)
            assert_close(p.grad, want, RTOL, f"{where} d{name}")
    return compared


def _layernorm_modules(rank: int, world: int, recipes: list[str], cases: list) -> int:
    rec = Recorder()
    compared = 0
    for kind, activation, sp in cases:
        for recipe_name in recipes:
            compared += compare(rec, kind, activation, sp, recipe_name, rank, world)
    return compared


CASES = [
    ("lnl", "", False),
    ("lnl", "", True),
    ("mlp", "gelu", False),
    ("mlp", "gelu", True),
    ("mlp", "swiglu", False),
    ("mlp", "swiglu", True),
]


def test_tp2_layernorm_linear_and_mlp_bit_identical_to_single_rank():
    counts = run_ranks(_layernorm_modules, 2, list(RECIPES), CASES)
    # per recipe and step: 3 casts for LayerNormLinear, 6 for LayerNormMLP
    assert counts == [3 * 2 * (2 * 3 + 4 * 6)] * 2


def test_tp4_layernorm_mlp_with_sequence_parallel_bit_identical_to_single_rank():
    cases = [("mlp", "swiglu", True), ("lnl", "", True)]
    counts = run_ranks(_layernorm_modules, 4, ["delayed", "current"], cases)
    assert counts == [2 * 2 * (6 + 3)] * 4
