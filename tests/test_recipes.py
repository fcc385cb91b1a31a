"""Recipes: validation, semantic keys (incl. fallback keys across processes), JSON round trip."""

import copy
import dataclasses
import functools
import json
import os
import pickle
import re
import subprocess
import sys
import types
import warnings

import pytest
import torch

from dist_quant import recipes
from dist_quant.factory_keys import quantizer_factory
from dist_quant.formats import Format
from dist_quant.recipes import (
    CustomRecipe,
    DelayedScaling,
    Float8BlockScaling,
    Float8CurrentScaling,
    MXFP8BlockScaling,
    NVFP4BlockScaling,
    recipe_from_dict,
    recipe_from_json,
)

RECIPE_CLASSES = [
    DelayedScaling,
    Float8CurrentScaling,
    MXFP8BlockScaling,
    Float8BlockScaling,
    NVFP4BlockScaling,
    CustomRecipe,
]


# Module-level callables: importable by "module:qualname", so recipes holding them serialise.
@quantizer_factory(key="test_recipes.factory_a")
def factory_a(role):
    return None


@quantizer_factory(key="test_recipes.factory_b")
def factory_b(role):
    return None


@quantizer_factory(key="test_recipes.newest_amax")
def newest_amax(amax_history):
    return amax_history[0]


@quantizer_factory(key="test_recipes.halve_scale")
def halve_scale(amax, scale, fp8_max, recipe):
    return scale / 2


def _base(cls):
    return cls(qfactory=factory_a) if cls is CustomRecipe else cls()


# field -> (changed value, extra kwargs the changed value needs on both sides)
FIELD_CHANGES = {
    "margin": (1, {}),
    "fp8_format": (Format.E4M3, {}),
    "amax_history_len": (16, {}),
    "amax_compute_algo": ("most_recent", {}),
    "scaling_factor_compute_algo": (halve_scale, {}),
    "reduce_amax": (False, {}),
    "fp8_dpa": (True, {}),
    "fp8_mha": (True, {"fp8_dpa": True}),
    "use_power_2_scales": (None, {}),  # flipped below: defaults differ per recipe
    "amax_epsilon": (1e-6, {}),
    "qfactory": (factory_b, {}),
    "qfactory_key": ("explicit.v1", {}),
    "forward_override": ("high_precision", {}),
    "backward_override": ("dequantized", {}),
    "input_rht": (None, {}),
    "grad_output_rht": (None, {}),
    "weight_2d": (None, {}),
    "stochastic_rounding": (None, {}),
    "seed": (7, {}),
}
# fields with a single valid value (Transformer Engine supports E4M3 only there)
# (and delayed scaling refuses a high-precision forward: it would cast forward operands in the
# backward, after the forward amax reduction)
SINGLE_VALUED = {
    (MXFP8BlockScaling, "fp8_format"),
    (Float8BlockScaling, "fp8_format"),
    (DelayedScaling, "forward_override"),
}


@pytest.mark.parametrize("cls", RECIPE_CLASSES, ids=lambda c: c.__name__)
def test_every_field_change_changes_the_key(cls):
    for f in dataclasses.fields(cls):
        if (cls, f.name) in SINGLE_VALUED:
            continue
        assert f.name in FIELD_CHANGES, f"no changed value for {cls.__name__}.{f.name}"
        value, extra = FIELD_CHANGES[f.name]
        base = dataclasses.replace(_base(cls), **extra)
        if value is None:
            value = not getattr(base, f.name)
        changed = dataclasses.replace(base, **{f.name: value})
        assert changed.key() != base.key(), f"{cls.__name__}.{f.name} does not reach the key"
        assert dataclasses.replace(base).key() == base.key()


@pytest.mark.parametrize("cls", [MXFP8BlockScaling, Float8BlockScaling], ids=lambda c: c.__name__)
@pytest.mark.parametrize("fmt", [Format.HYBRID, Format.E5M2])
def test_block_recipes_accept_only_e4m3(cls, fmt):
    with pytest.raises(ValueError, match=f"{cls.__name__}.fp8_format"):
        cls(fp8_format=fmt)


def test_key_is_hashable_and_names_the_recipe_type():
    key = DelayedScaling(fp8_format=Format.E4M3).key()
    assert key[0] == "DelayedScaling"
    assert Format.E4M3.value in key[1]
    assert hash(key) == hash(DelayedScaling(fp8_format=Format.E4M3).key())
    assert Float8CurrentScaling(amax_epsilon=0).key() == Float8CurrentScaling().key()


