"""Checkpoint and resume of recipe and scaling state, bit-exact.

Every dist-quant module's `state_dict()` carries one extra-state entry, `<prefix>_extra_state`:

    {"format": "dist_quant.extra_state/1",
     "module": "layers.3.fc1",              # the role name its quantizer roles carry
     "recipe": recipe.to_dict() | None,     # None: no recipe yet, or not serialisable (see below)
     "recipe_key": recipe.digest() (sha256 hex of repr(recipe.key())) | None,
     "recipe_key_repr": repr(recipe.key()) | None,   # for error messages
     "recipe_note": "" | why "recipe" is None although a recipe ran,
     "pinned": bool,                        # set by apply_recipe / the coordinator
     "roles": {"forward": [[module_type, tensor_type, name] | None, ...], "backward": [...]} | None,
     "buffers": {"forward.scale": Tensor, "forward.amax_history": Tensor, "backward.scale": ...}}

Only plain types and (copied) tensors, so `torch.load(weights_only=True)` reads it and loading a
state dict in place (torch.distributed.checkpoint does) never writes into the live buffers.

Loading one module's entry validates everything first, then mutates:
- the module has a runtime: its recipe key and roles must equal the checkpoint's, else
  `RecipeUpdateError` with the one-liner `ONE_LINER`; the buffers are copied into the runtime's
  own tensors (quantizers hold views of them);
- it has none: the checkpoint's recipe is rebuilt (`recipe_from_dict`, key checked), planned and
  published for it, so a fresh model resumes on the recipe it was on, then the buffers are copied.
  A recipe that could not be serialised (an unkeyed closure factory) cannot be rebuilt: apply the
  same recipe object first;
- the checkpoint had no runtime: the module drops its own, so it resolves its recipe at its next
  forward exactly as the checkpointed module would have.
Loading plans the model first (provisionally until the load commits): a module not yet planned takes
the checkpoint's name, so its roles are the ones it ran with, and blocks wire their boundary roles.

Whole models (the all-or-nothing load, `recipe_of`, `save` / `load`) are in `model.py`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor, nn

from dist_quant.binding import assign_role_names, provisional_role_names
from dist_quant.kinds import Direction
from dist_quant.recipes import HighPrecision, Recipe, key_digest, recipe_from_dict
from dist_quant.runtime import (
    ModuleCandidate,
    ModuleRuntime,
    RecipeUpdateError,
    plan_module,
    publish_candidates,
)

if TYPE_CHECKING:  # the modules sit above this format: they call it from get/set_extra_state
    from dist_quant.modules.base import QuantizedModule

FORMAT = "dist_quant.extra_state/1"
ONE_LINER = "dq.apply_recipe(model, dq.checkpoint.recipe_of(state_dict))"
_DIRECTIONS = tuple(d.value for d in Direction)  # forward first, as (fwd_state, bwd_state)
_FIELDS: dict[str, tuple[type, ...]] = {
    "format": (str,),
    "module": (str,),
    "recipe": (dict, type(None)),
    "recipe_key": (str, type(None)),
    "recipe_key_repr": (str, type(None)),
    "recipe_note": (str,),
    "pinned": (bool,),
    "roles": (dict, type(None)),
    "buffers": (dict,),
}


# Before `HighPrecision` existed, "bf16" was a CustomRecipe of `factories.high_precision`, and
# checkpoints and decision logs of those runs record that recipe. It quantizes exactly as
# HighPrecision does, so reading one takes it as HighPrecision: a fresh model resumes on "bf16",
# and a model already on "bf16" (or on the old spelling) loads it.
_LEGACY_BF16_KEY = (
    "CustomRecipe",
    ("dist_quant.factories.high_precision.v1", None, "HYBRID", False, False),
)
_LEGACY_BF16_DIGEST = key_digest(_LEGACY_BF16_KEY)


def read_digest(digest: str) -> str:
    """A recorded recipe digest as this version names that recipe (the legacy "bf16" spelling
    as `HighPrecision().digest()`); any other digest unchanged."""
    return HighPrecision().digest() if digest == _LEGACY_BF16_DIGEST else digest


# ---- saving -------------------------------------------------------------------------------------
def _encode_roles(roles: tuple) -> list:
    return [None if r is None else [r.module_type, r.tensor_type, r.name] for r in roles]


def _runtime_buffers(rt: ModuleRuntime) -> dict[str, Tensor]:
    out = {}
    for direction, state in zip(_DIRECTIONS, (rt.fwd_state, rt.bwd_state)):
        out.update({f"{direction}.{k}": v for k, v in state.persistent_buffers().items()})
    return out


def module_extra_state(module: QuantizedModule) -> dict[str, Any]:
    """What `QuantizedModule.get_extra_state` returns (see the module docstring)."""
    rt = module.quant_binding.runtime if module.owns_quantizers else None
    state: dict[str, Any] = {
        "format": FORMAT,
        "module": module.role_name,
        "recipe": None,
        "recipe_key": None,
        "recipe_key_repr": None,
        "recipe_note": "",
        "pinned": False,
        "roles": None,
        "buffers": {},
    }
    if rt is None:
        return state
    try:
        state["recipe"] = rt.recipe.to_dict()
    except ValueError as e:  # a lambda / closure factory: resuming needs the same object applied
        state["recipe_note"] = str(e)
    state["recipe_key"] = key_digest(rt.recipe_key)
    state["recipe_key_repr"] = repr(rt.recipe_key)
    state["pinned"] = module.quant_binding.pinned_recipe is not None
    state["roles"] = {
        "forward": _encode_roles(rt.fwd_roles),
        "backward": _encode_roles(rt.bwd_roles),
    }
    # copies: a state dict loaded in place (DCP) must not write into the live buffers
    state["buffers"] = {k: v.detach().clone() for k, v in _runtime_buffers(rt).items()}
    return state


# ---- validating ---------------------------------------------------------------------------------
def _check_roles(roles: object, where: str) -> None:
    if not isinstance(roles, dict) or sorted(roles) != sorted(_DIRECTIONS):
        raise ValueError(f"{where}: 'roles' must map 'forward' and 'backward' to lists")
    for direction, slots in roles.items():
        if not isinstance(slots, list) or not all(
            s is None
            or (isinstance(s, list) and len(s) == 3 and all(isinstance(x, str) for x in s))
            for s in slots
        ):
            raise ValueError(
                f"{where}: roles[{direction!r}] must be a list of None or "
                "[module_type, tensor_type, name]"
            )


def parse_extra_state(state: object, where: str) -> dict[str, Any]:
    """Check `state` is a well-formed extra state of this format; ValueError naming `where`."""
    if not isinstance(state, Mapping):
        raise ValueError(
            f"{where}: extra state is a {type(state).__name__}, not a dist-quant extra state "
            f"({FORMAT!r}): an old-format or foreign checkpoint"
        )
    fmt = state.get("format")
    if fmt != FORMAT:
        raise ValueError(
            f"{where}: extra state format {fmt!r} is not supported; this version reads {FORMAT!r} "
            "(an old-format or foreign checkpoint)"
        )
    missing, unknown = sorted(_FIELDS.keys() - state.keys()), sorted(state.keys() - _FIELDS.keys())
    if missing or unknown:
        raise ValueError(f"{where}: corrupted extra state: missing {missing}, unknown {unknown}")
    for name, types in _FIELDS.items():
        if not isinstance(state[name], types):
            got = type(state[name]).__name__
            raise ValueError(f"{where}: corrupted extra state: {name!r} is a {got}")
    ran = state["recipe_key"] is not None
    if ran:
        if len(state["recipe_key"]) != 64 or state["recipe_key_repr"] is None:
            raise ValueError(f"{where}: corrupted extra state: malformed 'recipe_key'")
        if state["recipe"] is None and not state["recipe_note"]:
            raise ValueError(f"{where}: corrupted extra state: a recipe ran but none is recorded")
        _check_roles(state["roles"], where)
    elif state["recipe"] is not None or state["roles"] is not None or state["pinned"]:
        raise ValueError(f"{where}: corrupted extra state: a recipe without a 'recipe_key'")
    for name, t in state["buffers"].items():
        if not ran or not isinstance(name, str) or not isinstance(t, Tensor):
            raise ValueError(f"{where}: corrupted extra state: bad buffer entry {name!r}")
    parsed = dict(state)
    if ran and read_digest(state["recipe_key"]) != state["recipe_key"]:
        bf16 = HighPrecision()
        parsed.update(
            recipe=bf16.to_dict(), recipe_key=bf16.digest(), recipe_key_repr=repr(bf16.key())
        )
    return parsed


def rebuild_recipe(state: Mapping[str, Any], where: str) -> Recipe:
    """The recipe a parsed extra state ran, rebuilt from its dict and checked against its key."""
    if state["recipe"] is None:
        raise RecipeUpdateError(
            f"{where}: the checkpoint's recipe {state['recipe_key_repr']} was not serialisable "
            f"({state['recipe_note']}); apply that same recipe object before loading: "
            "dq.apply_recipe(model, recipe)"
        )
    try:
        recipe = recipe_from_dict(state["recipe"])
    except ValueError as e:
        raise ValueError(f"{where}: cannot rebuild the checkpoint's recipe: {e}") from e
    if recipe.digest() != state["recipe_key"]:
        raise RecipeUpdateError(
            f"{where}: the recipe rebuilt from the checkpoint has key {recipe.key()!r}, but the "
            f"checkpoint ran {state['recipe_key_repr']}: a factory's code or captured values "
            "changed since the checkpoint was taken (or the checkpoint is corrupted)"
        )
    return recipe


@dataclass
class StagedLoad:
    """One module's validated load; `apply()` only assigns attributes and copies checked tensors."""

    module: QuantizedModule
    action: str  # "none" | "clear" | "keep" | "install"
    candidate: ModuleCandidate | None = None
    names: dict[nn.Module, str] | None = None  # plan the module's structure first, with these
    pinned: bool = False
    copies: list[tuple[Tensor, Tensor]] = field(default_factory=list)

    def apply(self) -> None:
        m = self.module
        if self.names is not None:
            assign_role_names(m, self.names)
        if self.action == "clear":
            m.quant_binding.clear()
            return
        if self.action == "install":
            publish_candidates([self.candidate], self.candidate.runtime.recipe_key)
        if self.action in ("keep", "install"):
            m.quant_binding.pin(m.quant_binding.recipe if self.pinned else None)
        with torch.no_grad():
            for dst, src in self.copies:
                dst.copy_(src)  # in place: quantizers view these tensors


