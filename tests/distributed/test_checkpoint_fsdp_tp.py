"""DCP checkpoints of FSDP2 x TP and of FSDP2 on 4 ranks, resumed on 4 and resharded to 2 (gloo).

What these catch: FSDP2 turns a TP shard into a DTensor over the data-parallel mesh whose global
shape is the TP shard's, and drops the parameter's TP mark; saved as is, both TP ranks write their
different shards under one key, DCP keeps one, and the resumed TP rank 1 trains on rank 0's
weights. A delayed-scaling history lost or mixed up on the way shows in the next step's scales.

- 2x2 resume: a (dp=2, tp=2) job saves after step 2 and trains on to step 4; fresh FSDP2 x TP
  models on 4 new ranks load and must reproduce steps 2..3 bit for bit (outputs, input and
  parameter gradients, weights, delayed-scaling scales and history). Same ranks, same arithmetic.
- 2x2 -> 1x2: the same checkpoint loaded by a TP=2 job without FSDP2, which runs the two
  data-parallel slices as microbatches of one step; that is the 2x2 computation bit for bit (TP
  arithmetic unchanged, two-term data-parallel mean, amax MAX over microbatches = over replicas;
  see test_fsdp.py), so it must reproduce the 2x2 job's steps 2..3 exactly.
- 2x2 -> 2x1 (FSDP2 alone) and -> one process: the TP shards become whole tensors (fused QKV and
  fc1 included) and the per-TP-rank scaling rows, equal because amaxes were reduced over the
  world, one row. Loaded state must equal the 2x2 job's state at the save, reassembled from its TP
  shards, bit for bit; training on must equal one process loading the same checkpoint (a
  different computation from the TP one, so not compared with the 2x2 run). A TP checkpoint whose
  ranks kept different scaling rows is refused on another TP size, naming the buffer.
- dp=4 -> dp=2: a 4-rank FSDP2 job saves after step 2; 2 ranks load it (their weights and
  scaling state must equal the 4-rank job's at the save, bit for bit) and train on, which must
  equal one process loading the same checkpoint and running the 2 slices as microbatches.
The model's second layer is grouped-query (`model_of`): its qkv splits into unequal pieces, which
DCP saves whole (gathered over TP and the data-parallel ranks) and cuts on load, beside the first
layer's equal pieces saved in their parts view.
SGD without momentum keeps no optimizer state.
"""

from __future__ import annotations

import re

import fsdp_check
import pytest
import torch
import torch.distributed as dist
from fsdp_check import (
    RECIPES,
    assert_equal_runs,
    batch,
    flat_state,
    rank_view,
    shard,
    train_dp,
    train_one_process,
)
from harness import expect_error, run_ranks
from torch.distributed.device_mesh import init_device_mesh

import dist_quant as dq
from dist_quant.checkpoint import load_full_state_dict_into_shards
from dist_quant.parallel import tp_splits, unshard

pytestmark = pytest.mark.distributed


def model_of(tp_group=None) -> fsdp_check.Stack:
    """fsdp_check's model with a grouped-query second layer: its unequal qkv pieces take DCP's
    whole-tensor path under FSDP2 x TP, the first layer's equal [q; k; v] pieces the view path."""
    return fsdp_check.Stack(tp_group, gqa_second_layer=True)


SAVE_AT, END = 2, 4


def _fsdp_tp(tp_group, dp_mesh) -> fsdp_check.Stack:
    """TP shards cut from one full model: every TP rank's shard differs (a Stack built on each
    TP rank from the same seed would hold equal shards, which stay equal, and hide a collision)."""
    model = model_of(tp_group)
    load_full_state_dict_into_shards(model, model_of().state_dict(), tp_group)
    return shard(model, dp_mesh)


def _save_2x2_and_resume(rank: int, world: int, recipe: str, path: str) -> list:
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    tp_group, dp_rank = mesh["tp"].get_group(), mesh["dp"].get_local_rank()
    model = _fsdp_tp(tp_group, mesh["dp"])
    train_dp(model, list(model.named_parameters()), recipe, dp_rank, 2, range(SAVE_AT))
    dq.checkpoint.dcp_save(model, path, tp_group=tp_group)
    saved = flat_state(model.state_dict())  # this TP rank's shards, whole over dp
    want = train_dp(model, list(model.named_parameters()), None, dp_rank, 2, range(SAVE_AT, END))
    resumed = _fsdp_tp(tp_group, mesh["dp"])
    dq.checkpoint.dcp_load(resumed, path, tp_group=tp_group)
    params = list(resumed.named_parameters())
    got = train_dp(resumed, params, None, dp_rank, 2, range(SAVE_AT, END))
    assert_equal_runs(got, want, f"resumed FSDP2 x TP, {recipe}, rank {rank}")
    return saved, want, tp_splits(model)


def _resume_1x2(rank: int, world: int, path: str) -> list:
    model = model_of(dist.group.WORLD)
    dq.checkpoint.dcp_load(model, path, tp_group=dist.group.WORLD)
    return train_one_process(model, None, 2, range(SAVE_AT, END), group=dist.group.WORLD)


