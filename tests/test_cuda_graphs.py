"""CUDA graphs of dist-quant steps replay the eager step bit for bit (GPU only).

Two copies of one model, one eager and one graphed, run the same batches; after every step their
outputs, gradients, parameters and delayed-scaling buffers must be equal. The bug this catches:
a replay runs no Python, so delayed scaling's amax enrolment (which slots ran, hence which scales
the reductions update) used to be skipped and the graphed model's scales froze at capture time,
while its outputs silently drifted from eager ones. Warm-up iterations of a capture must also not
leave their amaxes in the history.
"""

from __future__ import annotations

import copy

import pytest
import torch
from model_state import scaling_buffers

import dist_quant as dq

pytestmark = pytest.mark.gpu

RECIPES = ["bf16", "delayed", "current", "mxfp8", "block"]
STEPS = 6
TOKENS, HIDDEN = 64, 128  # multiples of 16 (scaled_mm) and 128 (block tiles)


def _models(recipe: str) -> tuple[torch.nn.Module, torch.nn.Module]:
    torch.manual_seed(0)
    eager = dq.Linear(HIDDEN, HIDDEN, params_dtype=torch.bfloat16, device="cuda")
    graphed = copy.deepcopy(eager)
    for m in (eager, graphed):
        dq.apply_recipe(m, dq.recipe_from_dict(recipe))
    return eager, graphed


def _batch(step: int) -> torch.Tensor:
    g = torch.Generator(device="cuda").manual_seed(10 + step)
    return torch.randn(TOKENS, HIDDEN, device="cuda", dtype=torch.bfloat16, generator=g) * (
        1 + step
    )


def _assert_same_state(eager: torch.nn.Module, graphed: torch.nn.Module, where: str) -> None:
    for (name, p_e), p_g in zip(eager.named_parameters(), graphed.parameters()):
        assert torch.equal(p_e, p_g), f"{where}: parameter {name} differs"
        if p_e.grad is not None or p_g.grad is not None:
            assert torch.equal(p_e.grad, p_g.grad), f"{where}: {name}.grad differs"
    b_e, b_g = scaling_buffers(eager), scaling_buffers(graphed)
    assert b_e.keys() == b_g.keys()
    for name in b_e:
        assert torch.equal(b_e[name], b_g[name]), f"{where}: {name} differs"


def _check_forward_backward(eager: torch.nn.Module, graphed: torch.nn.Module, batch) -> None:
    """Capture `graphed`'s forward+backward, then run both models over STEPS batches."""
    sample = batch(0).requires_grad_()
    graphed = dq.make_graphed_callables(graphed, (sample,))
    _assert_same_state(eager, graphed, "after capture")  # warm-ups left no amax behind
    for step in range(STEPS):
        x_e, x_g = batch(step).requires_grad_(), batch(step).requires_grad_()
        outs = []
        for model, x in ((eager, x_e), (graphed, x_g)):
            with dq.autocast():
                y = model(x)
            y.float().square().sum().backward()
            outs.append(y.detach().clone())
        torch.cuda.synchronize()
        assert torch.equal(outs[0], outs[1]), f"step {step}: outputs differ"
        assert torch.equal(x_e.grad, x_g.grad), f"step {step}: input gradients differ"
        _assert_same_state(eager, graphed, f"step {step}")
        for p in (*eager.parameters(), *graphed.parameters()):
            p.grad = None


@pytest.mark.parametrize("recipe", RECIPES)
def test_graphed_forward_backward_matches_eager_over_six_steps(recipe: str) -> None:
    _check_forward_backward(*_models(recipe), _batch)


FP8_ATTENTION = {
    "delayed": dq.DelayedScaling(amax_history_len=4, fp8_dpa=True),
    "current": dq.Float8CurrentScaling(fp8_dpa=True),
}


@pytest.mark.parametrize("recipe", FP8_ATTENTION)
def test_graphed_layer_with_fp8_attention_matches_eager_over_six_steps(recipe: str) -> None:
    """A Llama-style GQA layer whose attention runs the FP8 Triton kernels (head dim 64,
    causal): their launches, the cast of q/k/v/dO in their storage order and the attention
    roles' scales replay as the eager step runs them."""
    torch.manual_seed(0)
    eager = dq.TransformerLayer(
        256, 512, 4, num_gqa_groups=2, normalization="RMSNorm", activation="swiglu", bias=False,
        attn_input_format="bshd", params_dtype=torch.bfloat16, device="cuda",
    )  # fmt: skip
    graphed = copy.deepcopy(eager)
    for m in (eager, graphed):
        dq.apply_recipe(m, FP8_ATTENTION[recipe])

    def batch(step: int) -> torch.Tensor:
        g = torch.Generator(device="cuda").manual_seed(20 + step)
        x = torch.randn(2, 128, 256, device="cuda", dtype=torch.bfloat16, generator=g)
        return x * (1 + step)

    _check_forward_backward(eager, graphed, batch)


@pytest.mark.parametrize("recipe", RECIPES)
def test_graphed_training_step_matches_eager_over_six_steps(recipe: str) -> None:
    eager, graphed = _models(recipe)
    opt_e = torch.optim.SGD(eager.parameters(), lr=1e-3)
    opt_g = torch.optim.SGD(graphed.parameters(), lr=1e-3)
    static_x = _batch(0)

    def step(model, opt, x):
        opt.zero_grad(set_to_none=False)
        with dq.autocast():
            loss = model(x).float().square().mean()
        loss.backward()
        opt.step()
        return loss.detach()

    warmup = 3
    graphed_step = dq.GraphedStep(
        lambda: step(graphed, opt_g, static_x), graphed, warmup_steps=warmup
    )
    for _ in range(warmup):  # the graphed model's warm-up steps all saw batch 0
        step(eager, opt_e, _batch(0))
    _assert_same_state(eager, graphed, "after capture")
    for k in range(1, STEPS + 1):
        static_x.copy_(_batch(k))
        loss_g = graphed_step()
        loss_e = step(eager, opt_e, _batch(k))
        torch.cuda.synchronize()
        assert torch.equal(loss_e, loss_g), f"step {k}: losses differ"
        _assert_same_state(eager, graphed, f"step {k}")


def test_a_recipe_switch_invalidates_captured_graphs() -> None:
    part, whole_model = _models("delayed")
    graphed = dq.make_graphed_callables(part, (_batch(0).requires_grad_(),))
    opt = torch.optim.SGD(whole_model.parameters(), lr=1e-3)
    x = _batch(0)

    def step() -> None:
        opt.zero_grad(set_to_none=False)
        with dq.autocast():
            whole_model(x).float().sum().backward()
        opt.step()

    whole = dq.GraphedStep(step, whole_model, warmup_steps=1)
    for m in (part, whole_model):
        dq.apply_recipe(m, dq.Float8CurrentScaling())
    with pytest.raises(dq.GraphInvalidated, match="switched recipe"):
        with dq.autocast():
            graphed(_batch(1).requires_grad_())
    with pytest.raises(dq.GraphInvalidated, match="Capture again"):
        whole()
