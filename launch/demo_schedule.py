"""The demo's recipe schedule: which recipe runs from which step.

A schedule file (YAML or JSON) is a list of phases, or an object with a `phases` list:

```yaml
phases:
  - {fraction: 0.0, recipe: bf16, label: bf16 warm-up}
  - {fraction: 0.25, recipe: delayed}
  - {step: 30, recipe: {type: Float8CurrentScaling, use_power_2_scales: true}}
  - {fraction: 0.85, recipe: bf16, label: bf16 tail}
```

Each phase names where it starts with exactly one of `step` (an absolute optimizer step) or
`fraction` (of `--steps`, in [0, 1)), and a `recipe`: a built-in name or a recipe dict
(`Recipe.to_dict()` form). The first phase starts at step 0 and is applied locally on every rank
before training; every later phase is a cluster-wide switch requested from the coordinator at its
start step.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from dist_quant.recipes import recipe_from_dict

DEFAULT_PHASES: list[dict[str, Any]] = [
    {"fraction": 0.0, "recipe": "bf16", "label": "bf16 warm-up"},
    {"fraction": 0.25, "recipe": "delayed", "label": "fp8 delayed"},
    {"fraction": 0.55, "recipe": "current", "label": "fp8 current"},
    {"fraction": 0.85, "recipe": "bf16", "label": "bf16 tail"},
]


@dataclass(frozen=True)
class Phase:
    """One stretch of training under one recipe."""

    start: int
    """First optimizer step that runs this recipe."""
    recipe: str | dict[str, Any]
    """A built-in recipe name or a recipe dict, exactly as the coordinator receives it."""
    label: str
    """Shown in the table, the plot legend and the progress bar."""


@dataclass(frozen=True)
class Schedule:
    phases: tuple[Phase, ...]

    @property
    def switches(self) -> tuple[Phase, ...]:
        """The phases that begin with a cluster-wide switch (all but the first)."""
        return self.phases[1:]

    def to_json(self) -> list[dict[str, Any]]:
        return [{"step": p.start, "recipe": p.recipe, "label": p.label} for p in self.phases]


def load_schedule_file(path: str | Path) -> list[Any] | dict[str, Any]:
    """Parse a YAML or JSON schedule file (JSON is valid YAML, so one parser reads both)."""
    p = Path(path)
    try:
        text = p.read_text()
    except OSError as e:
        raise ValueError(f"recipe schedule {str(p)!r}: cannot read it: {e.strerror}") from e
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as e:
        raise ValueError(f"recipe schedule {str(p)!r} is not valid YAML/JSON: {e}") from e


def _label_of(recipe: str | Mapping[str, Any]) -> str:
    if isinstance(recipe, str):
        return recipe
    return str(recipe.get("type", "recipe"))


def resolve_schedule(raw: Sequence[Any] | Mapping[str, Any] | None, steps: int) -> Schedule:
    """Validate `raw` (None: the default schedule) against a run of `steps` optimizer steps.

    Every recipe is parsed with `recipe_from_dict` here, in the launcher, so a typo fails before any
    process starts. Raises ValueError naming the phase and the field.
    """
    if steps < 1:
        raise ValueError(f"--steps must be >= 1, got {steps}")
    if raw is None:
        raw = DEFAULT_PHASES
    if isinstance(raw, Mapping):
        if set(raw) != {"phases"}:
            raise ValueError('a recipe schedule object must have exactly one key, "phases"')
        raw = raw["phases"]
    if not isinstance(raw, Sequence) or isinstance(raw, str) or not raw:
        raise ValueError("a recipe schedule must be a non-empty list of phases")
    phases: list[Phase] = []
    for i, entry in enumerate(raw):
        where = f"schedule phase {i}"
        if not isinstance(entry, Mapping):
            raise ValueError(f"{where}: expected an object with step|fraction and recipe")
        unknown = sorted(set(entry) - {"step", "fraction", "recipe", "label"}, key=str)
        if unknown:
            raise ValueError(
                f"{where}: unknown field(s) {', '.join(map(repr, unknown))}; "
                "valid: step, fraction, recipe, label"
            )
        if ("step" in entry) == ("fraction" in entry):
            raise ValueError(f"{where}: give exactly one of 'step' or 'fraction'")
        if "step" in entry:
            start = entry["step"]
            if isinstance(start, bool) or not isinstance(start, int) or start < 0:
                raise ValueError(f"{where}: step must be an integer >= 0, got {start!r}")
        else:
            frac = entry["fraction"]
            if isinstance(frac, bool) or not isinstance(frac, int | float) or not 0 <= frac < 1:
                raise ValueError(f"{where}: fraction must be a number in [0, 1), got {frac!r}")
            start = int(round(frac * steps))
        if "recipe" not in entry:
            raise ValueError(f"{where}: missing 'recipe'")
        recipe = entry["recipe"]
        if not isinstance(recipe, str | Mapping):
            raise ValueError(f"{where}: recipe must be a built-in name or an object")
        try:
            recipe_from_dict(recipe)
        except (ValueError, TypeError) as e:
            raise ValueError(f"{where}: invalid recipe: {e}") from e
        label = entry.get("label", _label_of(recipe))
        if not isinstance(label, str):
            raise ValueError(f"{where}: label must be a string, got {label!r}")
        recipe = recipe if isinstance(recipe, str) else json.loads(json.dumps(dict(recipe)))
        phases.append(Phase(start, recipe, label))
    if phases[0].start != 0:
        raise ValueError(f"schedule phase 0 must start at step 0, not {phases[0].start}")
    for prev, cur in zip(phases, phases[1:], strict=False):
        if cur.start <= prev.start:
            raise ValueError(
                f"schedule phases must start at increasing steps: {cur.label!r} starts at "
                f"{cur.start}, not after {prev.label!r} at {prev.start} (with --steps {steps})"
            )
    if phases[-1].start >= steps:
        raise ValueError(
            f"schedule phase {phases[-1].label!r} starts at step {phases[-1].start}, "
            f"but the run has only {steps} steps"
        )
    return Schedule(tuple(phases))
