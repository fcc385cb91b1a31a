"""Declarative policy recipes: rules from module globs, layer ranges and tensor types to recipes.

Expectations come from the recipes the rules name (each slot's quantizer compared with the one
that recipe builds on its own) and from an existing hand-written factory (`bf16_first_last`),
never from the policy code itself.
"""

from __future__ import annotations

import io
import json

import pytest
import torch
import yaml
from torch import nn

import dist_quant as dq
from dist_quant import checkpoint as ckpt
from dist_quant.factories import bf16_first_last, fp8_fallback
from dist_quant.policy import load_policy, policy_of
from dist_quant.recipes import recipe_from_dict
from dist_quant.runtime import plan_model

LAYERS, WIDTH = 4, 32


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = dq.Linear(WIDTH, 2 * WIDTH)
        self.fc2 = dq.Linear(2 * WIDTH, WIDTH)

    def forward(self, x):
        return x + self.fc2(torch.tanh(self.fc1(x)))


class Stack(nn.Module):
    def __init__(self, seed: int = 0) -> None:
        torch.manual_seed(seed)
        super().__init__()
        self.layers = nn.ModuleList(Block() for _ in range(LAYERS))
        self.output = dq.Linear(WIDTH, 8)

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return self.output(x)


def x_batch(step: int = 0) -> torch.Tensor:
    return torch.randn(16, WIDTH, generator=torch.Generator().manual_seed(100 + step))


def slot_quantizers(model: nn.Module, recipe: dq.Recipe) -> dict[tuple[str, str, int], str]:
    """(module, direction, slot) -> the quantizer's own description, as planned."""
    out = {}
    for cand in plan_model(model, recipe).candidates:
        rt = cand.runtime
        for d, qs in (("fwd", rt.fwd_quantizers), ("bwd", rt.bwd_quantizers)):
            for i, q in enumerate(qs):
                out[(cand.module.role_name, d, i)] = q.describe()
    return out


POLICY = {
    "type": "policy",
    "num_layers": LAYERS,
    "default": "delayed",
    "rules": [
        {"name": "edges", "layers": ["first 1", "last 1"], "recipe": "bf16"},
        {"name": "fc2-current", "modules": "layers.*.fc2", "recipe": "current"},
        {
            "name": "fc1-grads",
            "modules": ["layers.*.fc1"],
            "tensor_types": ["grad_output"],
            "recipe": {"type": "Float8CurrentScaling", "use_power_2_scales": True},
        },
    ],
}


def test_each_slot_gets_the_quantizer_of_the_last_rule_matching_it():
    model = Stack()
    got = slot_quantizers(model, recipe_from_dict(POLICY))
    by_recipe = {
        name: slot_quantizers(Stack(), recipe_from_dict(r))
        for name, r in [
            ("bf16", "bf16"),
            ("current", "current"),
            ("delayed", "delayed"),
            ("pow2", {"type": "Float8CurrentScaling", "use_power_2_scales": True}),
        ]
    }

    def expect(module: str, d: str, i: int) -> str:
        # written out from the rules above; output slots (fwd[2], bwd[1]) have no role: default
        role = {("fwd", 0): "input", ("fwd", 1): "weight", ("bwd", 0): "grad_output"}.get((d, i))
        layer = int(module.split(".")[1]) if module.startswith("layers.") else None
        chosen = "delayed"
        if role and layer in (0, LAYERS - 1):
            chosen = "bf16"
        if role and module.endswith("fc2"):
            chosen = "current"  # later than "edges": wins on layers 0 and 3 too
        if role == "grad_output" and module.endswith("fc1"):
            chosen = "pow2"
        return by_recipe[chosen][(module, d, i)]

    assert got == {k: expect(*k) for k in got}
    assert got[("layers.0.fc2", "fwd", 0)] != got[("layers.0.fc1", "fwd", 0)]  # the test bites


def test_policy_runs_bit_identical_to_the_equivalent_hand_written_factory():
    # bf16_first_last: layers 0 and last (and slots outside the stack) in high precision, the
    # layers between on current scaling
    policy = recipe_from_dict(
        {
            "type": "policy",
            "num_layers": LAYERS,
            "default": "bf16",
            "rules": [{"layers": f"1-{LAYERS - 2}", "recipe": "current"}],
        }
    )
    reference = dq.CustomRecipe(bf16_first_last(LAYERS))
    results = []
    for recipe in (policy, reference):
        model = Stack()
        dq.apply_recipe(model, recipe)
        with dq.autocast():
            y = model(x_batch())
        y.square().sum().backward()
        results.append((y.detach(), [p.grad for p in model.parameters()]))
    assert torch.equal(results[0][0], results[1][0])
    assert all(torch.equal(a, b) for a, b in zip(results[0][1], results[1][1], strict=True))
    with dq.autocast(recipe=dq.HighPrecision()):
        assert not torch.equal(Stack()(x_batch()), results[0][0])  # FP8 did run in the middle


def test_overlapping_rules_resolve_last_match_wins():
    def rules(order):
        return {
            "type": "policy",
            "rules": [{"name": n, "modules": g, "recipe": r} for n, g, r in order],
        }

    a = ("all-bf16", "*", "bf16")
    b = ("fc1-current", "*.fc1", "current")
    first = policy_of(recipe_from_dict(rules([a, b])))
    second = policy_of(recipe_from_dict(rules([b, a])))
    role = dq.QuantizerRole("linear", "input", "layers.2.fc1")
    assert first.rule_name(role) == "fc1-current" and second.rule_name(role) == "all-bf16"
    assert first.rule_name(None) == "default"


