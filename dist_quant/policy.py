"""Declarative per-layer policies: which recipe each quantizer slot runs, from a JSON/YAML file.

A policy is written as a recipe dict of type "policy" (`recipe_from_dict` reads it; so do
`dist-quant switch policy.yaml`, demo schedules and `dist-quant roles --recipe policy.yaml`):

    type: policy
    num_layers: 8          # needed by "last N"; a module in layers.8 or beyond is refused
    default: delayed       # what a slot no rule matches runs
    rules:
      - name: edges        # optional; "rules[i]" otherwise
        layers: [first 1, last 1]
        recipe: bf16
      - modules: ["*.attention.wo", "output"]
        recipe: {type: Float8CurrentScaling, use_power_2_scales: true}
      - tensor_types: [grad_output]
        modules: ["layers.*.feed_forward.*"]
        recipe: current

A rule's selectors, all optional but at least one given, must all hold for a slot:
- `modules`: globs (`fnmatch`, case-sensitive; `*` crosses dots) on the module path, the slot's
  role name (`layers.3.attention.wqkv`); one glob or a list, any may match;
- `layers`: the `layers.N` index in that path, as "first K", "last K" (with `num_layers`),
  "A-B" (inclusive), an int, or a list of those;
- `tensor_types`: the slot's tensor type (input, weight, grad_output; qkv, o, s, do, dp, dqkv).
A slot without a role (an output slot with no dist-quant neighbour) gets the default.

**Overlapping rules: the last matching rule wins** (as in .gitignore), so write general rules
first and exceptions after them. `recipe` and `default` take a built-in name ("delayed",
"current", "mxfp8", "block", "bf16", or any other that `recipe_from_dict` knows) or a recipe dict
with its settings. Bad input (unknown recipe, malformed glob, unknown tensor type, "last K"
without num_layers, a layer outside num_layers) raises ValueError naming the rule; at a switch
that is a rank voting no, so nothing is published. A rule whose recipe answers the ranks of a
tensor-parallel group differently (a factory that looks at its rank, say) passes each rank's
checks but not the group's: a plan digests each rule's slots apart (`ModelPlan.part_digests`), so
the coordinator aborts the switch naming the rules that differ.

The policy becomes a `CustomRecipe` whose factory answers each slot as its rule's recipe would
(`factories.slot_factory`). Its `to_dict()` is `{"builder": "dist_quant.policy:policy", ...}`
with the rules normalised (recipes as dicts, layers as index lists), which `recipe_from_dict`
reads back; its key is derived from the normalised rules (rule names left out: renaming a rule
changes no quantization). Delayed-scaling slots of one module share a scale history, so two rules
giving one module's tensor types different delayed settings are refused when planned.
"""

from __future__ import annotations

import dataclasses
import json
import re
from collections.abc import Callable, Iterable, Mapping
from fnmatch import fnmatchcase
from pathlib import Path
from typing import Any

from dist_quant.factories import layer_index, slot_factory
from dist_quant.factory_keys import answered_by_parts, builder_of, built_by, quantizer_factory
from dist_quant.recipe_files import read_recipe_file
from dist_quant.recipes import CustomRecipe, Recipe, recipe_from_dict
from dist_quant.roles import QuantizerRole

POLICY_BUILDER = "dist_quant.policy:policy"
TENSOR_TYPES = ("input", "weight", "grad_output", "qkv", "o", "s", "do", "dp", "dqkv")
DEFAULT_RULE = "default"
_RULE_FIELDS = ("name", "modules", "layers", "tensor_types", "recipe")
_POLICY_FIELDS = ("default", "num_layers", "rules")
_GLOB = re.compile(r"[A-Za-z0-9_.*?\[\]!-]+")
_RANGE = re.compile(r"(\d+)\s*-\s*(\d+)")
_EDGE = re.compile(r"(first|last)\s+(\d+)")


@dataclasses.dataclass(frozen=True)
class Rule:
    """One rule, validated and normalised."""

    name: str
    modules: tuple[str, ...]
    layers: tuple[int, ...] | None
    tensor_types: tuple[str, ...]
    recipe: Recipe

    def matches(self, role: QuantizerRole | None) -> bool:
        if role is None:
            return False
        if self.modules and not any(fnmatchcase(role.name, g) for g in self.modules):
            return False
        if self.layers is not None and layer_index(role) not in self.layers:
            return False
        return not self.tensor_types or role.tensor_type in self.tensor_types

    def to_dict(self, *, with_name: bool = True) -> dict[str, Any]:
        out: dict[str, Any] = {"name": self.name} if with_name else {}
        if self.modules:
            out["modules"] = list(self.modules)
        if self.layers is not None:
            out["layers"] = list(self.layers)
        if self.tensor_types:
            out["tensor_types"] = list(self.tensor_types)
        out["recipe"] = self.recipe.to_dict()
        return out


