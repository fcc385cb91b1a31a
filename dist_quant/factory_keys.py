"""Semantic keys for callables inside recipes: explicit (`@quantizer_factory(key=...)`) or fallback.

A recipe's key must change whenever its quantization changes, and a `CustomRecipe` is mostly its
factory. The best key is one the author states. Without one, `fallback_key` derives a key from
what Python can see of the callable, identically in every process (no `id()`, no `hash()` of
strings, which PYTHONHASHSEED changes):

- its qualified name;
- a sha256 digest of its code object (bytecode, constants recursively, names used), its defaults
  and keyword defaults, and its closure cells' contents: simple values by `repr`, tensors by dtype,
  shape and a digest of their bytes, nested functions recursively, containers element by element,
  dataclasses field by field, other objects by `repr` (with `at 0x...` addresses removed) or, when
  their repr is the default one, by their `__dict__`;
- for a bound method, its function and the object it is bound to; for a `functools.partial`, its
  function, arguments and keywords; for a callable object, its class's `__call__` and its state.

What the fallback cannot see, so a change there keeps the same key and nothing is rebuilt:
module globals the function reads (a global threshold, a global dict of layer names), objects
reached through attributes of a module it imports, state inside captured objects whose `repr`
does not show it (e.g. an `nn.Module`'s weights), and anything computed at call time from the
environment. Give such a factory an explicit key. The fallback warns once per distinct key.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import hashlib
import json
import re
import types
import warnings
from collections.abc import Callable
from typing import Any, TypeVar

import torch

KEY_ATTRIBUTE = "__quantizer_factory_key__"
"""Where `quantizer_factory` stores a callable's explicit key."""

_MAX_DEPTH = 8  # captured object graphs deeper than this are described by type only
_ADDRESS = re.compile(r" at 0x[0-9a-fA-F]+")
_warned: set[str] = set()

F = TypeVar("F", bound=Callable)


def quantizer_factory(key: str | Callable | None = None) -> Any:
    """Give a factory (or any recipe callable) a stable semantic key.

    `@quantizer_factory(key="attn_current.v2")` states the key; bump it when the behaviour
    changes. `@quantizer_factory` / `@quantizer_factory()` use the import path
    `"module:qualname"`, which is right for a module-level function whose behaviour is fixed by
    its code; a local function needs an explicit key (its name does not say what it captured).
    The function itself is returned, so it stays importable and picklable.
    """
    if callable(key):
        return quantizer_factory(None)(key)
    if key is not None and not (isinstance(key, str) and key):
        raise ValueError(f"quantizer_factory: key must be a non-empty str or None, got {key!r}")

    def decorate(fn: F) -> F:
        if not callable(fn):
            raise TypeError(f"quantizer_factory decorates a callable, got {fn!r}")
        chosen = key
        if chosen is None:
            qualname = getattr(fn, "__qualname__", None)
            if not isinstance(qualname, str) or "<" in qualname:
                raise ValueError(
                    f"quantizer_factory: {fn!r} is a lambda or local function; give it an "
                    "explicit key=... describing what it captured"
                )
            chosen = f"{fn.__module__}:{qualname}"
        try:
            setattr(fn, KEY_ATTRIBUTE, chosen)
        except (AttributeError, TypeError) as e:
            raise TypeError(
                f"quantizer_factory: cannot attach a key to {fn!r} ({e}); decorate the "
                "underlying function, or pass CustomRecipe(qfactory_key=...)"
            ) from e
        return fn

    return decorate


def explicit_key(fn: Callable) -> str | None:
    """The key given by `quantizer_factory`, or None."""
    key = getattr(fn, KEY_ATTRIBUTE, None)
    return key if isinstance(key, str) else None


