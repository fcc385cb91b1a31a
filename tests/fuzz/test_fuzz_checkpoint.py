"""Fuzzing checkpoint loads with corrupted state dicts (`dq.checkpoint.load_state_dict`).

A state dict of the `Zoo` model, taken after two delayed-scaling steps, is damaged in one place:
a field of a module's extra state dropped, added, or replaced by junk (or by a generated recipe
dict), a scaling buffer of another shape or dtype or not a tensor, the format or recipe key
rewritten, a parameter of another shape, a key removed or added. It is then loaded into the model
it came from and into a fresh model.

The contract (docs/checkpoint.md, "All or nothing"): every entry is validated before anything is
copied; a refused load raises ValueError (RecipeUpdateError is one) naming the state-dict key or
the module, and leaves the model exactly as before (`Snapshot`); that model's next step equals
its twin's bit for bit. Some damage is harmless by design (`recipe_key_repr` is only used in
messages, `pinned` may be either); such loads may succeed, and nothing more is asked of them.
"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from fuzz_models import Snapshot, Zoo, check_twins, fuzz_budget, train_step
from fuzz_recipes import JUNK, recipe_dicts
from hypothesis import given
from hypothesis import strategies as st

import dist_quant as dq

MODULES = ["fc", "norm_fc", "experts", "attn"]
FIELDS = ["format", "module", "recipe", "recipe_key", "recipe_key_repr", "recipe_note", "pinned"]
FIELDS += ["roles", "buffers"]


def trained_pair():
    pair = []
    for _ in range(2):
        model = Zoo(6)
        opt = torch.optim.SGD(model.parameters(), lr=1e-2)
        dq.apply_recipe(model, dq.DelayedScaling(amax_history_len=3))
        for step in range(2):
            train_step(model, opt, step)
        pair.append((model, opt))
    return pair


@st.composite
def damage(draw: st.DrawFn):
    """(description, function that damages a state dict in place)."""
    module = draw(st.sampled_from(MODULES))
    key = f"{module}._extra_state"
    kind = draw(
        st.sampled_from(
            ["drop", "add", "junk", "recipe", "buffer_shape", "buffer_dtype", "buffer_junk"]
            + ["format", "recipe_key", "whole", "param_shape", "drop_key", "extra_key"]
        )
    )
    field = draw(st.sampled_from(FIELDS))
    junk = draw(JUNK)
    recipe = draw(recipe_dicts())
    extra_name = draw(st.one_of(st.text(min_size=1, max_size=8), st.integers(0, 3)))

    def apply(sd: dict) -> None:
        es = sd[key]
        buffers = es["buffers"]
        name = sorted(buffers)[0]
        if kind == "drop":
            del es[field]
        elif kind == "add":
            es.setdefault(extra_name, junk)
        elif kind == "junk":
            es[field] = junk
        elif kind == "recipe":
            es["recipe"] = recipe
        elif kind == "buffer_shape":
            buffers[name] = torch.zeros(buffers[name].shape[0] + 1, *buffers[name].shape[1:])
        elif kind == "buffer_dtype":
            buffers[name] = buffers[name].double()
        elif kind == "buffer_junk":
            buffers[name] = junk
        elif kind == "format":
            es["format"] = "dist_quant.extra_state/0"
        elif kind == "recipe_key":
            es["recipe_key"] = "0" * 64
        elif kind == "whole":
            sd[key] = junk
        elif kind == "param_shape":
            sd[f"{module}.weight" if module != "experts" else "experts.weight0"] = torch.zeros(3, 3)
        elif kind == "drop_key":
            del sd[key]
        else:
            sd[f"{module}.extra"] = torch.zeros(1)

    return f"{key}: {kind} {field} -> {junk!r}", key, module, apply


@given(damage(), st.sampled_from(["the model it came from", "a fresh model"]))
@fuzz_budget(14)
def test_a_damaged_state_dict_is_refused_naming_the_entry_and_changes_nothing(case, target):
    what, key, module, apply = case
    (model, opt), (twin, twin_opt) = trained_pair()
    state = copy.deepcopy(model.state_dict())
    apply(state)
    into = model if target == "the model it came from" else Zoo(7)
    before = Snapshot(into)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            dq.checkpoint.load_state_dict(into, state, strict=True)
        except ValueError as e:
            message = str(e)
            named = key in message or f"'{module}" in message
            assert named, f"{what}: {message}"
        else:
            return  # harmless damage (see the module docstring)
    before.check(f"{what}, loaded into {target}")
    if into is model:
        check_twins(model, twin, train_step(model, opt, 2), train_step(twin, twin_opt, 2), what)


@pytest.mark.parametrize("target", ["the model it came from", "a fresh model"])
def test_an_undamaged_state_dict_loads_and_the_next_step_equals_the_twin(target):
    (model, opt), (twin, twin_opt) = trained_pair()
    into = model if target == "the model it came from" else Zoo(7)
    dq.checkpoint.load_state_dict(into, twin.state_dict(), strict=True)
    into_opt = torch.optim.SGD(into.parameters(), lr=1e-2)
    check_twins(into, twin, train_step(into, into_opt, 2), train_step(twin, twin_opt, 2), target)