@dataclasses.dataclass(frozen=True)
class Policy:
    """The rules, the default and the layer count of a policy; `rule_for` says who decides."""

    rules: tuple[Rule, ...]
    default: Recipe
    num_layers: int | None

    def rule_for(self, role: QuantizerRole | None) -> Rule | None:
        """The rule deciding `role`'s slot (the last match), or None for the default."""
        index = layer_index(role)
        if self.num_layers is not None and index is not None and index >= self.num_layers:
            raise ValueError(
                f"policy: role {role} is in layer {index}, but the policy is written for "
                f"num_layers={self.num_layers} (another model, or a stale policy file)"
            )
        for rule in reversed(self.rules):
            if rule.matches(role):
                return rule
        return None

    def rule_name(self, role: QuantizerRole | None) -> str:
        rule = self.rule_for(role)
        return DEFAULT_RULE if rule is None else rule.name

    def unmatched(self, roles: Iterable[QuantizerRole | None]) -> list[str]:
        """Names of the rules that match none of `roles` (a typo in a glob, a stale path)."""
        roles = list(roles)
        return [r.name for r in self.rules if not any(r.matches(role) for role in roles)]

    def params(self, *, with_names: bool = True) -> dict[str, Any]:
        return {
            "default": self.default.to_dict(),
            "num_layers": self.num_layers,
            "rules": [r.to_dict(with_name=with_names) for r in self.rules],
        }


def _fail(where: str, message: str) -> ValueError:
    return ValueError(f"policy {where}: {message}")


def _check_glob(where: str, glob: Any) -> str:
    if not isinstance(glob, str) or not glob:
        raise _fail(where, f"a module glob must be a non-empty string, got {glob!r}")
    if not _GLOB.fullmatch(glob):
        bad = sorted({c for c in glob if not _GLOB.fullmatch(c)})
        raise _fail(where, f"malformed glob {glob!r}: characters {bad} are in no module path")
    depth = 0
    for i, c in enumerate(glob):
        if c == "[":
            if depth or glob[i + 1 : i + 2] in ("]", "!]", ""):
                raise _fail(where, f"malformed glob {glob!r}: nested or empty [...] at {i}")
            depth = 1
        elif c == "]" and depth:
            depth = 0
        elif c == "]":
            raise _fail(where, f"malformed glob {glob!r}: ']' at {i} closes no '['")
    if depth:
        raise _fail(where, f"malformed glob {glob!r}: '[' is never closed")
    if ".." in glob or glob.startswith(".") or glob.endswith("."):
        raise _fail(where, f"malformed glob {glob!r}: an empty path component")
    return glob


def _layers(where: str, spec: Any, num_layers: int | None) -> tuple[int, ...]:
    items = spec if isinstance(spec, list) else [spec]
    out: set[int] = set()
    for item in items:
        if isinstance(item, int) and not isinstance(item, bool) and item >= 0:
            out.add(item)
            continue
        text = item.strip().lower() if isinstance(item, str) else None
        edge = _EDGE.fullmatch(text) if text else None
        span = _RANGE.fullmatch(text) if text else None
        if edge and edge.group(1) == "last" and num_layers is None:
            raise _fail(where, f"{item!r} needs the policy's num_layers (the model's layer count)")
        if edge:
            k = int(edge.group(2))
            lo = 0 if edge.group(1) == "first" else max(num_layers - k, 0)
            out.update(range(lo, min(lo + k, num_layers) if num_layers is not None else lo + k))
        elif span and int(span.group(1)) <= int(span.group(2)):
            out.update(range(int(span.group(1)), int(span.group(2)) + 1))
        else:
            raise _fail(
                where,
                f"layers {item!r} is none of: an index >= 0, 'first K', 'last K', 'A-B' (A <= B)",
            )
    if not out:
        raise _fail(where, f"layers {spec!r} selects no layer")
    if num_layers is not None and max(out) >= num_layers:
        raise _fail(where, f"layers {spec!r} reach layer {max(out)} of num_layers={num_layers}")
    return tuple(sorted(out))


def _recipe(where: str, value: Any) -> Recipe:
    try:
        return recipe_from_dict(value)
    except (ValueError, TypeError) as e:
        raise _fail(where, f"recipe {value!r}: {e}") from e


def _strings(where: str, what: str, value: Any) -> tuple[str, ...]:
    items = [value] if isinstance(value, str) else value
    if not isinstance(items, list) or not items:
        raise _fail(where, f"{what} must be a string or a non-empty list, got {value!r}")
    return tuple(items)