def checkpoint_names(owners: Mapping[str, QuantizedModule], state_dict: Mapping) -> dict:
    """The names a loading model's not yet planned modules take from the checkpoint: the name each
    ran with (a recipe ran, or a name was set), so its roles are the ones it checkpointed."""
    names: dict[nn.Module, str] = {}
    for key, m in owners.items():
        value = state_dict.get(key)
        if m.is_planned or not isinstance(value, Mapping) or value.get("format") != FORMAT:
            continue  # a malformed entry is reported, naming its key, when it is staged
        name = value.get("module")
        if isinstance(name, str) and (name or value.get("recipe_key") is not None):
            names[m] = name
    return names


def _match_buffers(targets: dict[str, Tensor], saved: dict[str, Tensor], where: str) -> list:
    if targets.keys() != saved.keys():
        raise ValueError(
            f"{where}: the checkpoint holds scaling buffers {sorted(saved)}, the module's recipe "
            f"state has {sorted(targets)} (corrupted checkpoint)"
        )
    for name, t in targets.items():
        s = saved[name]
        if s.shape != t.shape or s.dtype != t.dtype:
            raise ValueError(
                f"{where}: buffer {name!r} is {s.dtype} {tuple(s.shape)} in the checkpoint, the "
                f"module's is {t.dtype} {tuple(t.shape)} (corrupted or from another model)"
            )
    return [(targets[n], saved[n]) for n in targets]


