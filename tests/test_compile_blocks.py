"""Identical blocks compiled one at a time (`block.compile(fullgraph=True)`, torchtitan's per-block
compile) share one graph: nothing a traced forward reads from a module's binding is specialised per
module (the enrolment key is a tensor input, names are only read on error paths), so a model of
any depth compiles once per recipe, not once per block, and never meets dynamo's recompile limit
(8 by default: a ninth block used to fail `fullgraph=True` outright).

Each test runs the compiled stack beside an eager twin (`aot_eager`: the same kernels and reduction
order) and compares outputs, gradients and every scaling buffer bit for bit: a shared graph that
enrolled or updated the wrong block's delayed-scaling state would show there.
"""

from __future__ import annotations

import copy

import pytest
import torch
from model_state import scaling_buffers
from torch import nn

import dist_quant as dq

pytestmark = pytest.mark.usefixtures("fresh_dynamo")

HIDDEN = 32  # a multiple of MXFP8's 32-element blocks
DEPTH = 9  # one more block than dynamo's default recompile limit
STEPS = 3  # a delayed-scaling scale first depends on an earlier step's amax at step 2


class CountingAotEager:
    """`aot_eager`, counting the graphs dynamo hands it."""

    def __init__(self) -> None:
        self.graphs = 0
        self._aot_eager = torch._dynamo.lookup_backend("aot_eager")

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: list) -> object:
        self.graphs += 1
        return self._aot_eager(gm, example_inputs)


class Stack(nn.Module):
    def __init__(self, checkpointed: bool) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layers = nn.ModuleList(
            dq.TransformerLayer(
                HIDDEN, 64, 2, normalization="RMSNorm", activation="swiglu", bias=False
            )
            for _ in range(DEPTH)
        )
        self.checkpointed = checkpointed

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = dq.activation_checkpoint(layer, x) if self.checkpointed else layer(x)
        return x


def _twins(recipe: dq.Recipe, checkpointed: bool) -> tuple[Stack, Stack, CountingAotEager]:
    eager = Stack(checkpointed)
    compiled = copy.deepcopy(eager)
    dq.apply_recipe(eager, recipe)
    dq.apply_recipe(compiled, recipe)
    backend = CountingAotEager()
    for layer in compiled.layers:
        layer.compile(backend=backend, fullgraph=True)
    return eager, compiled, backend


def _input(step: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(500 + step)
    return (torch.randn(4, 2, HIDDEN, generator=g) * (1 + step)).requires_grad_()


def _step_both(eager: Stack, compiled: Stack, step: int) -> None:
    """One training step of each twin; every output, gradient and scaling buffer equal."""
    outs = []
    for model in (eager, compiled):
        x = _input(step)
        with dq.autocast():
            y = model(x)
        y.float().square().sum().backward()
        outs.append((y.detach(), x.grad))
    (y_e, dx_e), (y_c, dx_c) = outs
    assert torch.equal(y_e, y_c), f"step {step}: outputs differ"
    assert torch.equal(dx_e, dx_c), f"step {step}: input gradients differ"
    for (name, p_e), p_c in zip(eager.named_parameters(), compiled.parameters(), strict=True):
        assert torch.equal(p_e.grad, p_c.grad), f"step {step}: {name}.grad differs"
        p_e.grad, p_c.grad = None, None
    buf_e, buf_c = scaling_buffers(eager), scaling_buffers(compiled)
    assert buf_e.keys() == buf_c.keys()
    for name in buf_e:
        assert torch.equal(buf_e[name], buf_c[name]), f"step {step}: {name} differs"


@pytest.mark.parametrize("recipe", ["delayed", "current", "bf16", "mxfp8", "block"])
def test_identical_blocks_compiled_one_at_a_time_share_one_graph_and_match_eager(recipe) -> None:
    eager, compiled, backend = _twins(dq.recipe_from_dict(recipe), checkpointed=False)
    for step in range(STEPS):
        _step_both(eager, compiled, step)
    assert backend.graphs == 1


@pytest.mark.parametrize(("recipe", "graphs"), [("delayed", 2), ("current", 1)])
def test_checkpointed_compiled_blocks_share_the_forward_and_the_recompute_graph(
    recipe: str, graphs: int
) -> None:
    """Under `dq.activation_checkpoint` each block's recompute replays its forward. Delayed
    scaling: one graph for the forward, one for the replay (which enrols nothing); current
    scaling enrols nothing either way, so the replay runs the forward's graph. Every block shares
    them."""
    eager, compiled, backend = _twins(dq.recipe_from_dict(recipe), checkpointed=True)
    for step in range(STEPS):
        _step_both(eager, compiled, step)
    assert backend.graphs == graphs


def test_a_switch_recompiles_the_shared_graph_once_and_every_block_runs_the_new_recipe() -> None:
    eager, compiled, backend = _twins(dq.DelayedScaling(amax_history_len=4), checkpointed=False)
    for step in range(2):
        _step_both(eager, compiled, step)
    for model in (eager, compiled):
        dq.apply_recipe(model, dq.Float8CurrentScaling())
    for step in range(2, 4):
        _step_both(eager, compiled, step)
    assert dq.current_recipe(compiled) == dq.Float8CurrentScaling()
    assert backend.graphs == 2
