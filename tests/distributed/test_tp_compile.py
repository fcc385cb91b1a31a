"""Tensor-parallel blocks compiled one at a time (gloo on CPU, 2 ranks): identical TP blocks share
one graph (a TP layout names its module only in errors), and the compiled stack trains like its
eager twin on the same rank, bit for bit (`aot_eager`: the same kernels and collectives in the
same order), outputs, gradients and scaling buffers, under delayed scaling (amaxes reduced over
the TP group) and current scaling (TP-reduced amaxes).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from harness import run_ranks
from model_state import scaling_buffers

import dist_quant as dq

pytestmark = pytest.mark.distributed

SEQ, BATCH, HIDDEN, HEADS, FFN, DEPTH, STEPS = 8, 2, 32, 4, 128, 3, 3


def _stack(sequence_parallel: bool) -> torch.nn.ModuleList:
    torch.manual_seed(0)
    return torch.nn.ModuleList(
        dq.TransformerLayer(
            HIDDEN, FFN, HEADS, tp_group=dist.group.WORLD, sequence_parallel=sequence_parallel
        )
        for _ in range(DEPTH)
    )


def _compiled_twin(
    rank: int, world: int, recipe_name: str, sequence_parallel: bool
) -> tuple[int, list[str]]:
    """(graphs compiled, what differed between the compiled and the eager stack) on this rank."""
    graphs = 0
    aot_eager = torch._dynamo.lookup_backend("aot_eager")

    def counting(gm: torch.fx.GraphModule, example_inputs: list) -> object:
        nonlocal graphs
        graphs += 1
        return aot_eager(gm, example_inputs)

    # the same seed: equal weights (a TP group cannot be copied)
    eager, compiled = _stack(sequence_parallel), _stack(sequence_parallel)
    for model in (eager, compiled):
        dq.apply_recipe(model, dq.recipe_from_dict(recipe_name))
    for block in compiled:
        block.compile(backend=counting, fullgraph=True)
    differ = []
    for step in range(STEPS):
        outs = []
        for model in (eager, compiled):
            g = torch.Generator().manual_seed(700 + step)  # the same batch on every rank
            x = (torch.randn(SEQ, BATCH, HIDDEN, generator=g) * (1 + step)).requires_grad_()
            with dq.autocast(amax_reduction_group=dist.group.WORLD):
                y = x
                for block in model:
                    y = block(y)
            y.float().square().sum().backward()
            outs.append((y.detach(), x.grad))
        (y_e, dx_e), (y_c, dx_c) = outs
        differ += [f"step {step} output"] if not torch.equal(y_e, y_c) else []
        differ += [f"step {step} input grad"] if not torch.equal(dx_e, dx_c) else []
        for (name, p_e), p_c in zip(eager.named_parameters(), compiled.parameters(), strict=True):
            if not torch.equal(p_e.grad, p_c.grad):
                differ.append(f"step {step} {name}.grad")
            p_e.grad, p_c.grad = None, None
        buf_e, buf_c = scaling_buffers(eager), scaling_buffers(compiled)
        differ += [f"step {step} {k}" for k in buf_e if not torch.equal(buf_e[k], buf_c[k])]
    return graphs, differ


@pytest.mark.parametrize("sequence_parallel", [False, True], ids=["tp", "tp+sp"])
@pytest.mark.parametrize("recipe", ["delayed", "current"])
def test_tp_blocks_compiled_one_at_a_time_share_one_graph_and_match_eager(
    recipe: str, sequence_parallel: bool
) -> None:
    """With sequence parallelism each rank's sequence shard is cast and its FP8 bytes
    all-gathered inside the compiled graph (the scale check is an op there, not a host bool)."""
    results = run_ranks(_compiled_twin, 2, recipe, sequence_parallel, timeout_s=240)
    for rank, (graphs, differ) in enumerate(results):
        assert differ == [], f"rank {rank}: {differ}"
        assert graphs == 1, f"rank {rank}: {graphs} graphs"
