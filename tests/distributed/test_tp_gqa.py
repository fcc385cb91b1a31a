"""Tensor-parallel grouped-query attention (TP=2, gloo on CPU) against the unsharded layer.

What it catches: a rank given query heads whose KV heads live on the other rank (the fused qkv
weight cut as three equal pieces, or the KV heads not split with their query groups), KV heads
replicated instead of split, a checkpoint shard loader that cuts the uneven [q; k; v] pieces
wrongly, attention quantizers casting KV-head shards with per-rank scales, and a layer that
accepts KV heads the TP size does not divide.

A TransformerLayer with 8 query and 2 KV heads runs on one rank and as TP=2 shards loaded from its
state dict (`load_full_state_dict_into_shards`), with and without sequence parallelism, under
current scaling with FP8 attention (`fp8_dpa`) and delayed scaling (FP8 linears, SDPA with KV
broadcast). The qkv weight and the attention context are cast from bit-identical values on both
sides, so their TP casts are the reference casts' shards byte for byte. Outputs and gradients
differ by fp32 reassociation of the row-parallel sums only; the tolerance (1e-3 of each tensor's
largest value) is test_tp_transformer's, whose docstring gives the measurement behind it.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from harness import run_ranks
from tp_check import Recorder, assert_close, check_exact, label_quantizers, run_step

import dist_quant as dq
from dist_quant.checkpoint import load_full_state_dict_into_shards
from dist_quant.parallel import allreduce_sequence_parallel_grads, shard_of, tp_splits

pytestmark = pytest.mark.distributed

SEQ, BATCH, HEADS, KV_HEADS, HEAD_DIM, FFN = 8, 2, 8, 2, 4, 128
HIDDEN = HEADS * HEAD_DIM
QKV_PARTS = (HEADS // KV_HEADS, 1, 1)  # q rows, k rows, v rows
QKV, PROJ = "layer.self_attention.qkv", "layer.self_attention.proj"
RECIPES = {
    "current+fp8_dpa": lambda: dq.Float8CurrentScaling(fp8_dpa=True),
    "delayed": lambda: dq.DelayedScaling(amax_history_len=4),
}
RTOL = 1e-3


def layer(group, sp: bool) -> dq.TransformerLayer:
    torch.manual_seed(0)
    kw = {"tp_group": group, "sequence_parallel": sp} if group is not None else {}
    return dq.TransformerLayer(
        HIDDEN,
        FFN,
        HEADS,
        num_gqa_groups=KV_HEADS,
        normalization="RMSNorm",
        activation="swiglu",
        name="layer",
        **kw,
    )


def _compare(rank: int, world: int) -> dict:
    group = dist.group.WORLD
    with pytest.raises(ValueError, match=r"'bad'.*num_gqa_groups=1 .* tensor-parallel size 2"):
        dq.TransformerLayer(HIDDEN, FFN, HEADS, num_gqa_groups=1, tp_group=group, name="bad")
    rec = Recorder()
    compared = {}
    for sp in (False, True):
        for recipe_name, recipe in RECIPES.items():
            ref, tp = layer(None, sp), layer(group, sp)
            splits = tp_splits(tp)
            assert splits["self_attention.qkv.weight"] == (0, QKV_PARTS)
            load_full_state_dict_into_shards(tp, ref.state_dict(), group)
            for m in (ref, tp):
                dq.apply_recipe(m, recipe())
                label_quantizers(m)
            where = f"{recipe_name}{' +SP' if sp else ''} rank {rank}"
            seq = (lambda t: t.chunk(world, 0)[rank]) if sp else (lambda t: t)
            n = 0
            for i in range(2):
                g = torch.Generator().manual_seed(i)
                x = torch.randn(SEQ, BATCH, HIDDEN, generator=g)
                dy = torch.randn(SEQ, BATCH, HIDDEN, generator=g) * 1e-2
                y_ref, dx_ref = run_step(ref, x, dy, None)
                ref_casts = rec.take()
                y_tp, dx_tp = run_step(tp, seq(x), seq(dy), group)
                tp_casts = rec.take()
                for r in ref_casts[(QKV, "fwd", 1)]:  # the weight: its [q; k; v] pieces' shards
                    r["bytes"] = shard_of(r["bytes"], 0, QKV_PARTS, rank, world)
                specs = {(QKV, "fwd", 1): None, (PROJ, "fwd", 0): 1}  # context: own heads
                n += check_exact(ref_casts, tp_casts, specs, rank, world, f"{where} step {i}")
                assert_close(y_tp, seq(y_ref), RTOL, f"{where} y")
                assert_close(dx_tp, seq(dx_ref), RTOL, f"{where} dx")
                if sp:
                    allreduce_sequence_parallel_grads(tp, group)
                ref_params = dict(ref.named_parameters())
                for name, p in tp.named_parameters():
                    want = ref_params[name].grad
                    if name in splits:
                        want = shard_of(want, *splits[name], rank, world)
                    assert_close(p.grad, want, RTOL, f"{where} d{name}")
            compared[where.rsplit(" rank", 1)[0]] = n
    return compared


def test_tp2_gqa_layer_matches_the_unsharded_layer_with_and_without_sp():
    for per_rank in run_ranks(_compare, 2):
        # 2 steps x 2 exact casts (qkv weight, attention context) per case
        assert per_rank == {
            "current+fp8_dpa": 4,
            "delayed": 4,
            "current+fp8_dpa +SP": 4,
            "delayed +SP": 4,
        }, per_rank


def mha(group) -> dq.MultiheadAttention:
    torch.manual_seed(3)
    return dq.MultiheadAttention(HIDDEN, HEADS, num_gqa_groups=KV_HEADS, tp_group=group, name="a")


def _dcp_round_trip(rank: int, world: int, path: str) -> None:
    """Save a TP=2 grouped-query block through DCP, load it at TP=2 and without TP."""
    group = dist.group.WORLD
    full = mha(None)
    saved = mha(group)
    load_full_state_dict_into_shards(saved, full.state_dict(), group)
    recipe = dq.DelayedScaling(amax_history_len=4)
    dq.apply_recipe(saved, recipe)
    with dq.autocast(amax_reduction_group=group):  # scaling rows equal on both ranks
        saved(torch.randn(SEQ, BATCH, HIDDEN, generator=torch.Generator().manual_seed(7)))
    dq.checkpoint.dcp_save(saved, path, tp_group=group)
    resumed, whole = mha(group), mha(None)
    dq.checkpoint.dcp_load(resumed, path, tp_group=group)
    dq.checkpoint.dcp_load(whole, path)
    for name, want in full.state_dict().items():
        if name.endswith("_extra_state"):
            continue
        mine = resumed.state_dict()[name]
        split = tp_splits(saved).get(name)
        expect = want if split is None else shard_of(want, *split, rank, world)
        assert torch.equal(mine, expect), f"rank {rank} TP=2 {name}"
        assert torch.equal(whole.state_dict()[name], want), f"rank {rank} whole {name}"
    assert torch.equal(
        resumed.core_attention.quant_binding.runtime.fwd_state.amax_history,
        saved.core_attention.quant_binding.runtime.fwd_state.amax_history,
    )


def test_dcp_saves_uneven_qkv_pieces_whole_and_loads_them_at_tp2_and_without_tp(tmp_path):
    """The [q; k; v] rows of a grouped-query qkv have no view in which a rank's shard is one
    block: DCP must hold the whole tensor (any other layout keeps one rank's rows under the key),
    and a TP rank must get back exactly its shard, a single process the whole."""
    run_ranks(_dcp_round_trip, 2, str(tmp_path / "ckpt"))
