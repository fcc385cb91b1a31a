"""Checkpoints of the all-identity recipe: the "bf16" built-in is `HighPrecision` now, and
checkpoints written while "bf16" was spelt `CustomRecipe(factories.high_precision)` still load.

What these catch: an old bf16 checkpoint that a fresh model cannot resume from, or that a model
already on "bf16" refuses as "another recipe" (the two quantize identically), and a legacy alias
so wide that it lets an FP8 model load a bf16 checkpoint.
"""

from __future__ import annotations

import hashlib
import io
import json

import pytest
import torch
from torch import nn

import dist_quant as dq
from dist_quant import checkpoint as ckpt
from dist_quant import coordinator, factories

# The old spelling, written out as old checkpoints hold it (not derived from today's classes).
LEGACY_DICT = {
    "type": "CustomRecipe",
    "qfactory": "dist_quant.factories:high_precision",
    "qfactory_key": None,
    "fp8_format": "HYBRID",
    "fp8_dpa": False,
    "fp8_mha": False,
}
LEGACY_KEY_REPR = (
    "('CustomRecipe', ('dist_quant.factories.high_precision.v1', None, 'HYBRID', False, False))"
)


def _model(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(dq.Linear(16, 32, name="fc1"), nn.GELU(), dq.Linear(32, 8, name="fc2"))


def _x() -> torch.Tensor:
    return torch.randn(4, 16, generator=torch.Generator().manual_seed(3))


def _bf16_state_dict() -> tuple[nn.Module, dict]:
    model = _model(0)
    dq.apply_recipe(model, dq.recipe_from_dict("bf16"))
    return model, model.state_dict()


def _legacy(state_dict: dict) -> dict:
    """`state_dict` with every dist-quant extra state rewritten to the old bf16 spelling."""
    out = dict(state_dict)
    for k, v in state_dict.items():
        if k.endswith("_extra_state") and v["recipe_key"] is not None:
            out[k] = {
                **v,
                "recipe": dict(LEGACY_DICT),
                "recipe_key": hashlib.sha256(LEGACY_KEY_REPR.encode()).hexdigest(),
                "recipe_key_repr": LEGACY_KEY_REPR,
            }
    return out


def _forward(model: nn.Module) -> torch.Tensor:
    with dq.autocast():
        return model(_x())


def test_the_old_spelling_is_what_custom_recipe_of_high_precision_writes():
    """The literal above is the real old spelling: that recipe still exists and writes it."""
    old = dq.CustomRecipe(qfactory=factories.high_precision)
    assert old.to_dict() == LEGACY_DICT and repr(old.key()) == LEGACY_KEY_REPR


def test_a_fresh_model_resumes_an_old_bf16_checkpoint_as_bf16():
    model, sd = _bf16_state_dict()
    fresh = _model(1)
    ckpt.load_state_dict(fresh, _legacy(sd))
    assert dq.current_recipe(fresh) == dq.HighPrecision()
    assert ckpt.recipe_of(_legacy(sd)) == dq.HighPrecision()
    assert torch.equal(_forward(fresh), _forward(model))


@pytest.mark.parametrize(
    "running",
    [dq.recipe_from_dict("bf16"), dq.CustomRecipe(qfactory=factories.high_precision)],
    ids=["bf16", "old spelling"],
)
def test_a_model_on_bf16_in_either_spelling_loads_old_and_new_bf16_checkpoints(running):
    _, sd = _bf16_state_dict()
    for state_dict in (sd, _legacy(sd)):
        target = _model(2)
        dq.apply_recipe(target, running)
        ckpt.load_state_dict(target, state_dict)
        assert dq.current_recipe(target) == running  # a kept runtime is not rebuilt


def test_an_fp8_model_still_refuses_an_old_bf16_checkpoint():
    _, sd = _bf16_state_dict()
    target = _model(3)
    dq.apply_recipe(target, dq.Float8CurrentScaling())
    before = {k: v.clone() for k, v in target.state_dict().items() if torch.is_tensor(v)}
    with pytest.raises(dq.RecipeUpdateError, match="loading would mix recipes"):
        ckpt.load_state_dict(target, _legacy(sd))
    assert dq.current_recipe(target) == dq.Float8CurrentScaling()
    after = {k: v for k, v in target.state_dict().items() if torch.is_tensor(v)}
    assert all(torch.equal(before[k], after[k]) for k in before)


class _Participant:
    rank, state = 0, "idle"


def test_a_job_whose_last_commit_was_the_old_bf16_resumes_on_bf16(tmp_path):
    """The decision log of an older run recorded "bf16" in the old spelling; the model resumed
    from its checkpoint runs `HighPrecision`: restore_job_state must see the same recipe."""
    records = [
        {"event": "open", "switch_id": 1, "recipe": dict(LEGACY_DICT), "time": 1.0},
        {"event": "decision", "switch_id": 1, "commit": True, "step": 5, "time": 2.0},
    ]
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "decisions.jsonl").write_text(
        "".join(json.dumps(r, sort_keys=True) + "\n" for r in records)
    )
    state = coordinator.job_state(_Participant(), step=8, run_dir=tmp_path / "a")
    _, sd = _bf16_state_dict()
    fresh = _model(4)
    ckpt.load_state_dict(fresh, _legacy(sd))
    commit = coordinator.restore_job_state(state, run_dir=tmp_path / "b", model=fresh)
    assert commit["switch_id"] == 1
    dq.apply_recipe(fresh, dq.Float8CurrentScaling())
    with pytest.raises(ValueError, match="last committed switch"):
        coordinator.restore_job_state(state, run_dir=tmp_path / "c", model=fresh)


def test_a_save_killed_half_way_leaves_the_previous_checkpoint_loadable(tmp_path, monkeypatch):
    """A scheduler's SIGTERM can land inside `save`: the name keeps the last whole checkpoint."""
    torch.manual_seed(0)
    model = nn.Sequential(dq.Linear(16, 16))
    dq.apply_recipe(model, dq.recipe_from_dict("bf16"))
    path = tmp_path / "ckpt.pt"
    ckpt.save(path, model, extra={"step": 7})
    before = path.read_bytes()
    real_save = torch.save

    def killed_half_way(obj, f, *args, **kw):
        buf = io.BytesIO()
        real_save(obj, buf)
        f.write(buf.getvalue()[: len(buf.getvalue()) // 2])
        raise KeyboardInterrupt  # what the signal's exception does to the write

    with torch.no_grad():
        model[0].weight.add_(1.0)
    monkeypatch.setattr(torch, "save", killed_half_way)
    with pytest.raises(KeyboardInterrupt):
        ckpt.save(path, model, extra={"step": 8})
    monkeypatch.setattr(torch, "save", real_save)
    assert path.read_bytes() == before and [p.name for p in tmp_path.iterdir()] == ["ckpt.pt"]
    fresh = nn.Sequential(dq.Linear(16, 16))
    assert ckpt.load(path, fresh)["extra"] == {"step": 7}
