"""Helpers of the FSDP2 tests: a two-layer dq model, the data-parallel and one-process training
loops whose results test_fsdp.py and test_checkpoint_fsdp.py compare (see test_fsdp.py for why they
agree bit for bit)."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

import dist_quant as dq
from dist_quant.recipes import Format

S, B, HIDDEN, FFN, HEADS = 8, 4, 32, 128, 4  # B per data-parallel rank; 32 tokens for MXFP8 blocks
STEPS = 2


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
    def __init__(self, tp_group=None, *, gqa_second_layer: bool = False) -> None:
        super().__init__()
        torch.manual_seed(0)
        # gqa_second_layer: that layer's attention is grouped-query (2 KV heads), so its fused qkv
        # is cut into unequal pieces under TP (which DCP saves whole)
        groups = (None, 2 if gqa_second_layer else None)
        self.layers = nn.ModuleList(
            dq.TransformerLayer(HIDDEN, FFN, HEADS, num_gqa_groups=g, tp_group=tp_group)
            for g in groups
        )
        self.checkpointed = False

    def forward(self, x):
        for layer in self.layers:
            x = dq.activation_checkpoint(layer, x) if self.checkpointed else layer(x)
        return x


def cpu_mesh() -> DeviceMesh:
    """Every rank, on the CPU: FSDP2's default mesh is the accelerator's, which would move these
    CPU models onto a GPU on a machine that has one."""
    return init_device_mesh("cpu", (dist.get_world_size(),))


def shard(model: Stack, mesh: DeviceMesh | None = None, **kwargs) -> Stack:
    """`fully_shard` per layer, then the root, over `mesh` (default: `cpu_mesh()`)."""
    mesh = mesh if mesh is not None else cpu_mesh()
    for layer in model.layers:
        fully_shard(layer, mesh=mesh, **kwargs)
    fully_shard(model, mesh=mesh, **kwargs)
    return model


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


def train_dp(
    model,
    params,
    recipe: str | None,
    dp_rank: int,
    dp: int,
    steps: range = range(STEPS),
    after_step=None,
) -> list:
    """Data-parallel steps on this rank's slice; per step (y, dx, grads by name, state).
    `recipe=None` keeps the model's (a resumed one); `after_step(model)` runs after each
    optimizer step."""
    if recipe is not None:
        dq.apply_recipe(model, RECIPES[recipe]())
    opt = torch.optim.SGD([p for _, p in params], lr=0.05)
    out = []
    for step in steps:
        x, dy = batch(step, dp)
        x = local(x, dp_rank).clone().requires_grad_(True)
        opt.zero_grad(set_to_none=True)
        with dq.autocast(amax_reduction_group=dist.group.WORLD):
            y = model(x)
        y.backward(local(dy, dp_rank))
        grads = {n: full(p.grad).clone() for n, p in params}
        opt.step()
        if after_step is not None:
            after_step(model)
        state = {k.removeprefix("module."): v for k, v in flat_state(model.state_dict()).items()}
        out.append((y.detach(), x.grad, grads, state))
    return out


def train_one_process(
    model, recipe: str | None, dp: int, steps: range = range(STEPS), group=None
) -> list:
    """The data-parallel ranks' slices as microbatches of one step; results sliced per rank.
    `group`: the amax reduction group (a TP model's TP group; None in one process)."""
    if recipe is not None:
        dq.apply_recipe(model, RECIPES[recipe]())
    params = list(model.named_parameters())
    opt = torch.optim.SGD([p for _, p in params], lr=0.05)
    out = []
    for step in steps:
        x_all, dy_all = batch(step, dp)
        xs = [local(x_all, r).clone().requires_grad_(True) for r in range(dp)]
        opt.zero_grad(set_to_none=True)
        with dq.autocast(amax_reduction_group=group):
            ys = [model(x) for x in xs]
        sum((y * local(dy_all, r)).sum() for r, y in enumerate(ys)).backward()
        for _, p in params:
            p.grad.mul_(1.0 / dp)  # the data-parallel mean
        grads = {n: p.grad.clone() for n, p in params}
        opt.step()
        out.append(
            ([y.detach() for y in ys], [x.grad for x in xs], grads, flat_state(model.state_dict()))
        )
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
