"""A freshly constructed model resumes from a checkpoint of every recipe, for every module type
(issue 16), with no `apply_recipe` first.

What these catch: boundary roles that only a forward wired (a fresh `MultiheadAttention` /
`TransformerLayer` refused its own checkpoint: "the module's quantizer roles ... differ"), names a
fresh model would take from which module runs first, and a refused load that leaves a fresh model
named. The original model is trained lazily (autocast's recipe, names from the first calls); the
fresh one is built with other weights and only loaded. Checked bit for bit: the state dict, the
recipe, and the next training step's output and gradients against the original's.
"""

from __future__ import annotations

import io
from collections.abc import Callable

import pytest
import torch
from torch import nn

import dist_quant as dq
from dist_quant import checkpoint as ckpt
from dist_quant import factories
from dist_quant.modules.base import QuantizedModule

S, B, HIDDEN, HEADS, FFN = 8, 2, 32, 2, 64
RECIPES = {
    "bf16": dq.recipe_from_dict("bf16"),
    "delayed": dq.DelayedScaling(amax_history_len=4),
    "current": dq.Float8CurrentScaling(),
    "mxfp8": dq.MXFP8BlockScaling(),
    "block": dq.Float8BlockScaling(),
    "custom": dq.CustomRecipe(factories.attention_current_linear_block, fp8_dpa=True),
}


def _gen(step: int) -> torch.Generator:
    return torch.Generator().manual_seed(100 + step)


def _hidden(step: int, shape=(S, B, HIDDEN)) -> torch.Tensor:
    return torch.randn(*shape, generator=_gen(step))


