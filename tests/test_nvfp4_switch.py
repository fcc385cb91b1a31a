"""Switching an NVFP4 model in one process: to and from every other recipe through `apply_recipe`
and a lazy `autocast(recipe=...)`, the precision guard's fallback moving one layer to MXFP8 or
bf16, and a compiled step (exact against the eager one, stochastic rounding included).

Each switch is checked against an independent expectation: after a switch, a step equals the step
of a model that ran the new recipe from the start with the same weights (recipes without state:
exact); the bf16 step equals the unconverted (autocast-off) model's.
"""

from __future__ import annotations

import pytest
import torch

import dist_quant as dq
from dist_quant import factories
from dist_quant.nvfp4 import NVFP4Quantizer
from dist_quant.quantizers import IdentityQuantizer, MXFP8Quantizer

S, B, HIDDEN, HEADS, FFN = 16, 2, 32, 2, 64  # S * B = 32 tokens: NVFP4 blocks them by 16

CHAIN = [
    dq.NVFP4BlockScaling(),
    dq.MXFP8BlockScaling(),
    dq.NVFP4BlockScaling(backward_override="dequantized"),
    dq.DelayedScaling(amax_history_len=4),
    dq.NVFP4BlockScaling(forward_override="high_precision"),
    dq.Float8CurrentScaling(),
    dq.NVFP4BlockScaling(stochastic_rounding=False),
    dq.Float8BlockScaling(),
    dq.NVFP4BlockScaling(seed=4),
    dq.HighPrecision(),
]


def _model(seed: int = 0, layers: int = 1) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(
        *[dq.TransformerLayer(HIDDEN, FFN, HEADS, name=f"layers.{i}") for i in range(layers)]
    )


def _step(model: torch.nn.Module, step: int, recipe=None) -> tuple[torch.Tensor, ...]:
    x = torch.randn(S, B, HIDDEN, generator=torch.Generator().manual_seed(step))
    model.zero_grad(set_to_none=True)
    with dq.autocast(recipe=recipe):
        y = model(x)
    y.square().mean().backward()
    return (y.detach(), *(p.grad for p in model.parameters()))


def _same(a: tuple, b: tuple) -> bool:
    return len(a) == len(b) and all(torch.equal(u, v) for u, v in zip(a, b))


@pytest.mark.parametrize("lazy", [False, True], ids=["apply_recipe", "autocast"])
def test_nvfp4_switches_to_and_from_every_recipe_like_a_model_that_ran_it_from_the_start(lazy):
    model = _model()
    for i, recipe in enumerate(CHAIN):
        if lazy:
            got = _step(model, i, recipe)
        else:
            dq.apply_recipe(model, recipe)
            got = _step(model, i)
        assert dq.current_recipe(model) == recipe
        fresh = _model()
        with torch.no_grad():  # the same weights, a recipe applied once
            for p, q in zip(fresh.parameters(), model.parameters()):
                p.copy_(q)
        dq.apply_recipe(fresh, recipe)
        want = _step(fresh, i)
        if isinstance(recipe, dq.DelayedScaling):
            continue  # its scales carry state; the other recipes restart from nothing
        assert _same(got, want), type(recipe).__name__
    # the chain ends on bf16: the unconverted model's step, bit for bit
    plain = _model()
    with torch.no_grad():
        for p, q in zip(plain.parameters(), model.parameters()):
            p.copy_(q)
    x = torch.randn(S, B, HIDDEN, generator=torch.Generator().manual_seed(99))
    with dq.autocast(enabled=False):
        y_plain = plain(x)
    with dq.autocast(recipe=CHAIN[-1] if lazy else None):
        y = model(x)
    assert torch.equal(y, y_plain)


@pytest.mark.parametrize("to, kind", [("mxfp8", MXFP8Quantizer), ("bf16", IdentityQuantizer)])
def test_the_guard_fallback_moves_one_nvfp4_layer_to_mxfp8_or_bf16(to, kind):
    model = _model(layers=3)
    dq.apply_recipe(model, dq.NVFP4BlockScaling())
    fallback = dq.CustomRecipe(factories.fp8_fallback(["layers.1"], to=to, base="nvfp4"))
    assert dq.recipe_from_dict(fallback.to_dict()).key() == fallback.key()  # what the guard sends
    dq.apply_recipe(model, fallback)
    for i, layer in enumerate(model):
        for m in layer.modules():
            rt = getattr(getattr(m, "quant_binding", None), "runtime", None)
            if rt is None or not m.owns_quantizers or m.module_type != "linear":
                continue
            want = kind if i == 1 else NVFP4Quantizer
            assert all(type(q) is want for q in rt.fwd_quantizers[:2]), (i, m.role_name)
    _step(model, 0)


def test_a_compiled_nvfp4_step_is_the_eager_step_with_stochastic_rounding():
    torch.manual_seed(0)
    eager, compiled = dq.Linear(HIDDEN, FFN), dq.Linear(HIDDEN, FFN)
    compiled.load_state_dict(eager.state_dict())
    for m in (eager, compiled):
        dq.apply_recipe(m, dq.NVFP4BlockScaling())
    step_fn = torch.compile(compiled)
    for step in range(2):  # the rounding offsets advance alike
        x = torch.randn(S * B, HIDDEN, generator=torch.Generator().manual_seed(step))
        outs = []
        for m, fn in ((eager, eager), (compiled, step_fn)):
            m.zero_grad(set_to_none=True)
            with dq.autocast():
                y = fn(x)
            y.square().mean().backward()
            outs.append((y.detach(), m.weight.grad))
        assert _same(*outs), step


def test_an_nvfp4_block_under_activation_checkpointing_recomputes_exactly():
    """The forward's casts have no stochastic rounding (only the output gradient's, cast once in
    the backward), so the recompute quantizes as the forward did: the step equals the plain one."""
    outs = []
    for checkpointed in (False, True):
        model = _model()
        dq.apply_recipe(model, dq.NVFP4BlockScaling())
        x = torch.randn(S, B, HIDDEN, generator=torch.Generator().manual_seed(5))
        with dq.autocast():
            y = dq.activation_checkpoint(model, x) if checkpointed else model(x)
        y.square().mean().backward()
        outs.append((y.detach(), *(p.grad for p in model.parameters())))
    assert _same(*outs)
