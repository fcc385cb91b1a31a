"""Whole-model checkpoints: the all-or-nothing load, `recipe_of`, `save` / `load` over torch.save.

`nn.Module.load_state_dict` loads module by module and would leave earlier modules loaded when a
later one fails; `load_state_dict(model, state_dict)` here validates every module's extra state
(`module_state.stage_extra_state`) and every tensor's shape before anything is copied. Loading
plans the model first (provisionally until the load commits): a module not yet planned takes the
checkpoint's name, so its roles are the ones it ran with, and blocks wire their boundary roles.
`save` / `load` wrap plain `torch.save` and store a caller's `job` mapping as it is (the
coordinator's switch state, `dist_quant.coordinator.job_state`); `dcp.py` does the same for
torch.distributed.checkpoint. See docs/checkpoint.md.
"""

from __future__ import annotations

import contextlib
import os
from collections import OrderedDict
from collections.abc import Callable, Mapping
from typing import IO, Any

import torch
from torch import Tensor, nn
from torch.nn.modules.module import _IncompatibleKeys

from dist_quant.binding import STATE_DICT_TRANSPARENT, assign_role_names, provisional_role_names
from dist_quant.checkpoint.module_state import (
    FORMAT,
    checkpoint_names,
    parse_extra_state,
    rebuild_recipe,
    stage_extra_state,
)
from dist_quant.modules.base import QuantizedModule
from dist_quant.recipes import Recipe

CHECKPOINT_FORMAT = "dist_quant.checkpoint/1"
EXTRA_STATE_SUFFIX = "_extra_state"  # torch's key for get_extra_state()


def _unwrap(state_dict: Mapping[str, Any]) -> Mapping[str, Any]:
    if state_dict.get("format") == CHECKPOINT_FORMAT and isinstance(
        state_dict.get("model"), Mapping
    ):
        return state_dict["model"]  # a checkpoint written by `save`
    return state_dict


def recipe_of(state_dict: Mapping[str, Any]) -> Recipe:
    """The recipe the checkpoint's dist-quant modules ran: `ONE_LINER` switches a model to it.

    Accepts a model state dict or a checkpoint written by `save`. ValueError when no module ran a
    recipe or they ran several (load into a fresh model then: each module takes its own).
    """
    found: dict[str, tuple[str, dict]] = {}
    for key, value in _unwrap(state_dict).items():
        if key.endswith(EXTRA_STATE_SUFFIX) and isinstance(value, Mapping):
            if value.get("format") != FORMAT:
                continue  # another library's extra state
            saved = parse_extra_state(value, f"{key!r}")
            if saved["recipe_key"] is not None:
                found.setdefault(saved["recipe_key"], (key, saved))
    if not found:
        raise ValueError("recipe_of: no dist-quant module in this state dict ran a recipe")
    if len(found) > 1:
        ran = "; ".join(f"{k!r}: {s['recipe_key_repr']}" for k, s in found.values())
        raise ValueError(
            f"recipe_of: the modules ran {len(found)} different recipes ({ran}); one apply_recipe "
            "cannot reproduce that: load into a fresh model, where each module takes its own"
        )
    key, saved = next(iter(found.values()))
    return rebuild_recipe(saved, f"{key!r}")


def _dq_modules_by_key(model: nn.Module) -> dict[str, QuantizedModule]:
    """Every dist-quant module by the state-dict key of its extra state."""
    out = {}
    for prefix, m in model.named_modules(remove_duplicate=False):
        if isinstance(m, QuantizedModule):
            path = [p for p in prefix.split(".") if p and p not in STATE_DICT_TRANSPARENT]
            out[".".join((*path, EXTRA_STATE_SUFFIX))] = m
    return out


