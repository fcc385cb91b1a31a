"""A declarative policy as the precision guard's fallback target (issue 36).

Expectations come from the recipes themselves: the slots the guard moves must be planned exactly
as the policy alone plans them, every other slot exactly as the base recipe alone.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import yaml
from dist_quant.coordinator.decision_log import DecisionLog
from dist_quant.coordinator.guard import Observation, PrecisionGuard
from dist_quant.coordinator.guard_runner import GuardRunner
from torch import nn

import dist_quant as dq
from dist_quant.recipes import recipe_from_dict
from dist_quant.runtime import plan_model

POLICY = {
    "type": "policy",
    "default": "current",
    "rules": [{"name": "fc2-bf16", "modules": "*.fc2", "recipe": "bf16"}],
}


def model() -> nn.Module:
    blocks = [nn.Sequential() for _ in range(2)]
    for b in blocks:
        b.add_module("fc1", dq.Linear(16, 32))
        b.add_module("fc2", dq.Linear(32, 16))
    return nn.Sequential(*blocks)


def slots(m: nn.Module, recipe: dq.Recipe) -> dict[tuple[str, str, int], tuple[str, str]]:
    """(module, direction, slot) -> (the slot's role name, its quantizer's description)."""
    out = {}
    for cand in plan_model(m, recipe).candidates:
        rt, mod = cand.runtime, cand.module
        for fwd, qs in ((True, rt.fwd_quantizers), (False, rt.bwd_quantizers)):
            roles = mod.get_quantizer_roles(fwd=fwd, num_quantizers=len(qs))
            for i, (role, q) in enumerate(zip(roles, qs)):
                name = role.name if role is not None else ""
                out[(mod.role_name, "fwd" if fwd else "bwd", i)] = (name, q.describe())
    return out


def runner_of(tmp_path, guard: PrecisionGuard, m: nn.Module) -> tuple[GuardRunner, list]:
    requested = []

    def request(recipe, timeout_s):
        requested.append(recipe)
        return SimpleNamespace(committed=True, switch_id=1, step=0, reasons={})

    log = DecisionLog(tmp_path / "decisions.jsonl")
    return GuardRunner(guard, m, log=log, request=request), requested


def test_saturated_layers_move_to_what_a_policy_file_gives_them(tmp_path):
    path = tmp_path / "calm.yaml"
    path.write_text(yaml.safe_dump(POLICY))
    guard = PrecisionGuard(fallback=str(path), saturation_intervals=1)
    m = model()
    base = dq.DelayedScaling(amax_history_len=4)
    dq.apply_recipe(m, base)

    runner, requests = runner_of(tmp_path, guard, m)
    runner.observe(Observation(3, saturation=(("1", 0.5),)))
    runner.wait(10)
    (requested,) = requests

    got = slots(model(), recipe_from_dict(requested))
    want_policy, want_base = slots(model(), recipe_from_dict(POLICY)), slots(model(), base)
    moved = {k for k, (role, _) in got.items() if role.startswith("1.")}  # slots of module "1"
    assert {k[0] for k in moved} == {"1.fc1", "1.fc2"}
    for k, q in got.items():
        assert q == (want_policy if k in moved else want_base)[k], k
    records = DecisionLog(tmp_path / "decisions.jsonl").records()
    (record,) = [r for r in records if r.get("outcome") == "committed"]
    assert record["target"] == "policy calm.yaml" and record["layers"] == ["1"]


def test_a_loss_spike_with_no_saturated_layer_switches_the_model_to_the_policy(tmp_path):
    guard = PrecisionGuard(fallback=POLICY, loss_window=2, spike_sigma=1.0)
    m = model()
    dq.apply_recipe(m, dq.DelayedScaling(amax_history_len=4))
    runner, requests = runner_of(tmp_path, guard, m)
    for step, loss in enumerate([1.0, 1.1, 50.0]):
        runner.observe(Observation(step, loss=loss))
    runner.wait(10)
    (requested,) = requests
    assert recipe_from_dict(requested).key() == recipe_from_dict(POLICY).key()
    assert guard.fallback_label == f"policy {recipe_from_dict(POLICY).digest()[:8]}"


@pytest.mark.parametrize(
    "fallback, message",
    [
        ("fp4", "must be one of"),
        ({"type": "policy", "rules": [{"modules": "a[", "recipe": "bf16"}]}, "malformed glob"),
        ({"type": "policy", "rules": [{"modules": "a", "recipe": "fp3"}]}, "rules\\[0\\]"),
    ],
)
def test_a_bad_fallback_is_refused_when_the_guard_is_made(fallback, message):
    with pytest.raises(ValueError, match=f"PrecisionGuard.fallback.*{message}"):
        PrecisionGuard(fallback=fallback)


def test_an_unreadable_policy_file_is_refused_naming_the_file(tmp_path):
    with pytest.raises(
        ValueError, match="PrecisionGuard.fallback: recipe file .*missing.yaml.* does not exist"
    ):
        PrecisionGuard(fallback=str(tmp_path / "missing.yaml"))