def callable_key(fn: Callable) -> str:
    """The explicit key of `fn`, else its fallback key (with a one-time UserWarning)."""
    key = explicit_key(fn)
    if key is not None:
        return key
    key = fallback_key(fn)
    if key not in _warned:
        _warned.add(key)
        # short: it is printed once per factory, often in the middle of a test or training log
        warnings.warn(
            f"{key}: fallback key from the factory's code and captures (blind to globals it "
            "reads); give it @quantizer_factory(key=...) or CustomRecipe(qfactory_key=...)",
            UserWarning,
            stacklevel=3,
        )
    return key


def fallback_key(fn: Callable) -> str:
    """`"<qualified name>#<sha256 prefix>"` of what `fn` does and captures (module docstring)."""
    description = _describe(fn, 0, set())
    digest = hashlib.sha256(description.encode("utf-8", "backslashreplace")).hexdigest()
    return f"{_name_of(fn)}#{digest[:24]}"


def _name_of(fn: Callable) -> str:
    if isinstance(fn, functools.partial):
        return f"functools.partial({_name_of(fn.func)})"
    qualname = getattr(fn, "__qualname__", None)
    if not isinstance(qualname, str):
        qualname = type(fn).__qualname__  # a callable object
        module = type(fn).__module__
    else:
        module = getattr(fn, "__module__", None) or type(fn).__module__
    return f"{module}.{qualname}"


def _describe(obj: Any, depth: int, active: set[int]) -> str:
    """A canonical, process-independent text for `obj` (`active`: ids on the stack, for cycles)."""
    if obj is None or isinstance(obj, (bool, int, float, complex, str, bytes)):
        return repr(obj)
    if isinstance(obj, enum.Enum):
        return f"{type(obj).__qualname__}.{obj.name}"
    if isinstance(obj, (torch.dtype, torch.device)):
        return repr(obj)
    if isinstance(obj, types.ModuleType):
        return f"module {obj.__name__}"
    if isinstance(obj, type):
        return f"class {obj.__module__}.{obj.__qualname__}"
    if depth > _MAX_DEPTH:
        return f"<{type(obj).__qualname__} beyond depth {_MAX_DEPTH}>"
    if id(obj) in active:
        return "<cycle>"
    active.add(id(obj))
    try:
        return _describe_compound(obj, depth + 1, active)
    finally:
        active.discard(id(obj))


def _describe_compound(obj: Any, depth: int, active: set[int]) -> str:
    d = functools.partial(_describe, depth=depth, active=active)
    if isinstance(obj, torch.Tensor):
        return _describe_tensor(obj)
    if isinstance(obj, types.CodeType):
        consts = ",".join(d(c) for c in obj.co_consts)
        return f"code({obj.co_code.hex()};consts=({consts});names={obj.co_names!r})"
    if isinstance(obj, (tuple, list)):
        return f"{type(obj).__name__}({','.join(d(x) for x in obj)})"
    if isinstance(obj, (set, frozenset)):
        # iteration order follows string hashes, which PYTHONHASHSEED changes: sort
        return f"{type(obj).__name__}({','.join(sorted(d(x) for x in obj))})"
    if isinstance(obj, dict):
        items = sorted(f"{d(k)}:{d(v)}" for k, v in obj.items())
        return f"dict({','.join(items)})"
    if callable(obj):
        return _describe_callable(obj, d)
    if dataclasses.is_dataclass(obj):
        fields = ",".join(f"{f.name}={d(getattr(obj, f.name))}" for f in dataclasses.fields(obj))
        return f"{type(obj).__qualname__}({fields})"
    return _describe_object(obj, d)