def test_recipes_are_frozen_and_a_bypassed_freeze_still_changes_the_key():
    recipe = DelayedScaling()
    before = recipe.key()
    with pytest.raises(dataclasses.FrozenInstanceError):
        recipe.margin = 3  # type: ignore[misc]
    object.__setattr__(recipe, "margin", 3)
    assert recipe.key() != before


def test_a_recipe_computes_its_key_once(monkeypatch):
    # autocast(recipe=...) asks for the key on every entry; a factory's key can be a digest of
    # its code and captures
    real = recipes.callable_key
    asked = []
    monkeypatch.setattr(recipes, "callable_key", lambda fn: asked.append(fn) or real(fn))
    recipe = CustomRecipe(factory_a)
    assert recipe.key() is recipe.key()
    assert asked == [factory_a]


def test_the_kept_key_stays_out_of_equality_hashing_copies_and_pickles():
    recipe = DelayedScaling(margin=1, amax_compute_algo=newest_amax)
    key = recipe.key()
    twin = DelayedScaling(margin=1, amax_compute_algo=newest_amax)  # no key asked yet
    assert recipe == twin and hash(recipe) == hash(twin) and repr(recipe) == repr(twin)
    assert recipe.to_dict() == twin.to_dict()
    copies = [pickle.loads(pickle.dumps(recipe)), copy.copy(recipe), copy.deepcopy(recipe)]
    for other in [*copies, dataclasses.replace(recipe)]:
        assert other == recipe and other.key() == key
    assert dataclasses.replace(recipe, margin=2).key() != key


def test_explicit_factory_key_replaces_the_factory_and_does_not_warn():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert CustomRecipe(factory_a).key() != CustomRecipe(factory_b).key()
        same = [CustomRecipe(f, qfactory_key="mine.v3").key() for f in (factory_a, factory_b)]
        closure = CustomRecipe(_captures(object()), qfactory_key="mine.v3").key()
    assert same[0] == same[1] == closure


def _captures(value):
    def factory(role):
        return value

    return factory


def _with_default(role, limit=1.0):
    return limit


def test_unkeyed_closure_key_follows_the_captured_value_and_warns_once_per_key():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        f = _captures(0.123456)  # values unique to this test: the warning is once per process
        first = CustomRecipe(f).key()
        assert CustomRecipe(f).key() == first
        assert CustomRecipe(_captures(0.123456)).key() == first  # equal capture, new closure
        assert CustomRecipe(_captures(0.654321)).key() != first
    fallback = [w for w in caught if "fallback key from" in str(w.message)]
    assert len(fallback) == 2 and all(w.category is UserWarning for w in fallback)


def test_fallback_key_sees_tensors_defaults_partials_and_bound_objects():
    @dataclasses.dataclass
    class Picker:
        threshold: float

        def __call__(self, role):
            return self.threshold

        def pick(self, role):
            return self.threshold

    def key(fn):
        return CustomRecipe(fn).key()

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        t = torch.tensor([1.0, 2.0])
        assert key(_captures(t)) == key(_captures(t.clone()))
        assert key(_captures(t)) != key(_captures(torch.tensor([1.0, 3.0])))
        assert key(_captures(t)) != key(_captures(t.double()))
        assert key(_with_default) != key(functools.partial(_with_default, limit=2.0))
        assert key(functools.partial(_with_default, limit=2.0)) != key(
            functools.partial(_with_default, limit=3.0)
        )
        assert key(Picker(1.0)) == key(Picker(1.0)) != key(Picker(2.0))
        assert key(Picker(1.0).pick) != key(Picker(2.0).pick)


def test_keyed_decorator_defaults_to_the_import_path_and_refuses_local_functions():
    def plain(role):
        return None

    plain.__qualname__ = "plain"  # as if defined at module level
    assert quantizer_factory(plain) is plain
    assert CustomRecipe(plain).key()[1][0] == f"{__name__}:plain"

    def local(role):
        return None

    with pytest.raises(ValueError, match="explicit key"):
        quantizer_factory()(local)
    with pytest.raises(ValueError, match="non-empty str"):
        quantizer_factory(key="")