def stage_model(
    model: nn.Module, state_dict: Mapping[str, Any], strict: bool = True
) -> Callable[[], _IncompatibleKeys]:
    """Validate all of `state_dict` against `model`; return the function that loads it."""
    if not isinstance(state_dict, Mapping):
        raise ValueError(f"load_state_dict: expected a mapping, got {type(state_dict).__name__}")
    expected = model.state_dict(keep_vars=True)
    missing = [k for k in expected if k not in state_dict]
    unexpected = [k for k in state_dict if k not in expected]
    if strict and (missing or unexpected):
        raise ValueError(f"load_state_dict: missing keys {missing}, unexpected keys {unexpected}")
    problems = []
    for k, want in expected.items():
        got = state_dict.get(k)
        if isinstance(want, Tensor) and k in state_dict:
            if not isinstance(got, Tensor):
                problems.append(f"{k!r} is a {type(got).__name__}, not a tensor")
            elif got.shape != want.shape:
                problems.append(f"{k!r} is {tuple(got.shape)}, the model's {tuple(want.shape)}")
    if problems:
        raise ValueError("load_state_dict: " + "; ".join(problems))
    owners = _dq_modules_by_key(model)
    # Loading is a plan of the model: its modules not planned yet are named (the checkpoint's
    # names where it has them) and wired from the model's structure, provisionally until commit.
    names = checkpoint_names(owners, state_dict)
    with provisional_role_names(model):
        assign_role_names(model, names)
        staged = [
            stage_extra_state(owners[k], state_dict[k], f"{k!r}") for k in owners if k in state_dict
        ]
    rest: OrderedDict[str, Any] = OrderedDict(
        (k, v) for k, v in state_dict.items() if k not in owners
    )
    metadata = getattr(state_dict, "_metadata", None)
    if metadata is not None:
        rest._metadata = metadata  # torch's per-module versions

    def commit() -> _IncompatibleKeys:
        model.load_state_dict(rest, strict=False)  # shapes checked above: cannot stop half-way
        assign_role_names(model, names)  # the same plan as staged: names, then boundary roles
        for s in staged:
            s.apply()
        return _IncompatibleKeys(missing, unexpected)

    return commit


def load_state_dict(
    model: nn.Module, state_dict: Mapping[str, Any], strict: bool = True
) -> _IncompatibleKeys:
    """`model.load_state_dict`, all or nothing: every dist-quant extra state and every tensor's
    shape is validated before anything is copied. Raises ValueError / RecipeUpdateError naming the
    key; the model is then exactly as before."""
    return stage_model(model, state_dict, strict)()


# ---- plain torch.save ---------------------------------------------------------------------------
PathLike = str | os.PathLike[str] | IO[bytes]


def save(
    f: PathLike,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    *,
    job: Mapping[str, Any] | None = None,
    extra: Mapping[str, Any] | None = None,
) -> None:
    """`torch.save` of the model (with its dist-quant state), the optimizer, `job` (the switch
    protocol's plain data: `dist_quant.coordinator.job_state(...)`) and `extra` (plain data: step,
    RNG states...); `load` reads it back.

    To a path the write is atomic (a temporary file beside it, fsynced, then renamed): a rank
    killed while saving (SIGTERM from a scheduler lands at any time) leaves the previous
    checkpoint under the name, never a torn file that the resumed job cannot load."""
    obj = {
        "format": CHECKPOINT_FORMAT,
        "model": model.state_dict(),
        "optimizer": None if optimizer is None else optimizer.state_dict(),
        "job": None if job is None else dict(job),
        "extra": None if extra is None else dict(extra),
    }
    if not isinstance(f, str | os.PathLike):
        torch.save(obj, f)
        return
    path = os.fspath(f)
    tmp = f"{path}.{os.getpid()}.tmp"
    try:
        with open(tmp, "wb") as out:
            torch.save(obj, out)
            out.flush()
            os.fsync(out.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


def load(
    f: PathLike,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    *,
    map_location: Any = None,
    strict: bool = True,
) -> dict[str, Any]:
    """Load a checkpoint written by `save` (with `weights_only=True`: no code runs but the recipes'
    own factory imports). Validates the model state, then loads the optimizer (torch checks it
    before changing anything), then the model. Returns {"job": ..., "extra": ...}."""
    ckpt = torch.load(f, map_location=map_location, weights_only=True)
    if not isinstance(ckpt, Mapping) or ckpt.get("format") != CHECKPOINT_FORMAT:
        got = ckpt.get("format") if isinstance(ckpt, Mapping) else type(ckpt).__name__
        raise ValueError(f"load: not a {CHECKPOINT_FORMAT!r} checkpoint (got {got!r})")
    commit = stage_model(model, ckpt["model"], strict)
    if optimizer is not None:
        if ckpt["optimizer"] is None:
            raise ValueError("load: the checkpoint holds no optimizer state")
        optimizer.load_state_dict(ckpt["optimizer"])
    commit()
    return {"job": ckpt["job"], "extra": ckpt["extra"]}


__all__ = [
    "CHECKPOINT_FORMAT",
    "EXTRA_STATE_SUFFIX",
    "load",
    "load_state_dict",
    "recipe_of",
    "save",
    "stage_model",
]
