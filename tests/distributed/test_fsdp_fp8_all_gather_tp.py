"""FP8 weight all-gather under FSDP2 x TP (a (dp=2, tp=2) mesh) and for GroupedLinear (2 ranks).

FSDP2 x TP: FSDP2 shards each rank's TP shard over dp; each rank casts its FSDP slice with the
scale the TP forward uses for the whole TP shard (current scaling: the amax all-reduced over the
FSDP group, then over the TP group, as the TP weight quantizer reduces it). So the gathered bytes
are the bytes of casting the TP shard with the full weight's scale (checked against torch's own
cast of the shard cut from the full weight, scale from the full weight's amax), and training
equals FSDP2 x TP without FP8 all-gather bit for bit (outputs, gradients, weights, delayed-scaling
state), with and without precomputed scales.

GroupedLinear: an expert quantizes its weight only on ranks that route tokens to it. Folding the
rank's shard amax into the delayed-scaling history would record the max over the shards of the
ranks with tokens only; the all-gather reduces the shards' amaxes and only a forward with tokens
folds the full weight's amax. The runs route no token to expert 1 on any rank and none to expert 0
on rank 1, and must equal FSDP2 without FP8 all-gather bit for bit, history included (an expert
without tokens gets zero gradients, as the high-precision path gives it).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from fsdp_check import (
    RECIPES,
    Stack,
    assert_equal_runs,
    batch,
    cpu_mesh,
    flat_state,
    full,
    local,
    shard,
    train_dp,
)
from harness import run_ranks
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

import dist_quant as dq
from dist_quant.checkpoint import load_full_state_dict_into_shards
from dist_quant.fsdp import enable_fp8_all_gather, precompute_fp8_weight_scales
from dist_quant.parallel import shard_of, tp_splits

pytestmark = pytest.mark.distributed

STEPS = range(3)
GEMM_WEIGHTS = ("qkv.weight", "proj.weight", "fc1_weight", "fc2_weight")


def _fsdp_tp(mesh, fp8_all_gather: bool) -> Stack:
    tp_group = mesh["tp"].get_group()
    model = Stack(tp_group)
    load_full_state_dict_into_shards(model, Stack().state_dict(), tp_group)
    if fp8_all_gather:
        assert enable_fp8_all_gather(model) == 8
    return shard(model, mesh["dp"])


def _tp_equal(rank: int, world: int, runs: list[tuple[str, bool]]) -> int:
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    dp_rank = mesh["dp"].get_local_rank()
    for recipe, precompute in runs:
        out = []
        for fp8_all_gather in (True, False):
            model = _fsdp_tp(mesh, fp8_all_gather)
            after = precompute_fp8_weight_scales if fp8_all_gather and precompute else None
            params = list(model.named_parameters())
            out.append(train_dp(model, params, recipe, dp_rank, 2, STEPS, after))
        where = f"FSDP2 x TP, FP8 vs high-precision all-gather, {recipe}, rank {rank}"
        assert_equal_runs(out[0], out[1], where)
    return len(runs)


def test_fp8_all_gather_under_fsdp2_x_tp_equals_the_high_precision_all_gather():
    runs = [("delayed", False), ("current", True), ("current", False), ("custom", True)]
    assert run_ranks(_tp_equal, 4, runs, timeout_s=400.0) == [len(runs)] * 4


def _tp_bytes(rank: int, world: int) -> int:
    """The gathered bytes of each TP shard under current scaling, against an independent cast."""
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    tp_rank, dp_rank = mesh["tp"].get_local_rank(), mesh["dp"].get_local_rank()
    reference = Stack().state_dict()
    model = _fsdp_tp(mesh, True)
    splits = tp_splits(model)
    dq.apply_recipe(model, RECIPES["current"]())
    seen = {}
    for key in (k for k in reference if k.endswith(GEMM_WEIGHTS)):
        owner, name = key.rsplit(".", 1)

        def capture(module, args, key=key, name=name):
            fp8 = getattr(module, name).float8_tensor()
            seen[key] = (fp8.data.view(torch.uint8).clone(), fp8.scale_inv)

        model.get_submodule(owner).register_forward_pre_hook(capture)
    with dq.autocast(amax_reduction_group=dist.group.WORLD):
        model(local(batch(0, 2)[0], dp_rank))
    assert len(seen) == 8
    for key, (got, scale_inv) in seen.items():
        whole = reference[key].float()
        scale = torch.tensor(448.0) / whole.abs().max()  # the whole weight's amax
        tp_shard = shard_of(whole, *splits[key], tp_rank, 2)
        want = (tp_shard * scale).clamp(-448.0, 448.0).to(torch.float8_e4m3fn).view(torch.uint8)
        assert torch.equal(scale_inv, torch.ones(1) / scale), key
        assert torch.equal(got, want), f"rank {rank}: gathered bytes of {key} differ"
    return len(seen)


def test_fp8_all_gather_of_a_tp_shard_equals_casting_it_with_the_whole_weights_scale():
    assert run_ranks(_tp_bytes, 4, timeout_s=240.0) == [8] * 4


EXPERTS, TOKENS, WIDTH = 3, 8, 32
SPLITS = {0: [4, 0, 4], 1: [0, 0, 8]}  # expert 1: no tokens anywhere; expert 0: none on rank 1


class Experts(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.experts = dq.GroupedLinear(EXPERTS, WIDTH, WIDTH)

    def forward(self, x, m_splits):
        return self.experts(x, m_splits)


def _train_experts(model, recipe: str, rank: int, after) -> list:
    dq.apply_recipe(model, RECIPES[recipe]())
    params = list(model.named_parameters())
    opt = torch.optim.SGD([p for _, p in params], lr=0.05)
    out = []
    for step in STEPS:
        g = torch.Generator().manual_seed(10 * step + rank)
        x = torch.randn(TOKENS, WIDTH, generator=g).requires_grad_(True)
        dy = torch.randn(TOKENS, WIDTH, generator=g)
        opt.zero_grad(set_to_none=True)
        with dq.autocast(amax_reduction_group=dist.group.WORLD):
            y = model(x, SPLITS[rank])
        y.backward(dy)
        grads = {n: full(p.grad).clone() for n, p in params}
        opt.step()
        if after is not None:
            after(model)
        out.append((y.detach(), x.grad, grads, flat_state(model.state_dict())))
    return out


def _experts_equal(rank: int, world: int, runs: list[tuple[str, bool]]) -> int:
    for recipe, precompute in runs:
        out = []
        for fp8_all_gather in (True, False):
            model = Experts()
            if fp8_all_gather:
                assert enable_fp8_all_gather(model) == EXPERTS
            fully_shard(model, mesh=cpu_mesh())
            after = precompute_fp8_weight_scales if fp8_all_gather and precompute else None
            out.append(_train_experts(model, recipe, rank, after))
        where = f"GroupedLinear, FP8 vs high-precision all-gather, {recipe}, rank {rank}"
        assert_equal_runs(out[0], out[1], where)
    return len(runs)


def test_fp8_all_gather_of_grouped_linear_experts_equals_the_high_precision_all_gather():
    runs = [("delayed", True), ("delayed", False), ("current", True), ("current", False)]
    assert run_ranks(_experts_equal, 2, runs, timeout_s=240.0) == [len(runs)] * 2


def _experts_compiled_equal(rank: int, world: int, recipes: list[str]) -> int:
    for recipe in recipes:
        out = []
        for compiled in (True, False):
            model = Experts()
            enable_fp8_all_gather(model)
            fully_shard(model, mesh=cpu_mesh())
            if compiled:
                model.compile(backend="aot_eager", fullgraph=True)
            after = precompute_fp8_weight_scales if recipe == "current" else None
            out.append(_train_experts(model, recipe, rank, after))
        where = f"GroupedLinear with FP8 all-gather, compiled vs eager, {recipe}, rank {rank}"
        assert_equal_runs(out[0], out[1], where)
    return len(recipes)


def test_compiled_grouped_linear_with_fp8_all_gather_and_tokenless_experts_equals_eager():
    """fullgraph over FP8-gathered expert weights, one expert without tokens on every rank and
    one without tokens on rank 1: the empty GEMM's zero gradients are traced too."""
    assert run_ranks(_experts_compiled_equal, 2, ["delayed", "current"], timeout_s=240.0) == [2, 2]