def _describe_callable(fn: Callable, d: Callable[[Any], str]) -> str:
    key = explicit_key(fn)
    if key is not None:
        return f"key {key!r}"  # the author's word replaces the code
    if isinstance(fn, functools.partial):
        return f"partial({d(fn.func)};args={d(fn.args)};kwargs={d(fn.keywords)})"
    if isinstance(fn, types.MethodType):
        return f"method({d(fn.__func__)};self={d(fn.__self__)})"
    if isinstance(fn, types.FunctionType):
        cells = []
        for name, cell in zip(fn.__code__.co_freevars, fn.__closure__ or (), strict=True):
            try:
                cells.append(f"{name}={d(cell.cell_contents)}")
            except ValueError:  # a cell not yet assigned
                cells.append(f"{name}=<empty>")
        return (
            f"function {fn.__module__}.{fn.__qualname__}(code={d(fn.__code__)};"
            f"defaults={d(fn.__defaults__)};kwdefaults={d(fn.__kwdefaults__)};"
            f"closure=({','.join(cells)}))"
        )
    if isinstance(fn, (types.BuiltinFunctionType, types.BuiltinMethodType)):
        bound = getattr(fn, "__self__", None)
        owner = "" if bound is None or isinstance(bound, types.ModuleType) else d(bound)
        return f"builtin {getattr(fn, '__module__', None)}.{fn.__qualname__}({owner})"
    call = d(type(fn).__call__)  # a callable object: its class's code plus its own state
    return f"callable {type(fn).__qualname__}(call={call};state={_describe_object(fn, d)})"


def _describe_object(obj: Any, d: Callable[[Any], str]) -> str:
    name = f"{type(obj).__module__}.{type(obj).__qualname__}"
    if type(obj).__repr__ is not object.__repr__:
        return f"{name}:{_ADDRESS.sub('', repr(obj))}"
    state = getattr(obj, "__dict__", None)
    return f"{name}:{d(state)}" if isinstance(state, dict) else name


def _describe_tensor(t: torch.Tensor) -> str:
    head = f"tensor({t.dtype},{tuple(t.shape)}"
    if t.layout != torch.strided or t.device.type == "meta":
        return head + f",{t.layout})"
    raw = t.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8)
    return head + f",{hashlib.sha256(raw.numpy().tobytes()).hexdigest()})"


BUILDER_ATTRIBUTE = "__quantizer_factory_builder__"
"""Where `built_by` stores `(builder import path, params)` of a factory made by a builder."""


def built_by(path: str, params: dict[str, Any]) -> Callable[[F], F]:
    """Mark a factory made by the module-level builder at `path` ("pkg.module:name") from the
    JSON-serialisable `params`: `Recipe.to_dict()` writes it as `{"builder": path, "params":
    params}` and `recipe_from_dict` rebuilds it by calling `builder(**params)`. This is how a
    factory with bound parameters (layer names, say) crosses the wire; give it an explicit key
    derived from the same params."""
    try:
        json.dumps(params, allow_nan=False)
    except (TypeError, ValueError) as e:
        raise ValueError(f"built_by({path!r}): params must be JSON-serialisable: {e}") from e

    def mark(fn: F) -> F:
        setattr(fn, BUILDER_ATTRIBUTE, (path, params))
        return fn

    return mark


def builder_of(fn: Callable) -> tuple[str, dict[str, Any]] | None:
    """`(path, params)` of a factory marked with `built_by`, else None."""
    return getattr(fn, BUILDER_ATTRIBUTE, None)


PARTS_ATTRIBUTE = "__quantizer_factory_parts__"
"""Where `answered_by_parts` stores the function naming the part that answers a slot."""


def answered_by_parts(part_of: Callable[[Any], str]) -> Callable[[F], F]:
    """Mark a factory whose answers come from named parts (a policy's rules): `part_of(role)`
    names the part answering a slot. A plan digests each part's slots apart, so when the ranks of
    a tensor-parallel group disagree, the coordinator names the parts that differ."""

    def mark(fn: F) -> F:
        setattr(fn, PARTS_ATTRIBUTE, part_of)
        return fn

    return mark


def parts_of(fn: Callable) -> Callable[[Any], str] | None:
    """The part-naming function of a factory marked with `answered_by_parts`, else None."""
    return getattr(fn, PARTS_ATTRIBUTE, None)
