"""FSDP2 (`fully_shard` per layer + root) over dist-quant layers == DDP == one process, every recipe.

Each data-parallel rank trains on its own slice of the batch; the one-process reference runs the
same slices as separate microbatches inside one autocast region and one backward pass, then halves
the gradients. That is the same computation: every microbatch is quantized on its own (as on its
rank), the delayed-scaling amax of a step is the max over the microbatches (the ranks' all-reduced
MAX), and one update runs per direction. With two data-parallel ranks a gradient is `(g0 + g1) / 2`
everywhere (two-term fp32 addition commutes and halving is exact), so 1D FSDP2, DDP and the one
process agree bit for bit: outputs, input and parameter gradients, and the whole state dict
(weights and delayed-scaling scales and history) after every step.

2D (dp=2 x tp=2 on a DeviceMesh): FSDP2 x TP equals DDP x TP bit for bit (the same TP arithmetic,
the same two-term data-parallel mean); against one process the tolerance is test_tp_transformer's
1e-3, for its reason: TP's cross-rank fp32 sums reassociate additions (measured there at most 4e-7
of each tensor's largest value), which can also flip an FP8 cast sitting on a rounding boundary.
MXFP8 and block scaling also cut their blocks from the TP shard (a 128x128 weight block's scale
is the shard's, a 32-row column block of fused QKV spans other rows): measured at most 1.2e-6
here (2 steps, this model), so the same bound holds with a wide margin.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from fsdp_check import Stack, assert_equal_runs, rank_view, shard, train_dp, train_one_process
from harness import expect_error, run_ranks
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from tp_check import assert_close

import dist_quant as dq
from dist_quant.checkpoint import load_full_state_dict_into_shards
from dist_quant.parallel import allreduce_sequence_parallel_grads

pytestmark = pytest.mark.distributed

RTOL_TP = 1e-3


def _fsdp_1d(rank: int, world: int, recipes: list[str], checkpointed: bool) -> int:
    compared = 0
    for recipe in recipes:
        fsdp = Stack()
        fsdp.checkpointed = checkpointed
        shard(fsdp)
        ddp = nn.parallel.DistributedDataParallel(Stack())
        got = train_dp(fsdp, list(fsdp.named_parameters()), recipe, rank, world)
        want = train_dp(ddp, list(ddp.module.named_parameters()), recipe, rank, world)
        assert_equal_runs(got, want, f"FSDP2 vs DDP, {recipe}, rank {rank}")
        one = rank_view(train_one_process(Stack(), recipe, world), rank)
        assert_equal_runs(want, one, f"DDP vs one process, {recipe}, rank {rank}")
        compared += 1
    return compared


@pytest.mark.parametrize(
    "recipes", [["identity", "delayed", "current"], ["mxfp8", "block", "custom"]]
)
def test_fsdp2_equals_ddp_equals_one_process_bit_for_bit(recipes):
    assert run_ranks(_fsdp_1d, 2, recipes, False, timeout_s=240.0) == [len(recipes)] * 2


def test_fsdp2_with_activation_checkpoint_equals_ddp_and_one_process():
    assert run_ranks(_fsdp_1d, 2, ["delayed", "custom"], True, timeout_s=240.0) == [2, 2]


def _fsdp_2d(rank: int, world: int, recipes: list[str]) -> int:
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    tp_group, dp_group = mesh["tp"].get_group(), mesh["dp"].get_group()
    dp_rank, tp_rank = mesh["dp"].get_local_rank(), mesh["tp"].get_local_rank()
    compared = 0
    for recipe in recipes:
        ref = Stack()

        def tp_stack(ref=ref):
            model = Stack(tp_group)
            load_full_state_dict_into_shards(model, ref.state_dict(), tp_group)
            return model

        fsdp = shard(tp_stack(), mesh["dp"])
        ddp = nn.parallel.DistributedDataParallel(tp_stack(), process_group=dp_group)
        got = train_dp(fsdp, list(fsdp.named_parameters()), recipe, dp_rank, 2)
        want = train_dp(ddp, list(ddp.module.named_parameters()), recipe, dp_rank, 2)
        assert_equal_runs(got, want, f"FSDP2xTP vs DDPxTP, {recipe}, rank {rank}")
        one = rank_view(train_one_process(ref, recipe, 2), dp_rank)
        splits = {n: getattr(p, "tp_split", None) for n, p in ddp.module.named_parameters()}
        for step, (a, b) in enumerate(zip(want, one)):
            where = f"DDPxTP vs one process, {recipe}, rank {rank}, step {step}"
            assert_close(a[0], b[0], RTOL_TP, f"{where} y")
            assert_close(a[1], b[1], RTOL_TP, f"{where} dx")
            for n, g in a[2].items():
                assert_close(g, shard_of(b[2][n], splits[n], tp_rank), RTOL_TP, f"{where} d{n}")
        compared += 1
    return compared


def shard_of(t: torch.Tensor, split, tp_rank: int, tp: int = 2) -> torch.Tensor:
    """This TP rank's part of a full tensor: its chunk of each of `parts` stacked blocks."""
    if split is None:
        return t
    dim, parts = split
    return torch.cat([p.chunk(tp, dim)[tp_rank] for p in t.chunk(parts, dim)], dim)


@pytest.mark.parametrize(
    "recipes", [["identity", "delayed", "current", "custom"], ["mxfp8", "block"]]
)
def test_fsdp2_x_tp_equals_ddp_x_tp_and_one_process(recipes):
    assert run_ranks(_fsdp_2d, 4, recipes, timeout_s=400.0) == [len(recipes)] * 4


def _tp_checkpointed(rank: int, world: int, recipes: list[str]) -> int:
    for recipe in recipes:
        runs = []
        for checkpointed in (False, True):
            model = Stack(dist.group.WORLD)
            model.checkpointed = checkpointed
            runs.append(train_dp(model, list(model.named_parameters()), recipe, 0, 1))
        assert_equal_runs(runs[1], runs[0], f"TP with activation_checkpoint, {recipe}, rank {rank}")
    return len(recipes)


def test_tp_layers_under_activation_checkpoint_equal_the_plain_tp_run():
    """The recompute replays the TP layers' quantizers, amax reduction groups and collectives."""
    recipes = ["delayed", "current", "custom"]
    assert run_ranks(_tp_checkpointed, 2, recipes, timeout_s=240.0) == [3, 3]


def _sp_under_fsdp(rank: int, world: int) -> str:
    mesh = init_device_mesh("cpu", (1, 2), mesh_dim_names=("dp", "tp"))
    tp_group = mesh["tp"].get_group()
    model = nn.Sequential(dq.TransformerLayer(32, 64, 4, tp_group=tp_group, sequence_parallel=True))
    fully_shard(model, mesh=mesh["dp"])
    return expect_error(
        lambda: allreduce_sequence_parallel_grads(model, tp_group), NotImplementedError
    )


def test_sequence_parallel_grads_under_fsdp2_are_refused_not_left_partial():
    """FSDP2 drops the parameters' sequence_parallel marks: the all-reduce would sum nothing."""
    for message in run_ranks(_sp_under_fsdp, 2, timeout_s=60.0):
        assert "sequence-parallel" in message and "FSDP2" in message, message