def _mismatch(where: str, saved: Mapping[str, Any], rt: ModuleRuntime) -> RecipeUpdateError:
    return RecipeUpdateError(
        f"{where}: the checkpoint was taken under recipe {saved['recipe_key_repr']}, but the "
        f"module runs {rt.recipe_key!r}; loading would mix recipes. Switch the model to the "
        f"checkpoint's recipe first ({ONE_LINER}) or load into a fresh model."
    )


def stage_extra_state(module: QuantizedModule, state: object, where: str = "") -> StagedLoad:
    """Validate `state` against `module` and prepare its load; mutates nothing. A module not yet
    planned is planned first (from itself, under the checkpoint's name), provisionally: its
    names and boundary roles are fixed only when the load is applied."""
    where = where or f"module {module.role_name or type(module).__name__!r}"
    saved = parse_extra_state(state, where)
    if module.is_planned:
        return _stage_planned(module, saved, where)
    names = checkpoint_names({"": module}, {"": saved})
    with provisional_role_names(module):
        assign_role_names(module, names)
        staged = _stage_planned(module, saved, where)
    staged.names = names
    return staged


def _stage_planned(module: QuantizedModule, saved: dict[str, Any], where: str) -> StagedLoad:
    if not module.owns_quantizers:
        if saved["recipe_key"] is not None:
            raise ValueError(
                f"{where}: the checkpoint has a recipe for a module without quantizers"
            )
        return StagedLoad(module, "none")
    if saved["recipe_key"] is None:
        return StagedLoad(module, "clear" if module.quant_binding.runtime is not None else "none")
    rt = module.quant_binding.runtime
    if rt is not None:
        if read_digest(key_digest(rt.recipe_key)) != saved["recipe_key"]:
            raise _mismatch(where, saved, rt)
        staged = StagedLoad(module, "keep", pinned=saved["pinned"])
    else:
        candidate = plan_module(module, rebuild_recipe(saved, where))
        rt = candidate.runtime
        staged = StagedLoad(module, "install", candidate, pinned=saved["pinned"])
    have = {"forward": _encode_roles(rt.fwd_roles), "backward": _encode_roles(rt.bwd_roles)}
    if have != saved["roles"]:
        raise RecipeUpdateError(
            f"{where}: the module's quantizer roles {have} differ from the checkpoint's "
            f"{saved['roles']} (renamed or restructured module); its scaling state would land in "
            "other slots"
        )
    staged.copies = _match_buffers(_runtime_buffers(rt), saved["buffers"], where)
    return staged


def load_module_extra_state(module: QuantizedModule, state: object) -> None:
    """What `QuantizedModule.set_extra_state` does: validate, then load (see the docstring)."""
    stage_extra_state(module, state).apply()


__all__ = [
    "FORMAT",
    "ONE_LINER",
    "StagedLoad",
    "checkpoint_names",
    "load_module_extra_state",
    "module_extra_state",
    "parse_extra_state",
    "rebuild_recipe",
    "read_digest",
    "stage_extra_state",
]