PROBE_SOURCE = """
import torch
from dist_quant import recipes
from dist_quant.factory_keys import quantizer_factory
from dist_quant.formats import Format
from dist_quant.recipes import (CustomRecipe, DelayedScaling, Float8BlockScaling,
                                Float8CurrentScaling, MXFP8BlockScaling)

@quantizer_factory(key="probe.keyed")
def keyed(role):
    return None

def make_unkeyed(threshold, names):
    table = {"fc1": 1.5, "proj": -2, "qkv": None}
    def factory(role):
        if role.name in names or role.tensor_type in {"input", "weight", "grad_output", "s"}:
            return threshold * table.get(role.name, 0)
        return None
    return factory

def halve(amax, scale, fp8_max, recipe):
    return scale / 2

def recipes():
    return [
        DelayedScaling(),
        DelayedScaling(margin=2, fp8_format=Format.E4M3, amax_compute_algo="most_recent",
                       scaling_factor_compute_algo=halve),
        Float8CurrentScaling(amax_epsilon=1e-12),
        MXFP8BlockScaling(),
        Float8BlockScaling(use_power_2_scales=False),
        CustomRecipe(qfactory=keyed),
        CustomRecipe(qfactory=make_unkeyed(0.5, frozenset({"x", "yy", "zzz", "w"})), fp8_dpa=True),
        CustomRecipe(qfactory=make_unkeyed(torch.arange(4.0), {"layers.0.fc1", "layers.1.fc1"})),
    ]
"""
PROBE_RUNNER = (
    "import json, sys, types, warnings\n"
    "warnings.simplefilter('ignore')\n"
    "mod = types.ModuleType('dq_key_probe')\n"
    "exec(compile(sys.stdin.read(), '<dq_key_probe>', 'exec'), mod.__dict__)\n"
    "print(json.dumps([repr(r.key()) for r in mod.recipes()]))\n"
)


def test_keys_are_equal_across_processes_with_different_hash_seeds():
    procs = []
    for seed in ("1", "4242"):
        env = dict(os.environ, PYTHONHASHSEED=seed)
        procs.append(
            subprocess.Popen(
                [sys.executable, "-c", PROBE_RUNNER],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
                env=env,
            )
        )
    outputs = [p.communicate(PROBE_SOURCE, timeout=120) for p in procs]
    for p, (_, err) in zip(procs, outputs, strict=True):
        assert p.returncode == 0, err
    mod = types.ModuleType("dq_key_probe")
    exec(compile(PROBE_SOURCE, "<dq_key_probe>", "exec"), mod.__dict__)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        here = [repr(r.key()) for r in mod.recipes()]
    assert len(set(here)) == len(here)  # the probe's recipes are all different
    for out, _ in outputs:
        assert json.loads(out) == here


def _variants():
    return [
        DelayedScaling(),
        DelayedScaling(
            margin=3,
            fp8_format=Format.E4M3,
            amax_history_len=7,
            amax_compute_algo=newest_amax,
            scaling_factor_compute_algo=halve_scale,
            reduce_amax=False,
            fp8_dpa=True,
            fp8_mha=True,
        ),
        DelayedScaling(amax_compute_algo="most_recent"),
        Float8CurrentScaling(),
        Float8CurrentScaling(Format.E4M3, use_power_2_scales=True, amax_epsilon=1e-8, fp8_dpa=True),
        MXFP8BlockScaling(),
        Float8BlockScaling(),
        Float8BlockScaling(use_power_2_scales=False),
        NVFP4BlockScaling(),
        NVFP4BlockScaling(
            input_rht=False,
            grad_output_rht=False,
            weight_2d=False,
            stochastic_rounding=False,
            seed=11,
            reduce_amax=False,
            backward_override="dequantized",
        ),
        Float8CurrentScaling(forward_override="high_precision"),
        DelayedScaling(backward_override="high_precision"),
        CustomRecipe(factory_a),
        CustomRecipe(factory_b, qfactory_key="b.v2", fp8_format=Format.E4M3, fp8_dpa=True),
    ]


@pytest.mark.parametrize("recipe", _variants(), ids=repr)
def test_every_recipe_round_trips_through_json(recipe):
    text = json.dumps(recipe.to_dict())
    back = recipe_from_json(text)
    assert back == recipe and back.key() == recipe.key()
    assert json.loads(text)["type"] == type(recipe).__name__


def test_callables_serialise_as_import_paths_and_import_back():
    d = CustomRecipe(factory_a).to_dict()
    assert d["qfactory"] == f"{__name__}:factory_a"
    assert d["fp8_format"] == "HYBRID"
    d["qfactory"] = "dist_quant.recipes:recipe_from_dict"  # any importable callable
    assert recipe_from_dict(d).qfactory is recipe_from_dict


@pytest.mark.parametrize(
    "recipe, field",
    [
        (CustomRecipe(_captures(1)), "CustomRecipe.qfactory"),
        (CustomRecipe(lambda role: None), "CustomRecipe.qfactory"),
        (CustomRecipe(functools.partial(_with_default, limit=2.0)), "CustomRecipe.qfactory"),
        (DelayedScaling(amax_compute_algo=lambda h: h[0]), "DelayedScaling.amax_compute_algo"),
    ],
)
def test_unimportable_callables_refuse_to_serialise_naming_the_field(recipe, field):
    with pytest.raises(ValueError, match=re.escape(field)):
        recipe.to_dict()


