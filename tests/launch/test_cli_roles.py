"""`dist-quant roles`: every slot of every dist-quant module, and the quantizer a recipe gives it."""

from contextlib import nullcontext

import pytest
from dist_quant.launch.cli import main
from dist_quant.launch.demo_model import TinyGPT, parse_gpt_spec
from dist_quant.launch.roles import role_rows

from dist_quant.recipes import recipe_from_dict

# Per layer: attention qkv (LayerNormLinear), core attention, proj (Linear), MLP (LayerNormMLP).
MODULES_PER_LAYER = [
    "self_attention.qkv",
    "self_attention.core_attention",
    "self_attention.proj",
    "mlp",
]


def _rows(spec: str, recipe: str | dict) -> list[tuple[str, str, str, str, str]]:
    return role_rows(TinyGPT(parse_gpt_spec(spec)), recipe_from_dict(recipe))


def test_every_layer_module_is_listed_with_its_path_name() -> None:
    rows = _rows("gpt:layers=2,hidden=32,heads=2", "bf16")
    modules = list(dict.fromkeys(r[0].split(" ")[0] for r in rows))
    assert modules == [f"layers.{i}.{m}" for i in range(2) for m in MODULES_PER_LAYER]
    # Linear: 3 forward slots (input, weight, output) and 2 backward (grad_output, grad_input).
    proj = [r for r in rows if r[0].startswith("layers.1.self_attention.proj ")]
    assert [r[1] for r in proj] == ["fwd[0]", "fwd[1]", "fwd[2]", "bwd[0]", "bwd[1]"]
    assert [r[2] for r in proj[:2]] == ["linear/input", "linear/weight"]


def test_delayed_scaling_gives_e4m3_forward_and_e5m2_backward_everywhere() -> None:
    # HYBRID (DelayedScaling's default format): E4M3 in the forward pass, E5M2 for gradients.
    for module, slot, _, _, quantizer in _rows("gpt:layers=1,hidden=32,heads=2", "delayed"):
        expected = "e4m3fn" if slot.startswith("fwd") else "e5m2"
        assert quantizer == f"Float8Quantizer({expected})", (module, slot)


def test_bf16_gives_identity_everywhere() -> None:
    assert {r[4] for r in _rows("gpt:layers=1,hidden=32,heads=2", "bf16")} == {"IdentityQuantizer"}


def test_a_per_role_custom_recipe_shows_its_dispatch() -> None:
    recipe = {
        "type": "CustomRecipe",
        "qfactory": "dist_quant.factories:attention_current_linear_block",
    }
    rows = _rows("gpt:layers=1,hidden=32,heads=2", recipe)
    for module, slot, role, _, quantizer in rows:
        if role.startswith("dpa/"):
            assert quantizer.startswith("Float8CurrentScalingQuantizer"), (module, slot, role)
        elif role.startswith("linear/"):
            assert quantizer.startswith("Float8BlockQuantizer"), (module, slot, role)


def test_roles_command_prints_the_table(monkeypatch, capsys) -> None:
    monkeypatch.setenv("COLUMNS", "160")  # wide enough that no name folds
    assert main(["roles", "gpt:layers=2,hidden=32,heads=2", "--recipe", "current"]) == 0
    out = capsys.readouterr().out
    assert "layers.1.mlp" in out and "Float8CurrentScalingQuantizer(e5m2)" in out
    assert "in 8 modules" in out


@pytest.mark.parametrize(
    "argv, code, match",
    [
        (["roles", "gpt:layers=x"], 2, "layers must be an integer"),
        (["roles", "gpt:depth=2"], 2, "bad item 'depth=2'"),
        (["roles", "bert"], 2, "expected 'gpt"),
        (["roles", "no_such_module_xyz:build"], 2, "cannot import"),
        (["roles", "gpt", "--recipe", '{"type": "Bogus"}'], 2, "unknown recipe type"),
        (
            ["roles", "gpt", "--recipe", '{"type": "CustomRecipe", "qfactory": "builtins:repr"}'],
            1,
            "does not fit the model",
        ),
    ],
)
def test_bad_specs_and_recipes_are_one_line_errors(argv, code: int, match: str, capsys) -> None:
    # A factory without an explicit key warns once that its key is derived from its code.
    with pytest.warns(UserWarning) if "builtins:repr" in argv[-1] else nullcontext():
        assert main(argv) == code
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and match in err


def test_model_spec_defaults_and_round_trip() -> None:
    spec = parse_gpt_spec("gpt")
    assert (spec.layers, spec.hidden, spec.heads, spec.vocab, spec.seq) == (2, 64, 4, 64, 32)
    assert spec.to_spec() == "gpt:layers=2,hidden=64,heads=4,ffn=256,vocab=64,seq=32"
    assert parse_gpt_spec(spec.to_spec()).ffn_size == spec.ffn_size == 4 * 64
    with pytest.raises(ValueError, match="multiples of the tensor-parallel size 3"):
        spec.check_tp(3)


def test_the_table_fits_the_terminal_width_and_explains_unnamed_slots(monkeypatch, capsys) -> None:
    monkeypatch.setenv("COLUMNS", "100")
    assert main(["roles", "gpt:layers=1", "--recipe", "delayed"]) == 0
    out = capsys.readouterr().out
    assert max(len(line) for line in out.splitlines()) <= 100
    assert "│ bwd[1] │ -  " in out  # a slot without a role ...
    assert "role -: an output or grad-input slot" in " ".join(out.split())  # ... explained


def test_roles_under_a_policy_file_shows_each_slots_rule_and_warns_unmatched_rules(
    tmp_path, monkeypatch, capsys
) -> None:
    monkeypatch.setenv("COLUMNS", "200")
    path = tmp_path / "policy.yaml"
    path.write_text(
        "type: policy\n"
        "num_layers: 2\n"
        "default: delayed\n"
        "rules:\n"
        "  - {name: last-bf16, layers: last 1, recipe: bf16}\n"
        "  - {name: attn-current, modules: '*.core_attention', recipe: current}\n"
        "  - {name: stale, modules: 'layers.*.attention.wqkv', recipe: bf16}\n"
    )
    assert main(["roles", "gpt:layers=2,hidden=32,heads=2", "--recipe", str(path)]) == 0
    out = capsys.readouterr().out
    lines = [line for line in out.splitlines() if "│" in line]
    rule_of = {}
    module = None
    for line in lines:
        cells = [c.strip() for c in line.split("│")[1:-1]]
        if len(cells) != 6 or cells[1] in ("", "slot"):
            continue
        module = cells[0] or module
        rule_of[(module.split(" ")[0], cells[1])] = (cells[4], cells[5])
    assert rule_of[("layers.1.mlp", "fwd[0]")] == ("IdentityQuantizer", "last-bf16")
    assert rule_of[("layers.0.mlp", "fwd[0]")] == ("Float8Quantizer(e4m3fn)", "default")
    assert rule_of[("layers.1.self_attention.core_attention", "fwd[0]")][1] == "attn-current"
    assert "warning: policy rule 'stale' matches no slot" in out
