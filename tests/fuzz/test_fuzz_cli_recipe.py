"""Fuzzing the RECIPE argument of `dist-quant switch`.

The command line's contract (launch/cli.py): RECIPE is a built-in name, a JSON/YAML file or a JSON
string; unparseable input is a one-line error and exit code 2, never a traceback; a recipe that
parses is sent to the job as is (the ranks judge it). Against a run directory with no job, every
RECIPE therefore ends in exit code 2 with exactly one line on stderr: 2 for the parse error, or 2
for "no coordinator found" once it parsed.
"""

from __future__ import annotations

import contextlib
import io
import json

import pytest
from dist_quant.launch.cli import CliError, main, parse_recipe_arg
from fuzz_models import fuzz_budget
from fuzz_recipes import recipe_dicts
from hypothesis import given
from hypothesis import strategies as st


def recipe_texts() -> st.SearchStrategy[str]:
    as_json = st.builds(
        lambda d, indent: json.dumps(d, indent=indent), recipe_dicts(), st.sampled_from([None, 1])
    )
    broken = as_json.flatmap(lambda t: st.integers(1, len(t)).map(lambda n: t[:n]))
    names = st.sampled_from(["delayed", "current", "mxfp8", "block", "bf16", " Delayed ", "fp4"])
    return st.one_of(as_json, broken, names, st.text(max_size=60))


@given(recipe_texts())
@fuzz_budget(40)
def test_recipe_argument_parses_to_the_payload_or_is_a_usage_error(text):
    try:
        payload = parse_recipe_arg(text)
    except CliError as e:
        assert e.code == 2 and "\n" not in str(e).strip(), str(e)
        return
    stripped = text.strip()
    if stripped[0] in '{["':
        assert payload == json.loads(stripped)
    else:
        assert payload == stripped


@given(text=recipe_texts())
@fuzz_budget(20)
def test_switch_without_a_job_exits_2_with_one_line_whatever_the_recipe(text, tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("no_job")
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        code = main(["switch", "--run-dir", str(run_dir), "--", text])
    lines = err.getvalue().strip().splitlines()
    assert code == 2 and len(lines) == 1 and "Traceback" not in err.getvalue(), err.getvalue()


@pytest.mark.parametrize(
    "text",
    [
        json.dumps({"type": "CustomRecipe", "qfactory": "my_lab.recipes.attention:" + "f" * 200}),
        "[" * 100_000,
    ],
    ids=["long inline JSON", "deep nesting"],
)
def test_any_recipe_text_is_a_payload_or_a_usage_error(text):
    try:
        payload = parse_recipe_arg(text)
    except CliError as e:
        assert e.code == 2
        return
    assert payload == json.loads(text)
