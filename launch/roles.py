"""`dist-quant roles`: the role table of a model under a recipe.

One row per quantizer slot of every dist-quant module: the module's role name, the slot
(`fwd[i]` / `bwd[i]`), the role the module emits for it (`module_type/tensor_type`, or `-` for a
slot without a role) and the quantizer the recipe builds for it; under a policy recipe
(`dist_quant.policy`) also the rule that decided the slot, and a warning for each rule that
matches no slot. The recipe is planned and
validated exactly as `apply_recipe` would (nothing is published), so a recipe that cannot run on
the model fails here with the same error the job would report.
"""

from __future__ import annotations

import importlib
from typing import Any

from dist_quant.launch.demo_model import TinyGPT, parse_gpt_spec
from dist_quant.launch.demo_report import short_key
from dist_quant.launch.errors import CliError
from rich.console import Console
from rich.table import Table
from torch import nn

from dist_quant.context import default_recipe
from dist_quant.policy import policy_of
from dist_quant.recipes import recipe_from_dict
from dist_quant.roles import QuantizerRole
from dist_quant.runtime import RecipeUpdateError, plan_model


def build_model(spec: str) -> nn.Module:
    """A model from a spec: `gpt[:key=value,...]` (see `demo_model`) or `pkg.module:function`."""
    head, sep, tail = spec.strip().partition(":")
    if head == "gpt":
        try:
            return TinyGPT(parse_gpt_spec(spec))
        except ValueError as e:
            raise CliError(str(e), 2) from e
    if not sep or not head or not tail:
        raise CliError(
            f"model spec {spec!r}: expected 'gpt[:key=value,...]' or 'pkg.module:function'", 2
        )
    try:
        fn = getattr(importlib.import_module(head), tail)
    except (ImportError, AttributeError) as e:
        raise CliError(f"model spec {spec!r}: cannot import {tail!r} from {head!r}: {e}", 2) from e
    model = fn()
    if not isinstance(model, nn.Module):
        raise CliError(
            f"model spec {spec!r}: {tail}() returned {type(model).__name__}, not a module", 2
        )
    return model


def describe_quantizer(q: Any) -> str:
    """Class name plus FP8 format, e.g. `Float8Quantizer(e4m3fn)`."""
    fp8 = getattr(q, "fp8_dtype", None)
    name = type(q).__name__
    return name if fp8 is None else f"{name}({str(fp8).removeprefix('torch.float8_')})"


def role_rows(model: nn.Module, recipe: Any) -> list[tuple[str, str, str, str, str]]:
    """(module, slot, role, role name, quantizer) for every slot; raises RecipeUpdateError."""
    rows = []
    for cand in plan_model(model, recipe).candidates:
        rt = cand.runtime
        module = f"{cand.module.role_name} ({type(cand.module).__name__})"
        for direction, roles, quantizers in (
            ("fwd", rt.fwd_roles, rt.fwd_quantizers),
            ("bwd", rt.bwd_roles, rt.bwd_quantizers),
        ):
            for i, (role, q) in enumerate(zip(roles, quantizers, strict=True)):
                kind = "-" if role is None else f"{role.module_type}/{role.tensor_type}"
                rows.append(
                    (
                        module,
                        f"{direction}[{i}]",
                        kind,
                        "" if role is None else role.name,
                        describe_quantizer(q),
                    )
                )
    return rows


def slot_roles(model: nn.Module, recipe: Any) -> list[QuantizerRole | None]:
    """Every slot's role, in `role_rows` order; raises RecipeUpdateError."""
    out: list[QuantizerRole | None] = []
    for cand in plan_model(model, recipe).candidates:
        out += [*cand.runtime.fwd_roles, *cand.runtime.bwd_roles]
    return out


def print_role_table(spec: str, recipe_payload: str | dict | None) -> int:
    """Print the table; exit code 0, or raise CliError (2: bad spec/recipe, 1: recipe refused)."""
    model = build_model(spec)
    try:
        recipe = default_recipe() if recipe_payload is None else recipe_from_dict(recipe_payload)
    except (ValueError, TypeError) as e:
        raise CliError(f"invalid recipe: {e}", 2) from e
    try:
        rows = role_rows(model, recipe)
    except RecipeUpdateError as e:
        raise CliError(f"the recipe does not fit the model: {e}", 1) from e
    table = Table(title=f"roles of {spec} under {short_key(recipe)}", title_justify="left")
    policy = policy_of(recipe)
    columns = ["module", "slot", "role", "role name", "quantizer"]
    roles = [] if policy is None else slot_roles(model, recipe)
    if policy is not None:
        columns.append("rule")
        rows = [(*r, policy.rule_name(role)) for r, role in zip(rows, roles, strict=True)]
    # long names fold to fit the terminal (never cut); slot and role stay on one line
    for col in columns:
        table.add_column(col, no_wrap=col in ("slot", "role"), overflow="fold")
    last = None
    for module, *rest in rows:
        table.add_row("" if module == last else module, *rest)
        last = module
    table.caption = f"{len(rows)} slots in {len({r[0] for r in rows})} modules"
    if any(r[2] == "-" for r in rows):
        table.caption += (
            "; role -: an output or grad-input slot whose neighbour is no dist-quant module, so "
            "no role names it (a CustomRecipe factory gets role None there)"
        )
    # the terminal's width on a terminal, else $COLUMNS or 80 (rich's rules)
    console = Console()
    console.print(table)
    for name in [] if policy is None else policy.unmatched(roles):
        console.print(f"warning: policy rule {name!r} matches no slot of {spec}", style="yellow")
    return 0
