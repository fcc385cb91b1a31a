"""Tensor-parallel ranks plan identical named roles (issue 16), gloo on CPU, TP=2.

What it catches: names that depend on which module a rank happened to call first (two top-level
blocks called in sequence inside one autocast; a plain `Sequential` root), so that ranks of one TP
group build different quantizers for shards of one tensor, or disagree on the plan digest the
coordinator commits on; and a fresh TP model that cannot load its own checkpoint. Exact: role
lists and digests are compared for equality, rank against rank and against the expected names.
"""

from __future__ import annotations

import io

import pytest
import torch
import torch.distributed as dist
from harness import run_ranks
from tp_check import gather_objects

import dist_quant as dq
from dist_quant import checkpoint as ckpt
from dist_quant import factories

pytestmark = pytest.mark.distributed

SEQ, BATCH, HIDDEN, HEADS, FFN = 8, 2, 16, 2, 64
GEMMS = ("self_attention.qkv", "self_attention.proj", "mlp.fc1", "mlp.fc2")


def expected_names(prefix: str) -> set[str]:
    return {f"{prefix}.{g}" for g in GEMMS} | {f"{prefix}.self_attention.core_attention"}


class Recorder:
    def __init__(self) -> None:
        self.roles: list = []
        dq.quantizer_factory(key="tests.tp_role_names.recorder.v1")(self)

    def __call__(self, role):
        self.roles.append(None if role is None else (role.module_type, role.tensor_type, role.name))
        return factories.current_scaling(role)


def _plan_names(rank: int, world: int) -> dict:
    group = dist.group.WORLD
    torch.manual_seed(0)
    tl0 = dq.TransformerLayer(HIDDEN, FFN, HEADS, tp_group=group, name="tl0")
    tl1 = dq.TransformerLayer(HIDDEN, FFN, HEADS, tp_group=group, name="tl1")
    stack = torch.nn.Sequential(
        *(dq.TransformerLayer(HIDDEN, FFN, HEADS, tp_group=group) for _ in range(2))
    )
    rec = Recorder()
    recipe = dq.CustomRecipe(rec)
    x = torch.randn(SEQ, BATCH, HIDDEN, generator=torch.Generator().manual_seed(1))
    with dq.autocast(recipe=recipe, amax_reduction_group=group):
        y = stack(tl1(tl0(x)))  # three top-level calls, in sequence, in one region
    y.float().square().mean().backward()
    out = {
        "roles": rec.roles,
        "digests": [dq.plan_model(m, recipe).digest for m in (tl0, tl1, stack)],
    }
    # a fresh TP model resumes from its own checkpoint on every rank
    delayed = dq.DelayedScaling(amax_history_len=4)
    dq.apply_recipe(stack, delayed)
    with dq.autocast(amax_reduction_group=group):
        stack(x).float().square().mean().backward()
    buf = io.BytesIO()
    ckpt.save(buf, stack)
    buf.seek(0)
    fresh = torch.nn.Sequential(
        *(dq.TransformerLayer(HIDDEN, FFN, HEADS, tp_group=group) for _ in range(2))
    )
    ckpt.load(buf, fresh)
    out["resumed_digests"] = [dq.plan_model(m, delayed).digest for m in (stack, fresh)]
    out["gathered"] = gather_objects(out["digests"])
    return out


def test_tp_ranks_plan_identical_named_roles_for_blocks_called_in_sequence():
    results = run_ranks(_plan_names, 2)
    r0, r1 = results
    assert r0["roles"] == r1["roles"]
    names = {r[2] for r in r0["roles"] if r is not None}
    assert names == (
        expected_names("tl0") | expected_names("tl1") | expected_names("0") | expected_names("1")
    )
    assert r0["digests"] == r1["digests"] and r0["gathered"] == r1["gathered"]
    assert r0["resumed_digests"] == r1["resumed_digests"]
    assert r0["resumed_digests"][0] == r0["resumed_digests"][1]