@pytest.mark.parametrize("recipe", ["delayed", "custom"])
def test_fsdp2_x_tp_checkpoint_resumes_bit_for_bit_and_reshards_to_1x2_2x1_and_one_process(
    recipe, tmp_path
):
    path = str(tmp_path / "ckpt")
    four = run_ranks(_save_2x2_and_resume, 4, recipe, path, timeout_s=300.0)
    two = run_ranks(_resume_1x2, 2, path, timeout_s=240.0)
    for rank in range(4):  # mesh (dp, tp): rank = 2 * dp_rank + tp_rank
        dp_rank, tp_rank = divmod(rank, 2)
        where = f"2x2 -> 1x2, {recipe}, rank {rank}"
        assert_equal_runs(four[rank][1], rank_view(two[tp_rank], dp_rank), where)
    whole = _whole_state([four[0][0], four[1][0]], four[0][2])
    dp_only = run_ranks(_resume_2x1, 2, path, timeout_s=240.0)
    (one,) = run_ranks(_resume_one, 1, path, timeout_s=240.0)
    for rank, (loaded, run) in enumerate(dp_only):
        assert loaded.keys() == whole.keys()
        for k, v in whole.items():
            assert torch.equal(loaded[k], v), f"2x2 -> 2x1, {recipe}: {k} differs after loading"
        assert_equal_runs(run, rank_view(one, rank), f"2x2 -> 2x1 vs one process, rank {rank}")


def _whole_state(tp_states: list[dict], splits: dict) -> dict:
    """The whole tensors of TP ranks' states: each split key's shards put back together (the
    inverse of shard_of), every other entry as TP rank 0 has it (identical on every TP rank)."""
    out = {}
    for k, v in tp_states[0].items():
        if k not in splits:
            assert all(torch.equal(s[k], v) for s in tp_states), f"{k} differs between TP ranks"
            out[k] = v
            continue
        out[k] = unshard([s[k] for s in tp_states], *splits[k])
    return out


def _resume_2x1(rank: int, world: int, path: str) -> tuple[dict, list]:
    model = shard(model_of())
    dq.checkpoint.dcp_load(model, path)
    loaded = flat_state(model.state_dict())
    params = list(model.named_parameters())
    return loaded, train_dp(model, params, None, rank, 2, range(SAVE_AT, END))


def _save_tp_unreduced(rank: int, world: int, path: str) -> None:
    model = model_of(dist.group.WORLD)
    load_full_state_dict_into_shards(model, model_of().state_dict(), dist.group.WORLD)
    dq.apply_recipe(model, RECIPES["delayed"]())
    x, dy = batch(0, 1)
    with pytest.warns(UserWarning, match="amax_reduction_group"), dq.autocast():
        model(x).backward(dy)  # no amax reduction: each TP rank's weight history is its shard's
    dq.checkpoint.dcp_save(model, path, tp_group=dist.group.WORLD)


def _load_refuses(rank: int, world: int, path: str) -> str:
    model = model_of()
    message = expect_error(lambda: dq.checkpoint.dcp_load(model, path), ValueError)
    assert dq.current_recipe(model) is None  # untouched
    return message


def test_tp_checkpoint_with_per_rank_scaling_rows_is_refused_on_another_tp_size(tmp_path):
    path = str(tmp_path / "ckpt")
    run_ranks(_save_tp_unreduced, 2, path, timeout_s=120.0)
    (message,) = run_ranks(_load_refuses, 1, path, timeout_s=120.0)
    assert "differs between the 2 tensor-parallel ranks" in message, message
    assert re.search(r"'layers\.\d\.\S+\._extra_state' buffer '(forward|backward)\.", message), (
        message
    )


def _save_dp4(rank: int, world: int, path: str) -> dict:
    model = shard(model_of())
    train_dp(model, list(model.named_parameters()), "delayed", rank, world, range(SAVE_AT))
    dq.checkpoint.dcp_save(model, path)
    return flat_state(model.state_dict())


def _resume_dp2(rank: int, world: int, path: str) -> tuple[dict, list]:
    model = shard(model_of())
    dq.checkpoint.dcp_load(model, path)
    loaded = flat_state(model.state_dict())
    return loaded, train_dp(
        model, list(model.named_parameters()), None, rank, 2, range(SAVE_AT, END)
    )


def _resume_one(rank: int, world: int, path: str) -> list:
    model = model_of()
    dq.checkpoint.dcp_load(model, path)
    return train_one_process(model, None, 2, range(SAVE_AT, END))


def test_fsdp2_checkpoint_of_4_ranks_reshards_to_2_ranks_and_one_process(tmp_path):
    path = str(tmp_path / "ckpt")
    saved = run_ranks(_save_dp4, 4, path, timeout_s=240.0)
    assert all(s.keys() == saved[0].keys() for s in saved)
    resumed = run_ranks(_resume_dp2, 2, path, timeout_s=240.0)
    (one,) = run_ranks(_resume_one, 1, path, timeout_s=240.0)
    for rank, (loaded, run) in enumerate(resumed):
        assert loaded.keys() == saved[0].keys()
        for k, v in saved[0].items():
            assert torch.equal(loaded[k], v), f"dp 4 -> 2, rank {rank}: {k} differs after loading"
        assert_equal_runs(run, rank_view(one, rank), f"dp 4 -> 2 vs one process, rank {rank}")