def _heads(step: int) -> tuple[torch.Tensor, ...]:
    g = _gen(step)
    return tuple(torch.randn(S, B, HEADS, HIDDEN // HEADS, generator=g) for _ in range(3))


# name -> (build(seed), inputs(step)); every module type, and the README's model
MODELS: dict[str, tuple[Callable[[], nn.Module], Callable[[int], tuple]]] = {
    "Linear": (lambda: dq.Linear(HIDDEN, HIDDEN), lambda s: (_hidden(s, (4, HIDDEN)),)),
    "LayerNormLinear": (
        lambda: dq.LayerNormLinear(HIDDEN, HIDDEN),
        lambda s: (_hidden(s, (4, HIDDEN)),),
    ),
    "LayerNormMLP": (lambda: dq.LayerNormMLP(HIDDEN, FFN), lambda s: (_hidden(s, (4, HIDDEN)),)),
    "GroupedLinear": (
        lambda: dq.GroupedLinear(2, HIDDEN, HIDDEN),
        lambda s: (_hidden(s, (6, HIDDEN)), [2, 4]),
    ),
    "DotProductAttention": (lambda: dq.DotProductAttention(HEADS, HIDDEN // HEADS), _heads),
    "MultiheadAttention": (lambda: dq.MultiheadAttention(HIDDEN, HEADS), lambda s: (_hidden(s),)),
    "TransformerLayer": (
        lambda: dq.TransformerLayer(HIDDEN, FFN, HEADS),
        lambda s: (_hidden(s),),
    ),
    "README": (
        lambda: nn.Sequential(*(dq.TransformerLayer(64, 256, 4) for _ in range(2))),
        lambda s: (_hidden(s, (S, B, 64)),),
    ),
}


def build(kind: str, seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return MODELS[kind][0]()


def step(model: nn.Module, kind: str, recipe: dq.Recipe, i: int) -> list[torch.Tensor]:
    """One forward and backward under autocast(recipe); returns the output and every gradient."""
    inputs = MODELS[kind][1](i)
    inputs = tuple(t.requires_grad_() if isinstance(t, torch.Tensor) else t for t in inputs)
    model.zero_grad(set_to_none=True)
    with dq.autocast(recipe=recipe):
        out = model(*inputs)
    out.square().mean().backward()
    grads = [t.grad for t in inputs if isinstance(t, torch.Tensor)]
    return [out.detach(), *grads, *(p.grad for p in model.parameters())]


def assert_same_state(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for k, va in a.items():
        vb = b[k]
        if isinstance(va, torch.Tensor):
            assert torch.equal(va, vb), k
        else:  # a dist-quant extra state: plain fields and buffer copies
            assert {f: v for f, v in va.items() if f != "buffers"} == {
                f: v for f, v in vb.items() if f != "buffers"
            }, k
            assert va["buffers"].keys() == vb["buffers"].keys(), k
            for name, t in va["buffers"].items():
                assert torch.equal(t, vb["buffers"][name]), (k, name)


def trained(kind: str, recipe: dq.Recipe, steps: int = 1) -> nn.Module:
    model = build(kind, seed=0)
    for i in range(steps):
        step(model, kind, recipe, i)
    return model


@pytest.mark.parametrize("recipe_name", list(RECIPES))
@pytest.mark.parametrize("kind", list(MODELS))
def test_fresh_model_loads_a_checkpoint_and_continues_bit_identically(kind, recipe_name):
    recipe = RECIPES[recipe_name]
    model = trained(kind, recipe)
    buf = io.BytesIO()
    ckpt.save(buf, model, extra={"step": 2})
    buf.seek(0)
    fresh = build(kind, seed=1)  # other weights; never planned, never run
    assert ckpt.load(buf, fresh)["extra"] == {"step": 2}
    assert dq.current_recipe(fresh).key() == recipe.key()
    assert_same_state(model.state_dict(), fresh.state_dict())
    for a, b in zip(step(model, kind, recipe, 2), step(fresh, kind, recipe, 2)):
        assert torch.equal(a, b)


@pytest.mark.parametrize("recipe_name", ["delayed", "custom"])
def test_readme_model_round_trips_through_dcp_into_a_fresh_model(tmp_path, recipe_name):
    recipe = RECIPES[recipe_name]
    model = trained("README", recipe)
    with pytest.warns(UserWarning, match="single process"):  # DCP without a process group
        ckpt.dcp_save(model, tmp_path / "dcp", extra={"step": 2})
    fresh = build("README", seed=1)
    extra = {"step": -1}
    with pytest.warns(UserWarning, match="single process"):
        ckpt.dcp_load(fresh, tmp_path / "dcp", extra=extra)
    assert extra == {"step": 2}
    assert_same_state(model.state_dict(), fresh.state_dict())
    for a, b in zip(step(model, "README", recipe, 2), step(fresh, "README", recipe, 2)):
        assert torch.equal(a, b)


def test_readme_model_loads_through_torchs_own_load_state_dict():
    """`nn.Module.load_state_dict` calls each block's `set_extra_state` before its children's: the
    block plans its own subtree (names and boundary roles) from the checkpoint's name."""
    recipe = RECIPES["delayed"]
    model = trained("README", recipe)
    fresh = build("README", seed=1)
    fresh.load_state_dict(model.state_dict())
    assert_same_state(model.state_dict(), fresh.state_dict())
    for a, b in zip(step(model, "README", recipe, 2), step(fresh, "README", recipe, 2)):
        assert torch.equal(a, b)


def test_refused_load_leaves_a_fresh_model_unplanned_and_unnamed():
    sd = trained("README", RECIPES["delayed"]).state_dict()
    key = "1.mlp._extra_state"
    sd[key] = {**sd[key], "buffers": {**sd[key]["buffers"]}}
    sd[key]["buffers"]["forward.scale"] = torch.ones(7)  # another shape: a corrupted entry
    fresh = build("README", seed=1)
    modules = [m for m in fresh.modules() if isinstance(m, dq.TransformerLayer)]
    mhas = [m.self_attention for m in modules]
    with pytest.raises(ValueError, match=r"'1.mlp._extra_state'.*forward.scale"):
        ckpt.load_state_dict(fresh, sd)
    dq_modules = [m for m in fresh.modules() if isinstance(m, QuantizedModule)]
    assert all(not m.is_planned and m.role_name == "" for m in dq_modules)
    assert all(m.qkv.output_quantizer_role is None for m in mhas)
    assert dq.current_recipe(fresh) is None
    # ...and it is then planned by its structure as if nothing had happened
    dq.apply_recipe(fresh, RECIPES["current"])
    assert fresh[1].mlp.role_name == "1.mlp"
    assert mhas[1].qkv.output_quantizer_role == dq.QuantizerRole(
        "dpa", "qkv", "1.self_attention.core_attention"
    )
