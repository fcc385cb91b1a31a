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
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from harness import run_ranks
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor
from tp_check import assert_close

import dist_quant as dq
from dist_quant.parallel import load_full_state_dict_into_shards
from dist_quant.recipes import Format

pytestmark = pytest.mark.distributed

S, B, HIDDEN, FFN, HEADS = 8, 4, 32, 128, 4  # B per data-parallel rank; 32 tokens for MXFP8 blocks
STEPS = 2
RTOL_TP = 1e-3


@dq.quantizer_factory(key="tests.fsdp.identity")
def identity_factory(role):
    return dq.IdentityQuantizer()


@dq.quantizer_factory(key="tests.fsdp.mixed")
def mixed_factory(role):
    if role is not None and role.tensor_type == "weight":
        return dq.DelayedScalingRequest(fp8_format=Format.E4M3, amax_history_len=4)
    if role is not None and role.tensor_type in ("input", "grad_output"):
        fmt = torch.float8_e5m2 if role.tensor_type == "grad_output" else torch.float8_e4m3fn
        return dq.Float8CurrentScalingQuantizer(fmt)
    return dq.IdentityQuantizer()


RECIPES = {
    "identity": lambda: dq.CustomRecipe(identity_factory),
    "delayed": lambda: dq.DelayedScaling(amax_history_len=4),
    "current": lambda: dq.Float8CurrentScaling(),
    "mxfp8": lambda: dq.MXFP8BlockScaling(),
    "block": lambda: dq.Float8BlockScaling(),
    "custom": lambda: dq.CustomRecipe(mixed_factory),
}


class Stack(nn.Module):
    def __init__(self, tp_group=None) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layers = nn.ModuleList(
            dq.TransformerLayer(HIDDEN, FFN, HEADS, tp_group=tp_group) for _ in range(2)
        )
        self.checkpointed = False

    def forward(self, x):
        for layer in self.layers:
            x = dq.activation_checkpoint(layer, x) if self.checkpointed else layer(x)
        return x


def batch(step: int, dp: int):
    g = torch.Generator().manual_seed(100 + step)
    x = torch.randn(S, B * dp, HIDDEN, generator=g)
    return x, torch.randn(S, B * dp, HIDDEN, generator=g)


def local(t: torch.Tensor, dp_rank: int) -> torch.Tensor:
    return t[:, dp_rank * B : (dp_rank + 1) * B]


def full(t):
    return t.full_tensor() if isinstance(t, DTensor) else t


def flat_state(obj, prefix=""):
    """Every tensor of a state dict (full tensors; extra states are nested dicts), by path."""
    if isinstance(obj, (torch.Tensor, DTensor)):
        return {prefix: full(obj).detach().clone()}
    out = {}
    if isinstance(obj, dict):
        for k, v in obj.items():
            out.update(flat_state(v, f"{prefix}.{k}" if prefix else str(k)))
    return out


def train_dp(model, params, recipe: str, dp_rank: int, dp: int) -> list:
    """Data-parallel steps on this rank's slice; per step (y, dx, grads by name, state)."""
    dq.apply_recipe(model, RECIPES[recipe]())
    opt = torch.optim.SGD([p for _, p in params], lr=0.05)
    out = []
    for step in range(STEPS):
        x, dy = batch(step, dp)
        x = local(x, dp_rank).clone().requires_grad_(True)
        opt.zero_grad(set_to_none=True)
        with dq.autocast(amax_reduction_group=dist.group.WORLD):
            y = model(x)
        y.backward(local(dy, dp_rank))
        grads = {n: full(p.grad).clone() for n, p in params}
        opt.step()
        state = {k.removeprefix("module."): v for k, v in flat_state(model.state_dict()).items()}
        out.append((y.detach(), x.grad, grads, state))
    return out


def train_one_process(model, recipe: str, dp: int) -> list:
    """The data-parallel ranks' slices as microbatches of one step; results sliced per rank."""
    dq.apply_recipe(model, RECIPES[recipe]())
    params = list(model.named_parameters())
    opt = torch.optim.SGD([p for _, p in params], lr=0.05)
    out = []
    for step in range(STEPS):
        x_all, dy_all = batch(step, dp)
        xs = [local(x_all, r).clone().requires_grad_(True) for r in range(dp)]
        opt.zero_grad(set_to_none=True)
        with dq.autocast():
            ys = [model(x) for x in xs]
        sum((y * local(dy_all, r)).sum() for r, y in enumerate(ys)).backward()
        for _, p in params:
            p.grad.mul_(1.0 / dp)  # the data-parallel mean
        grads = {n: p.grad.clone() for n, p in params}
        opt.step()
        out.append(([y.detach() for y in ys], [x.grad for x in xs], grads, flat_state(model.state_dict())))
    return out


def assert_equal_runs(got: list, want: list, where: str) -> None:
    for step, (a, b) in enumerate(zip(got, want, strict=True)):
        for what, u, v in (("y", a[0], b[0]), ("dx", a[1], b[1])):
            assert torch.equal(u, v), f"{where} step {step}: {what} differs"
        assert a[2].keys() == b[2].keys()
        for n in b[2]:
            assert torch.equal(a[2][n], b[2][n]), f"{where} step {step}: grad {n} differs"
        assert a[3].keys() == b[3].keys(), f"{where}: state keys differ"
        for k in b[3]:
            assert torch.equal(a[3][k], b[3][k]), f"{where} step {step}: state {k} differs"


def rank_view(ref: list, dp_rank: int) -> list:
    return [(ys[dp_rank], dxs[dp_rank], g, st) for ys, dxs, g, st in ref]


def _fsdp_1d(rank: int, world: int, recipes: list[str], checkpointed: bool) -> int:
    compared = 0
    for recipe in recipes:
        fsdp = Stack()
        fsdp.checkpointed = checkpointed
        for layer in fsdp.layers:
            fully_shard(layer)
        fully_shard(fsdp)
        ddp = nn.parallel.DistributedDataParallel(Stack())
        got = train_dp(fsdp, list(fsdp.named_parameters()), recipe, rank, world)
        want = train_dp(ddp, list(ddp.module.named_parameters()), recipe, rank, world)
        assert_equal_runs(got, want, f"FSDP2 vs DDP, {recipe}, rank {rank}")
        one = rank_view(train_one_process(Stack(), recipe, world), rank)
        assert_equal_runs(want, one, f"DDP vs one process, {recipe}, rank {rank}")
        compared += 1
    return compared


@pytest.mark.parametrize("recipes", [["identity", "delayed", "current"], ["mxfp8", "block", "custom"]])
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

        def tp_stack():
            model = Stack(tp_group)
            load_full_state_dict_into_shards(model, ref.state_dict(), tp_group)
            return model

        fsdp = tp_stack()
        for layer in fsdp.layers:
            fully_shard(layer, mesh=mesh["dp"])
        fully_shard(fsdp, mesh=mesh["dp"])
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


def test_fsdp2_x_tp_equals_ddp_x_tp_and_one_process():
    recipes = ["identity", "delayed", "current", "custom"]
    assert run_ranks(_fsdp_2d, 4, recipes, timeout_s=400.0) == [len(recipes)] * 4

