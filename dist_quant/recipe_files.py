"""Reading a recipe as people write one: a built-in name, inline JSON, or a JSON/YAML file.

The one reader behind `dist-quant switch RECIPE`, torchtitan's `recipe` option, policy files and
the precision guard's fallback. It returns the payload (a name or a dict) without judging the
recipe itself: `recipes.recipe_from_dict` does that where the recipe is built. Problems reading
it raise ValueError naming the file, with YAML's line and column where the parser knows them.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import yaml

RECIPE_FILE_SUFFIXES = (".json", ".yaml", ".yml")


def read_recipe_spec(text: str) -> str | dict[str, Any]:
    """A recipe argument -> its payload.

    Text starting with `{`, `[` or `"` is inline JSON (never taken for a file name); else a path
    to an existing file is read as JSON/YAML; a name with a recipe file's suffix that is no file
    is an error; anything else is a built-in name (`delayed`, `current`, ...), returned as is.
    """
    stripped = text.strip()
    if not stripped:
        raise ValueError("the recipe is empty: give a built-in name, a JSON object or a file")
    if stripped[0] in '{["':
        # inline JSON, decided before any file check: a long recipe is no valid file name
        # (ENAMETOOLONG), and nobody names a recipe file "{..."
        try:
            value = json.loads(stripped)
        except json.JSONDecodeError as e:
            raise ValueError(f"the recipe is not valid JSON: {e}") from e
        except RecursionError as e:  # json nests by recursion: deep input exhausts the stack
            raise ValueError("the recipe is JSON nested too deeply to be a recipe") from e
        return _payload(value, "the recipe")
    if _is_file(stripped):
        return _payload(read_recipe_file(stripped), f"recipe file {stripped!r}")
    if Path(stripped).suffix.lower() in RECIPE_FILE_SUFFIXES:
        raise ValueError(f"recipe file {stripped!r} does not exist")
    return stripped


def read_recipe_file(path: str | Path) -> Any:
    """The JSON/YAML content of a recipe or policy file."""
    try:
        return yaml.safe_load(Path(path).read_text())
    except (OSError, UnicodeDecodeError, yaml.YAMLError, RecursionError) as e:
        raise ValueError(
            f"recipe file {str(path)!r} is not valid JSON/YAML: {_parse_problem(e)}"
        ) from e


def _payload(value: Any, where: str) -> str | dict[str, Any]:
    if not isinstance(value, str | dict):
        raise ValueError(
            f"{where} holds a {type(value).__name__}; a recipe is an object or a built-in name"
        )
    return value


def _parse_problem(e: BaseException) -> str:
    """What is wrong with a recipe file, and where: YAML's own problem text at its line and
    column (1-based, as editors count) where the parser knows them."""
    mark = getattr(e, "problem_mark", None)
    problem = getattr(e, "problem", None)
    if mark is not None and problem:
        return f"{problem} at line {mark.line + 1}, column {mark.column + 1}"
    return str(e).splitlines()[0] if str(e) else type(e).__name__


def _is_file(text: str) -> bool:
    """Whether `text` names an existing file; False where it cannot be a path at all (too long)."""
    try:
        return Path(text).is_file()
    except (OSError, ValueError):  # ENAMETOOLONG and the like; NUL bytes on older Pythons
        return False
