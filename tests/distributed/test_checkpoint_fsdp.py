"""Checkpoint and resume of an FSDP2 dq model through torch.distributed.checkpoint (gloo on CPU).

What these catch: an FSDP2 state dict holds DTensor shards; a load that hands a rank's local shard
to the model where it expects the sharded parameter, or that loses the delayed-scaling history,
would not continue the run. A 2-rank FSDP2 job saves after step 2 and trains on to step 4; fresh
FSDP2 models on the same ranks resume from the checkpoint and must reproduce steps 2..3 bit for bit
(outputs, gradients, weights, scaling state), and so must one process resuming the same checkpoint
(resharded from 2 ranks to 1) and running the ranks' slices as microbatches (the computation
test_fsdp.py shows equals the 2-rank one bit for bit). SGD without momentum keeps no optimizer
state.
"""

from __future__ import annotations

import pytest
import torch
from fsdp_check import (
    HIDDEN,
    B,
    S,
    Stack,
    assert_equal_runs,
    rank_view,
    shard,
    train_dp,
    train_one_process,
)
from harness import run_ranks

import dist_quant as dq

pytestmark = pytest.mark.distributed

SAVE_AT, END = 2, 4


def fsdp_stack() -> Stack:
    return shard(Stack())


def wire_roles(model: Stack) -> None:
    """One forward with autocast off: MultiheadAttention wires its boundary roles (dpa/qkv, ...) on
    its first forward, and a checkpoint's roles only match a model that has (a fresh model loading
    a TransformerLayer checkpoint is the load path's business, issue 16)."""
    with dq.autocast(enabled=False):
        model(torch.zeros(S, B, HIDDEN))


def _save_and_resume(rank: int, world: int, recipe: str, path: str) -> list:
    model = fsdp_stack()
    train_dp(model, list(model.named_parameters()), recipe, rank, world, range(SAVE_AT))
    dq.checkpoint.dcp_save(model, path)
    want = train_dp(model, list(model.named_parameters()), None, rank, world, range(SAVE_AT, END))
    resumed = fsdp_stack()
    wire_roles(resumed)
    dq.checkpoint.dcp_load(resumed, path)
    got = train_dp(
        resumed, list(resumed.named_parameters()), None, rank, world, range(SAVE_AT, END)
    )
    assert_equal_runs(got, want, f"resumed FSDP2, {recipe}, rank {rank}")
    return want


def _resume_one_process(rank: int, world: int, path: str) -> list:
    model = Stack()
    wire_roles(model)
    dq.checkpoint.dcp_load(model, path)
    return train_one_process(model, None, 2, range(SAVE_AT, END))


@pytest.mark.parametrize("recipe", ["delayed", "custom"])
def test_fsdp2_checkpoint_resumes_bit_for_bit_and_reshards_to_one_rank(recipe, tmp_path):
    path = str(tmp_path / "ckpt")
    two = run_ranks(_save_and_resume, 2, recipe, path, timeout_s=240.0)
    (one,) = run_ranks(_resume_one_process, 1, path, timeout_s=240.0)
    for rank in range(2):
        assert_equal_runs(two[rank], rank_view(one, rank), f"2 -> 1 ranks, {recipe}, rank {rank}")
