"""Tensor-parallel `TransformerLayer` against a single-rank reference, asymmetric delayed scaling,
and the amax collective count of a 12-layer TP model (gloo on CPU).

What it catches: heads split inconsistently between qkv, attention and proj (a rank attending with
another rank's keys), attention quantizers casting head shards with per-rank scales, residuals or
norms applied to the wrong sequence rows under SP, a TypeError or hang when delayed scaling exists
only in some forward slots (Transformer Engine crashed exactly there), and an amax reduction whose
number of collectives grows with depth.

Exactness. Casts of tensors that a TP rank computes with the same arithmetic as the reference
(the qkv input, all weights, the fc2 grad_output, the attention context) are bit-identical to the
reference's shard. Tensors downstream of a cross-rank sum (proj's reduction feeds the MLP, fc1's
input-gradient reduction feeds the attention backward) may differ from the single-rank values in
the last fp32 bit (fp32 addition is not associative), so for them the test checks that every rank
cast exactly the *logical* tensor (its shards put together) with one shared scale, re-deriving the
scale (current scaling) and the bytes from that tensor.

Tolerance of outputs and gradients: the differences are fp32 reassociation (measured: at most
4e-7 of each tensor's largest value, TP=2 and TP=4, all recipes, with and without SP). A last-bit
difference can also move one FP8 cast of an element sitting on a rounding boundary by one FP8 step
(2**-3 of that element under E4M3), which this data happens not to hit; 1e-3 leaves room for such a
flip while any real TP error (a wrong shard, a missed or doubled reduction) shows up at O(1). The
issue's target is 1e-2.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from harness import run_ranks
from tp_check import (
    RECIPES,
    CountMaxAllReduce,
    Recorder,
    assert_close,
    check_exact,
    check_logical,
    gather_objects,
    label_quantizers,
    run_step,
)

import dist_quant as dq
from dist_quant.checkpoint import load_full_state_dict_into_shards
from dist_quant.parallel import allreduce_sequence_parallel_grads

pytestmark = pytest.mark.distributed

SEQ, BATCH, HIDDEN, HEADS = 8, 2, 32, 4
FFN = 128  # FFN / tp a multiple of 32: see test_tp_layernorm for the CPU elementwise-kernel reason
RTOL = 1e-3

ATT, QKV, PROJ, MLP = (
    "layer.self_attention.core_attention",
    "layer.self_attention.qkv",
    "layer.self_attention.proj",
    "layer.mlp",
)


def exact_specs(sp: bool) -> dict:
    """label -> (shard dim, stacked parts): casts computed from bit-identical values."""
    seq = (0, 1) if sp else (None, 1)
    return {
        (QKV, "fwd", 0): seq,  # the input norm's output
        (QKV, "fwd", 1): (0, 3),  # [q; k; v] rows of this rank's heads
        (PROJ, "fwd", 0): (1, 1),  # attention context, this rank's heads
        (PROJ, "fwd", 1): (1, 1),
        (MLP, "fwd", 1): (0, 1),
        (MLP, "fwd", 4): (1, 1),
        (MLP, "bwd", 2): seq,  # fc2 grad_output: the layer's output gradient
    }


def logical_specs(sp: bool) -> dict:
    """label -> shard dim of casts downstream of a cross-rank sum (None: replicated)."""
    seq = 0 if sp else None
    return {
        (QKV, "bwd", 0): 1,
        (PROJ, "bwd", 0): seq,
        (MLP, "fwd", 0): seq,  # norm of the residual stream after proj's reduction
        (MLP, "fwd", 3): 1,
        (MLP, "bwd", 0): 1,
    }


def param_split(name: str) -> tuple[int, int] | None:
    if name.endswith("qkv.weight") or name.endswith("qkv.bias"):
        return (0, 3)
    if name.endswith("proj.weight") or name.endswith("fc2_weight"):
        return (1, 1)
    if name.endswith("fc1_weight") or name.endswith("fc1_bias"):
        return (0, 1)
    return None


def layer(tp: bool, sp: bool) -> dq.TransformerLayer:
    torch.manual_seed(0)
    kw = {"tp_group": dist.group.WORLD, "sequence_parallel": sp} if tp else {}
    return dq.TransformerLayer(HIDDEN, FFN, HEADS, name="layer", **kw)


def data(step: int):
    g = torch.Generator().manual_seed(step)
    return torch.randn(SEQ, BATCH, HIDDEN, generator=g), torch.randn(
        SEQ, BATCH, HIDDEN, generator=g
    ) * 1e-2


def compare(rec: Recorder, sp: bool, recipe_name: str, rank: int, size: int) -> tuple[int, int]:
    group = dist.group.WORLD
    ref, tp = layer(False, sp), layer(True, sp)
    load_full_state_dict_into_shards(tp, ref.state_dict(), group)
    for m in (ref, tp):
        dq.apply_recipe(m, RECIPES[recipe_name]())
        label_quantizers(m)
    where = f"layer{'+SP' if sp else ''} {recipe_name} TP={size}"
    exact, logical = exact_specs(sp), logical_specs(sp)
    n_exact = n_logical = 0
    for step in range(2):
        x, dy = data(step)
        y_ref, dx_ref = run_step(ref, x, dy, None)
        ref_casts = rec.take()
        seq = (lambda t: t.chunk(size, 0)[rank]) if sp else (lambda t: t)
        y_tp, dx_tp = run_step(tp, seq(x), seq(dy), group)
        tp_casts = rec.take()
        for label, (dim, parts) in exact.items():
            if parts > 1:
                for r in ref_casts[label]:
                    r["bytes"] = shard_pieces(r["bytes"], dim, parts, rank, size)
        n_exact += check_exact(
            ref_casts,
            tp_casts,
            {k: (None if p > 1 else d) for k, (d, p) in exact.items()},
            rank,
            size,
            f"{where} {step}",
        )
        everyone = gather_objects({k: tp_casts[k] for k in logical})
        n_logical += check_logical(everyone, logical, f"{where} {step}")
        assert_close(y_tp, seq(y_ref), RTOL, f"{where} y")
        assert_close(dx_tp, seq(dx_ref), RTOL, f"{where} dx")
        if sp:
            allreduce_sequence_parallel_grads(tp, group)
        ref_params = dict(ref.named_parameters())
        for name, p in tp.named_parameters():
            want = ref_params[name].grad
            split = param_split(name)
            if split is not None:
                want = shard_pieces(want, split[0], split[1], rank, size)
            assert_close(p.grad, want, RTOL, f"{where} d{name}")
    return n_exact, n_logical


def shard_pieces(t: torch.Tensor, dim: int, parts: int, rank: int, size: int) -> torch.Tensor:
    return torch.cat([p.chunk(size, dim)[rank] for p in t.chunk(parts, dim)], dim)


def _transformer(rank: int, world: int, recipes: list[str]) -> list:
    rec = Recorder()
    return [compare(rec, sp, name, rank, world) for sp in (False, True) for name in recipes]


def test_tp2_transformer_layer_casts_match_single_rank_with_and_without_sp():
    results = run_ranks(_transformer, 2, list(RECIPES))
    for per_rank in results:
        # per case: 2 steps x 7 exact casts; 2 steps x 5 logical casts x 2 ranks
        assert per_rank == [(14, 20)] * 6, per_rank


def test_tp4_transformer_layer_casts_match_single_rank():
    results = run_ranks(_transformer, 4, ["current"])
    assert all(r == [(14, 40)] * 2 for r in results)


@dq.quantizer_factory(key="tests.tp.attention_s_delayed")
def s_delayed_factory(role):
    """Delayed scaling only for attention's softmax output and the qkv GEMM's input; stateless
    current scaling for every other forward slot and everywhere in backward."""
    if role is None:  # a role-less slot (the factory gets None): as the E4M3 default below
        return dq.Float8CurrentScalingQuantizer(torch.float8_e4m3fn)
    if role.module_type == "dpa" and role.tensor_type == "s":
        return dq.DelayedScalingRequest(amax_history_len=8)
    if role.module_type == "linear" and role.tensor_type == "input" and role.name.endswith("qkv"):
        return dq.DelayedScalingRequest(amax_history_len=8)
    backward = role.tensor_type in ("grad_output", "do", "dp", "dqkv")
    return dq.Float8CurrentScalingQuantizer(torch.float8_e5m2 if backward else torch.float8_e4m3fn)


def _asymmetric(rank: int, world: int) -> dict:
    group = dist.group.WORLD
    model = torch.nn.ModuleList(
        [
            dq.TransformerLayer(HIDDEN, FFN, HEADS, tp_group=group, sequence_parallel=True)
            for _ in range(2)
        ]
    )
    torch.manual_seed(1)
    for p in model.parameters():  # one set of weights everywhere (shards of a seeded full model)
        torch.nn.init.normal_(p, std=0.05) if p.dim() > 1 else None
    dq.apply_recipe(model, dq.CustomRecipe(s_delayed_factory, fp8_dpa=True))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    losses, counts = [], {"fwd": [], "bwd": []}
    for step in range(4):
        g = torch.Generator().manual_seed(step)
        x = torch.randn(SEQ, BATCH, HIDDEN, generator=g).chunk(world, 0)[rank]
        with CountMaxAllReduce() as fwd_count:
            with dq.autocast(amax_reduction_group=group):
                h = x
                for blk in model:
                    h = blk(h)
                loss = (h.float() ** 2).mean()
        opt.zero_grad()
        with CountMaxAllReduce() as bwd_count:
            loss.backward()
        allreduce_sequence_parallel_grads(model, group)
        opt.step()
        losses.append(loss.item())
        counts["fwd"].append(fwd_count.packed)
        counts["bwd"].append(bwd_count.packed)
    s_states = [blk.self_attention.core_attention.quant_binding.runtime.fwd_state for blk in model]
    return {
        "losses": losses,
        "counts": counts,
        "s_scale": [float(st.scale[0]) for st in s_states],
        "s_hist": [float(st.amax_history[:, 0].max()) for st in s_states],
        "bwd_delayed": [
            bool(blk.mlp.quant_binding.runtime.delayed_groups(fwd=False)) for blk in model
        ],
    }


def test_asymmetric_delayed_scaling_trains_with_amax_reduction_on():
    results = run_ranks(_asymmetric, 2)
    for out in results:
        assert all(torch.isfinite(torch.tensor(out["losses"])))
        assert out["bwd_delayed"] == [False, False]  # no delayed slot in backward at all
        # every forward reduces once (after the first step's layout agreement); nothing to
        # reduce in backward, where the slots are stateless
        assert out["counts"]["fwd"][1:] == [1, 1, 1] and out["counts"]["bwd"] == [0] * 4
        # the softmax output lies in [0, 1] and its delayed scale follows the reduced history
        for scale, amax in zip(out["s_scale"], out["s_hist"]):
            assert 0.0 < amax <= 1.0 and scale == torch.tensor(448.0 / amax).item()
    assert results[0]["s_scale"] == results[1]["s_scale"]
    assert results[0]["s_hist"] == results[1]["s_hist"]


def _collective_count(rank: int, world: int) -> dict:
    group = dist.group.WORLD
    out = {}
    for depth in (2, 12):
        torch.manual_seed(0)
        model = torch.nn.Sequential(
            *[dq.TransformerLayer(16, 64, 2, tp_group=group) for _ in range(depth)]
        )
        dq.apply_recipe(model, dq.DelayedScaling(amax_history_len=4))
        counts = {"fwd": [], "bwd": []}
        for step in range(3):
            x = torch.randn(4, 2, 16, generator=torch.Generator().manual_seed(step))
            with CountMaxAllReduce() as fwd_count:
                with dq.autocast(amax_reduction_group=group):
                    y = model(x)
            with CountMaxAllReduce() as bwd_count:
                y.float().pow(2).mean().backward()
            counts["fwd"].append(fwd_count.calls)
            counts["bwd"].append(bwd_count.calls)
        out[depth] = counts
    return out


def test_twelve_layer_tp_step_issues_one_amax_allreduce_per_direction():
    """Every amax all-reduce is a MAX; the activation collectives of TP are SUMs. After the first
    step (which agrees on the buffer layout), a training step issues exactly one amax all-reduce
    per direction, for 2 layers and for 12."""
    for out in run_ranks(_collective_count, 2):
        for depth in (2, 12):
            assert out[depth]["fwd"][1:] == [1, 1], out
            assert out[depth]["bwd"][1:] == [1, 1], out