def _rule(i: int, spec: Any, num_layers: int | None, names: set[str]) -> Rule:
    where = f"rules[{i}]"
    if not isinstance(spec, Mapping):
        raise _fail(where, f"a rule must be an object, got {spec!r}")
    name = spec.get("name", where)
    if not isinstance(name, str) or not name or name == DEFAULT_RULE or name in names:
        raise _fail(where, f"name must be a unique non-empty string other than 'default': {name!r}")
    where = f"rule {name!r}" if "name" in spec else where
    unknown = sorted(set(spec) - set(_RULE_FIELDS), key=str)
    if unknown:
        raise _fail(where, f"unknown field {', '.join(map(repr, unknown))}; valid: {_RULE_FIELDS}")
    if not set(spec) & {"modules", "layers", "tensor_types"}:
        raise _fail(where, "give at least one of modules, layers, tensor_types (else use default)")
    if "recipe" not in spec:
        raise _fail(where, "has no recipe")
    globs = _strings(where, "modules", spec["modules"]) if "modules" in spec else ()
    types = _strings(where, "tensor_types", spec["tensor_types"]) if "tensor_types" in spec else ()
    for t in types:
        if t not in TENSOR_TYPES:
            raise _fail(where, f"unknown tensor type {t!r}; valid: {', '.join(TENSOR_TYPES)}")
    return Rule(
        name,
        tuple(_check_glob(where, g) for g in globs),
        _layers(where, spec["layers"], num_layers) if "layers" in spec else None,
        tuple(sorted(set(types))),
        _recipe(where, spec["recipe"]),
    )


def parse_policy(spec: Mapping[str, Any]) -> Policy:
    """A validated `Policy` from its dict (without "type"); ValueError naming the bad rule."""
    unknown = sorted(set(spec) - set(_POLICY_FIELDS), key=str)
    if unknown:
        raise _fail("", f"unknown field {', '.join(map(repr, unknown))}; valid: {_POLICY_FIELDS}")
    num_layers = spec.get("num_layers")
    if num_layers is not None and (
        not isinstance(num_layers, int) or isinstance(num_layers, bool) or num_layers < 1
    ):
        raise _fail("", f"num_layers must be an int >= 1 or null, got {num_layers!r}")
    rules_spec = spec.get("rules", [])
    if not isinstance(rules_spec, list):
        raise _fail("", f"rules must be a list, got {rules_spec!r}")
    names: set[str] = set()
    rules = []
    for i, r in enumerate(rules_spec):
        rule = _rule(i, r, num_layers, names)
        names.add(rule.name)
        rules.append(rule)
    default = _recipe("default", spec.get("default", "delayed"))
    return Policy(tuple(rules), default, num_layers)


def policy(**spec: Any) -> Callable[[QuantizerRole | None], Any]:
    """The quantizer factory of a policy (see the module docstring for `spec`); `CustomRecipe`
    of it is the policy recipe. `recipe_from_dict({"type": "policy", ...})` calls this."""
    parsed = parse_policy(spec)
    answers = {r.name: slot_factory(r.recipe) for r in parsed.rules}
    answers[DEFAULT_RULE] = slot_factory(parsed.default)
    key = f"dist_quant.policy.v1({json.dumps(parsed.params(with_names=False), sort_keys=True)})"

    @built_by(POLICY_BUILDER, parsed.params())
    @quantizer_factory(key=key)
    @answered_by_parts(parsed.rule_name)
    def factory(role: QuantizerRole | None) -> Any:
        return answers[parsed.rule_name(role)](role)

    factory.policy = parsed
    return factory


def policy_recipe(spec: Mapping[str, Any]) -> CustomRecipe:
    """The policy recipe of a dict, with or without `"type": "policy"`."""
    if not isinstance(spec, Mapping):
        raise _fail("", f"a policy is an object, got {type(spec).__name__}")
    if spec.get("type", "policy") != "policy":
        raise _fail("", f'type must be "policy", got {spec["type"]!r}')
    return CustomRecipe(policy(**{k: v for k, v in spec.items() if k != "type"}))


def load_policy(path: str | Path) -> CustomRecipe:
    """The policy recipe of a JSON/YAML file."""
    spec = read_recipe_file(path)
    try:
        return policy_recipe(spec)
    except ValueError as e:
        raise ValueError(f"policy file {str(path)!r}: {e}") from e


def policy_of(recipe: Any) -> Policy | None:
    """The `Policy` behind a policy recipe, or None for any other recipe."""
    if not isinstance(recipe, CustomRecipe):
        return None
    built = builder_of(recipe.qfactory)
    if built is None or built[0] != POLICY_BUILDER:
        return None
    return recipe.qfactory.policy