@pytest.mark.parametrize(
    "text, cls",
    [
        ("delayed", DelayedScaling),
        ('"current"', Float8CurrentScaling),
        ("  MXFP8 ", MXFP8BlockScaling),
        ("block", Float8BlockScaling),
        ('{"type": "DelayedScaling", "margin": 2}', DelayedScaling),
    ],
)
def test_recipe_from_json_takes_names_and_objects(text, cls):
    recipe = recipe_from_json(text)
    assert type(recipe) is cls
    assert recipe.key() == (cls(margin=2) if "margin" in text else cls()).key()


@pytest.mark.parametrize(
    "payload, message",
    [
        ({"margin": 1}, 'no "type" field'),
        ({"type": "Fancy"}, "unknown recipe type 'Fancy'; valid types: DelayedScaling"),
        ({"type": "DelayedScaling", "margn": 1}, "no field 'margn'; valid fields: margin"),
        ({"type": "CustomRecipe"}, "CustomRecipe.qfactory is required"),
        ({"type": "DelayedScaling", "fp8_format": "E4M4"}, "fp8_format: unknown format 'E4M4'"),
        ({"type": "DelayedScaling", "margin": "1"}, "DelayedScaling.margin"),
        ({"type": "CustomRecipe", "qfactory": "no_such_mod_xyz:f"}, "cannot import module"),
        ({"type": "CustomRecipe", "qfactory": "dist_quant.recipes:nope"}, "does not exist"),
        ({"type": "CustomRecipe", "qfactory": "dist_quant.recipes:__all__"}, "not a callable"),
        ({"type": "CustomRecipe", "qfactory": "factory_a"}, "import path"),
        (
            {"type": "DelayedScaling", "amax_compute_algo": "mean"},
            "DelayedScaling.amax_compute_algo",
        ),
        (
            "fp4",
            "unknown built-in recipe 'fp4'; valid: delayed, current, mxfp8, block, nvfp4, bf16",
        ),
        (["delayed"], "must be a dict or a built-in name"),
    ],
)
def test_recipe_from_dict_errors_name_the_field(payload, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        recipe_from_dict(payload)


def test_recipe_from_json_rejects_broken_json():
    with pytest.raises(ValueError, match="not valid JSON"):
        recipe_from_json('{"type": "DelayedScaling",')
    with pytest.raises(ValueError, match="empty recipe"):
        recipe_from_json("  ")


@pytest.mark.parametrize(
    "cls, kwargs, field",
    [
        (DelayedScaling, {"fp8_format": "HYBRID"}, "fp8_format"),
        (DelayedScaling, {"fp8_format": Format.E5M2}, "fp8_format"),
        (DelayedScaling, {"margin": -1}, "margin"),
        (DelayedScaling, {"margin": 1.0}, "margin"),
        (DelayedScaling, {"amax_history_len": 0}, "amax_history_len"),
        (DelayedScaling, {"amax_compute_algo": "mean"}, "amax_compute_algo"),
        (DelayedScaling, {"scaling_factor_compute_algo": "x"}, "scaling_factor_compute_algo"),
        (DelayedScaling, {"reduce_amax": None}, "reduce_amax"),
        (DelayedScaling, {"fp8_mha": True}, "fp8_mha"),
        (DelayedScaling, {"fp8_dpa": "yes"}, "fp8_dpa"),
        (Float8CurrentScaling, {"fp8_format": Format.E5M2}, "fp8_format"),
        (Float8CurrentScaling, {"amax_epsilon": -1.0}, "amax_epsilon"),
        (Float8CurrentScaling, {"amax_epsilon": float("nan")}, "amax_epsilon"),
        (Float8CurrentScaling, {"use_power_2_scales": 1}, "use_power_2_scales"),
        (Float8CurrentScaling, {"fp8_mha": True}, "fp8_mha"),
        (Float8BlockScaling, {"use_power_2_scales": "no"}, "use_power_2_scales"),
        (CustomRecipe, {"qfactory": 3}, "qfactory"),
        (CustomRecipe, {"qfactory": factory_a, "qfactory_key": ""}, "qfactory_key"),
        (CustomRecipe, {"qfactory": factory_a, "qfactory_key": 5}, "qfactory_key"),
        (CustomRecipe, {"qfactory": factory_a, "fp8_format": "E4M3"}, "fp8_format"),
        (CustomRecipe, {"qfactory": factory_a, "fp8_mha": True}, "fp8_mha"),
    ],
)
def test_construction_errors_name_the_field(cls, kwargs, field):
    with pytest.raises(ValueError, match=re.escape(f"{cls.__name__}.{field}")):
        cls(**kwargs)