def test_round_trip_and_key_are_semantic():
    recipe = recipe_from_dict(POLICY)
    again = recipe_from_dict(json.loads(json.dumps(recipe.to_dict())))
    assert again.key() == recipe.key() and again.digest() == recipe.digest()
    assert slot_quantizers(Stack(), again) == slot_quantizers(Stack(), recipe)

    renamed = json.loads(json.dumps(POLICY))
    renamed["rules"][0]["name"] = "outer layers"
    renamed["rules"][0]["layers"] = [0, f"{LAYERS - 1}-{LAYERS - 1}"]  # same layers, other spelling
    renamed["rules"][1]["recipe"] = {"type": "Float8CurrentScaling"}  # the built-in, spelled out
    assert recipe_from_dict(renamed).key() == recipe.key()

    changed = json.loads(json.dumps(POLICY))
    changed["rules"][1]["recipe"] = "block"
    assert recipe_from_dict(changed).key() != recipe.key()


@pytest.mark.parametrize(
    "rule, message",
    [
        (
            {"name": "r1", "modules": "*", "recipe": "fp9"},
            "rule 'r1': recipe 'fp9'.*unknown built-in",
        ),
        (
            {"name": "g", "modules": "layers.[0", "recipe": "bf16"},
            "rule 'g': malformed glob.*never closed",
        ),
        ({"name": "g2", "modules": "layers..fc1", "recipe": "bf16"}, "rule 'g2': malformed glob"),
        (
            {"name": "g3", "modules": "layers 0", "recipe": "bf16"},
            r"rule 'g3': malformed glob.*\[' '\]",
        ),
        (
            {"modules": "*", "tensor_types": ["activation"], "recipe": "bf16"},
            r"rules\[0\]: unknown tensor type",
        ),
        (
            {"name": "l", "layers": "last 2", "recipe": "bf16"},
            "rule 'l'.*needs the policy's num_layers",
        ),
        ({"name": "nothing", "recipe": "bf16"}, "rule 'nothing': give at least one of"),
        (
            {"name": "x", "modules": "*", "recipe": "bf16", "when": 3},
            "rule 'x': unknown field 'when'",
        ),
    ],
)
def test_bad_rules_are_refused_naming_the_rule(rule, message):
    with pytest.raises(ValueError, match=message):
        recipe_from_dict({"type": "policy", "rules": [rule]})


def test_a_layer_beyond_num_layers_is_refused_at_plan_and_nothing_is_published():
    model = Stack()
    dq.apply_recipe(model, dq.Float8CurrentScaling())
    before = dq.current_recipe(model).key()
    too_small = recipe_from_dict(
        {"type": "policy", "num_layers": 2, "rules": [{"layers": "last 1", "recipe": "bf16"}]}
    )
    with pytest.raises(
        dq.RecipeUpdateError, match="layer 2, but the policy is written for num_layers=2"
    ):
        dq.apply_recipe(model, too_small)
    assert dq.current_recipe(model).key() == before


def test_rules_that_match_nothing_are_reported():
    recipe = recipe_from_dict(
        {
            "type": "policy",
            "rules": [
                {"name": "typo", "modules": "layers.*.fc3", "recipe": "bf16"},
                {"name": "ok", "modules": "output", "recipe": "bf16"},
            ],
        }
    )
    roles = [r for c in plan_model(Stack(), recipe).candidates for r in c.runtime.fwd_roles]
    assert policy_of(recipe).unmatched(roles) == ["typo"]


def test_policy_file_checkpoints_and_resumes_into_a_fresh_model(tmp_path):
    path = tmp_path / "policy.yaml"
    path.write_text(yaml.safe_dump({k: v for k, v in POLICY.items() if k != "type"}))
    recipe = load_policy(path)
    assert recipe.key() == recipe_from_dict(POLICY).key()

    model = Stack()
    dq.apply_recipe(model, recipe)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    for step in range(3):
        opt.zero_grad()
        with dq.autocast():
            model(x_batch(step)).square().mean().backward()
        opt.step()
    buf = io.BytesIO()
    ckpt.save(buf, model)
    buf.seek(0)
    fresh = Stack(seed=1)
    ckpt.load(buf, fresh)
    assert dq.current_recipe(fresh).key() == recipe.key()
    with dq.autocast():
        want, got = model(x_batch(9)), fresh(x_batch(9))
    assert torch.equal(want, got)


def test_guard_fallback_over_a_policy_base_moves_only_the_named_layers():
    base = recipe_from_dict(POLICY)
    fallback = dq.CustomRecipe(fp8_fallback(["layers.1"], to="bf16", base=base.to_dict()))
    got = slot_quantizers(Stack(), fallback)
    want_base = slot_quantizers(Stack(), base)
    want_bf16 = slot_quantizers(Stack(), dq.HighPrecision())
    for (module, d, i), q in got.items():
        moved = module.startswith("layers.1.") and (d, i) not in (("fwd", 2), ("bwd", 1))
        assert q == (want_bf16 if moved else want_base)[(module, d, i)], (module, d, i)
    assert recipe_from_dict(fallback.to_dict()).key() == fallback.key()
