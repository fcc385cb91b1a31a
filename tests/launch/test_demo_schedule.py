"""Recipe schedules: where each phase starts, and every way a schedule file can be wrong."""

import json
from pathlib import Path

import pytest
from dist_quant.launch.demo_model import TinyGPT, parse_gpt_spec
from dist_quant.launch.demo_schedule import load_schedule_file, resolve_schedule

import dist_quant as dq
from dist_quant.kinds import PassMode
from dist_quant.nvfp4 import NVFP4Quantizer
from dist_quant.quantizers import IdentityQuantizer


def test_default_schedule_is_bf16_delayed_current_bf16_at_quarter_points() -> None:
    s = resolve_schedule(None, 200)
    assert [p.start for p in s.phases] == [0, 50, 110, 170]
    assert [p.recipe for p in s.phases] == ["bf16", "delayed", "current", "bf16"]
    assert [p.label for p in s.switches] == ["fp8 delayed", "fp8 current", "bf16 tail"]


def test_steps_and_fractions_mix_and_labels_default_to_the_recipe() -> None:
    raw = {
        "phases": [
            {"step": 0, "recipe": "delayed"},
            {
                "fraction": 0.5,
                "recipe": {"type": "Float8CurrentScaling", "use_power_2_scales": True},
            },
            {"step": 90, "recipe": "bf16", "label": "tail"},
        ]
    }
    s = resolve_schedule(raw, 100)
    assert [p.start for p in s.phases] == [0, 50, 90]
    assert [p.label for p in s.phases] == ["delayed", "Float8CurrentScaling", "tail"]
    assert s.phases[1].recipe == {"type": "Float8CurrentScaling", "use_power_2_scales": True}


def test_yaml_and_json_files_load_to_the_same_schedule(tmp_path) -> None:
    phases = [{"step": 0, "recipe": "bf16"}, {"step": 5, "recipe": "current"}]
    (tmp_path / "s.json").write_text(json.dumps(phases))
    (tmp_path / "s.yaml").write_text("- {step: 0, recipe: bf16}\n- {step: 5, recipe: current}\n")
    a = resolve_schedule(load_schedule_file(tmp_path / "s.json"), 10)
    b = resolve_schedule(load_schedule_file(tmp_path / "s.yaml"), 10)
    assert a == b


@pytest.mark.parametrize(
    "raw, match",
    [
        ([], "non-empty list"),
        ([{"step": 1, "recipe": "bf16"}], "must start at step 0"),
        ([{"step": 0, "recipe": "bf16"}, {"step": 0, "recipe": "current"}], "increasing steps"),
        ([{"step": 0, "recipe": "bf16"}, {"step": 10, "recipe": "current"}], "only 10 steps"),
        ([{"step": 0, "fraction": 0.0, "recipe": "bf16"}], "exactly one of"),
        ([{"step": 0, "recipe": "bf16", "when": 3}], "unknown field"),
        ([{"step": 0}], "missing 'recipe'"),
        ([{"fraction": 1.5, "recipe": "bf16"}], r"fraction must be a number in \[0, 1\)"),
        ([{"step": -1, "recipe": "bf16"}], "step must be an integer >= 0"),
        (
            [{"step": 0, "recipe": {"type": "Bogus"}}],
            "phase 0: invalid recipe: unknown recipe type",
        ),
        ([{"step": 0, "recipe": "fp4"}], "phase 0: invalid recipe"),
        (
            [{"step": 0, "recipe": {"type": "policy", "rules": [{"name": "r", "recipe": "x"}]}}],
            "phase 0: invalid recipe: policy rule 'r'",
        ),
        ({"stages": []}, 'exactly one key, "phases"'),
    ],
)
def test_bad_schedules_are_refused_naming_the_phase_and_field(raw, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        resolve_schedule(raw, 10)


def test_unreadable_and_unparseable_files_are_refused(tmp_path) -> None:
    with pytest.raises(ValueError, match="cannot read"):
        load_schedule_file(tmp_path / "missing.yaml")
    (tmp_path / "bad.yaml").write_text("phases: [ {step: 0\n")
    with pytest.raises(ValueError, match="not valid YAML/JSON"):
        load_schedule_file(tmp_path / "bad.yaml")


def test_the_nvfp4_schedule_file_runs_nvfp4_between_bf16_ends_then_a_bf16_forward():
    path = Path(__file__).resolve().parents[2] / "examples" / "schedules" / "nvfp4_bf16_tail.yaml"
    s = resolve_schedule(load_schedule_file(path), 200)
    assert [p.start for p in s.phases] == [0, 180]  # the last 10%
    first, tail = (dq.recipe_from_dict(p.recipe) for p in s.phases)
    assert PassMode.of_recipe(first) == (PassMode.QUANTIZED, PassMode.QUANTIZED)
    assert PassMode.of_recipe(tail) == (PassMode.HIGH_PRECISION, PassMode.QUANTIZED)
    model = TinyGPT(parse_gpt_spec("gpt:layers=4"))
    dq.apply_recipe(model, first)
    for i, layer in enumerate(model.layers):
        want = IdentityQuantizer if i in (0, 3) else NVFP4Quantizer
        kinds = {
            type(q)
            for m in layer.modules()
            if getattr(m, "module_type", "") == "linear" and m.owns_quantizers
            for q in m.quant_binding.runtime.fwd_quantizers[:2]
        }
        assert kinds == {want}, (i, kinds)
    dq.apply_recipe(model, tail)  # the switch at 90% plans on the same model


def test_a_phase_may_run_a_policy_recipe(tmp_path) -> None:
    (tmp_path / "s.yaml").write_text(
        "- {step: 0, recipe: bf16}\n"
        "- step: 4\n"
        "  recipe:\n"
        "    type: policy\n"
        "    default: delayed\n"
        "    rules: [{modules: 'layers.0.*', recipe: bf16}]\n"
    )
    s = resolve_schedule(load_schedule_file(tmp_path / "s.yaml"), 10)
    assert s.phases[1].start == 4 and s.phases[1].recipe["type"] == "policy"