def _dcp_resume_tp(rank: int, world: int, path: str) -> int:
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    tp_group, dp_rank = mesh["tp"].get_group(), mesh["dp"].get_local_rank()
    after = precompute_fp8_weight_scales
    model = _fsdp_tp(mesh, True)
    params = list(model.named_parameters())
    train_dp(model, params, "current", dp_rank, 2, range(2), after)
    dq.checkpoint.dcp_save(model, path, tp_group=tp_group)
    want = train_dp(model, params, None, dp_rank, 2, range(2, 4), after)
    resumed = _fsdp_tp(mesh, True)
    dq.apply_recipe(resumed, RECIPES["current"]())  # plans the roles the checkpoint holds
    dq.checkpoint.dcp_load(resumed, path, tp_group=tp_group)
    got = train_dp(resumed, list(resumed.named_parameters()), None, dp_rank, 2, range(2, 4), after)
    assert_equal_runs(got, want, f"resumed FSDP2 x TP with FP8 all-gather, rank {rank}")
    return 1


def test_fp8_all_gather_fsdp2_x_tp_model_resumes_from_a_dcp_checkpoint_bit_for_bit(tmp_path):
    assert run_ranks(_dcp_resume_tp, 4, str(tmp_path / "ckpt"), timeout_s=300.0) == [1] * 4
