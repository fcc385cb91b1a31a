"""Recipes: frozen descriptions of how every GEMM operand is quantized, and their semantic keys.

A recipe is a frozen dataclass validated at construction. `key()` is derived from the dataclass
fields themselves (never from a second, hand-kept list), so a field added later is part of the key
automatically. It is computed once per instance (every `autocast(recipe=...)` entry asks) and kept
with the field values it was computed from, so even an `object.__setattr__` bypass of the freeze
shows up as a new key. Callables inside a recipe (a `CustomRecipe` factory, a `DelayedScaling`
algorithm) enter the key through `callable_key()`.

`digest()` is the key as a stable string (sha256 of its repr, the same in every process): what
checkpoints record and compare. Each recipe type has a `name`, the first element of its key and
its JSON `"type"`: the class name, except `HighPrecision`, the all-identity recipe, named "bf16".

`to_dict()` / `recipe_from_dict()` / `recipe_from_json()` round-trip recipes through JSON, with
callables written as their import path `"pkg.module:qualname"`. Importing that path runs the
module's top-level code: only load recipes from people allowed to run code in the job.
"""

from __future__ import annotations

import dataclasses
import enum
import hashlib
import importlib
import json
from collections.abc import Callable, Hashable, Mapping
from typing import Any, ClassVar

from dist_quant.checks import (
    AMAX_COMPUTE_ALGOS,
    check_amax_algo,
    check_bool,
    check_float,
    check_format,
    check_int,
    check_margin,
    check_overrides,
)
from dist_quant.factory_keys import builder_of, callable_key, quantizer_factory
from dist_quant.formats import Format

__all__ = [
    "AMAX_COMPUTE_ALGOS",
    "BUILTIN_RECIPE_NAMES",
    "CustomRecipe",
    "DelayedScaling",
    "Float8BlockScaling",
    "Float8CurrentScaling",
    "HighPrecision",
    "MXFP8BlockScaling",
    "NVFP4BlockScaling",
    "Recipe",
    "builtin_recipe",
    "key_digest",
    "quantizer_factory",
    "recipe_from_dict",
    "recipe_from_json",
]

BUILTIN_RECIPE_NAMES = ("delayed", "current", "mxfp8", "block", "nvfp4", "bf16")

# Field kinds for (de)serialisation, kept in each field's metadata next to its default.
_FORMAT = {"kind": "format"}
_CALLABLE = {"kind": "callable"}  # a callable, written as "pkg.module:qualname"
_ALGO = {"kind": "algo"}  # one of AMAX_COMPUTE_ALGOS or a callable
_OVERRIDE = {"keyed_when_set": True}  # a per-pass override, added after the first recipes


def recipe_fields(recipe: Any) -> tuple[dataclasses.Field, ...]:
    """A recipe's fields in the order its key, dict and messages list them: the recipe's own,
    then the ones added later (`keyed_when_set`, inherited from `PassOverrides` first in
    `dataclasses.fields`), so keys and dicts keep the order they were first written in."""
    fields = dataclasses.fields(recipe)
    later = tuple(f for f in fields if f.metadata.get("keyed_when_set"))
    return tuple(f for f in fields if f not in later) + later


def _check_fp8_attention(owner: str, fp8_dpa: object, fp8_mha: object) -> None:
    check_bool(owner, "fp8_dpa", fp8_dpa)
    check_bool(owner, "fp8_mha", fp8_mha)
    if fp8_mha and not fp8_dpa:
        raise ValueError(f"{owner}.fp8_mha=True needs fp8_dpa=True (FP8 attention inside FP8 MHA)")


# Pure E5M2 would quantize forward activations and weights in E5M2 (2 mantissa bits); Transformer
# Engine rejects it for per-tensor recipes, and so do we.
_PER_TENSOR_FORMATS = (Format.HYBRID, Format.E4M3)
_NO_E5M2_FORWARD = " (E5M2 would quantize the forward pass; HYBRID uses E5M2 for gradients only)"
_E4M3_ONLY = " (block-scaled recipes use E4M3 in both directions)"


def key_digest(key: Hashable) -> str:
    """A recipe key as a stable string: keys hold only strings, numbers, bools, None and tuples,
    whose repr is the same in every process. `Recipe.digest()` is this of its `key()`."""
    return hashlib.sha256(repr(key).encode()).hexdigest()


class Recipe:
    """Base of every recipe: a frozen dataclass with a semantic `key()`, its `digest()` and a
    JSON round trip."""

    name: ClassVar[str]
    """The recipe type's name: its key's first element and its JSON "type" (the class name
    unless the class sets another)."""

    # (field values, key) of the last key() call. A slot, not a field: outside __dict__ (whose
    # values are the fields), equality, hashing, repr, replace() and to_dict().
    __slots__ = ("_key_memo",)

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if "name" not in cls.__dict__:
            cls.name = cls.__name__

    def key(self) -> tuple:
        """`(type name, normalised field values)`: equal keys <=> identical quantization.

        Enums become their value, callables their factory key (`callable_key`). A field added
        to a recipe type after its keys were first recorded (in checkpoints, decision logs) is
        marked `keyed_when_set`: it enters the key as a `(name, value)` pair only when it differs
        from its default, so recipes that do not use it keep the keys (and digests) they had.
        """
        fields_now = tuple(self.__dict__.values())
        try:
            fields_then, key = self._key_memo
            if fields_then == fields_now:
                return key
        except AttributeError:  # the first call
            pass
        values = []
        for f in recipe_fields(self):
            value = getattr(self, f.name)
            if not f.metadata.get("keyed_when_set"):
                values.append(self._key_value(f.name, value))
            elif value != f.default:
                values.append((f.name, self._key_value(f.name, value)))
        key = (self.name, tuple(values))
        object.__setattr__(self, "_key_memo", (fields_now, key))  # frozen: bypass the freeze
        return key

    def __getstate__(self) -> dict[str, Any]:
        # Only the fields: unpickling sets a slot with setattr, which a frozen dataclass refuses,
        # and another process computes its own key.
        return self.__dict__

    def digest(self) -> str:
        """The recipe's stable content digest: `key_digest(self.key())` (64 hex digits)."""
        return key_digest(self.key())

    def _key_value(self, name: str, value: Any) -> Any:
        if isinstance(value, enum.Enum):
            return value.value
        if callable(value):
            return callable_key(value)
        return value

    def to_dict(self) -> dict[str, Any]:
        """`{"type": ClassName, field: value, ...}`, JSON-serialisable.

        Formats are written by name, callables as `"pkg.module:qualname"`; a field added later
        (`keyed_when_set`) only when set; a callable that cannot be imported back by that path
        (lambda, closure, bound method, partial) raises ValueError.
        """
        out: dict[str, Any] = {"type": self.name}
        for f in recipe_fields(self):
            value = getattr(self, f.name)
            if f.metadata.get("keyed_when_set") and value == f.default:
                continue  # as in the key: the dict an older version wrote, byte for byte
            if isinstance(value, enum.Enum):
                out[f.name] = value.name
            elif callable(value) and builder_of(value) is not None:
                path, params = builder_of(value)
                out[f.name] = {"builder": path, "params": params}
            elif callable(value):
                out[f.name] = _import_path(value, f"{type(self).__name__}.{f.name}")
            else:
                out[f.name] = value
        return out


@dataclasses.dataclass(frozen=True)
class PassOverrides(Recipe):
    """The per-pass overrides every quantizing recipe takes, keyword only (Transformer Engine's
    `backward_override` and its forward twin); checked by `checks.check_overrides` in each
    recipe's `__post_init__`."""

    forward_override: str | None = dataclasses.field(default=None, kw_only=True, metadata=_OVERRIDE)
    """None: the forward quantizes; "high_precision": the forward's GEMMs run on the original
    operands (which the backward then quantizes as the recipe says)."""
    backward_override: str | None = dataclasses.field(
        default=None, kw_only=True, metadata=_OVERRIDE
    )
    """None: the backward quantizes; "high_precision": its GEMMs run on the original operands and
    gradient (exactly an unconverted model's backward); "dequantized": on the forward's quantized
    operands, dequantized, and the unquantized gradient."""


@dataclasses.dataclass(frozen=True)
class DelayedScaling(PassOverrides):
    """Per-tensor FP8 with scales from an amax history (Transformer Engine's default recipe)."""

    margin: int = 0
    """Scales are divided by 2**margin, leaving headroom for amax growth; 0..MAX_MARGIN (127)."""
    fp8_format: Format = dataclasses.field(default=Format.HYBRID, metadata=_FORMAT)
    """HYBRID: E4M3 forward, E5M2 backward; E4M3: E4M3 both ways."""
    amax_history_len: int = 1024
    """Steps of amax kept per slot."""
    amax_compute_algo: str | Callable = dataclasses.field(default="max", metadata=_ALGO)
    """"max" over the history, "most_recent", or `f(amax_history (L, n)) -> amax (n,)`."""
    scaling_factor_compute_algo: Callable | None = dataclasses.field(
        default=None, metadata=_CALLABLE
    )
    """None for `fp8_max / amax / 2**margin`, or `f(amax, scale, fp8_max, recipe) -> scale`."""
    reduce_amax: bool = True
    """All-reduce(MAX) the step's amaxes over the amax-reduction group before the update."""
    fp8_dpa: bool = False
    """Run dot-product attention in FP8."""
    fp8_mha: bool = False
    """Keep FP8 across the attention block's projections (needs fp8_dpa)."""

    def __post_init__(self) -> None:
        owner = "DelayedScaling"
        check_margin(owner, self.margin)
        check_format(owner, "fp8_format", self.fp8_format, _PER_TENSOR_FORMATS, _NO_E5M2_FORWARD)
        check_int(owner, "amax_history_len", self.amax_history_len, 1)
        check_amax_algo(owner, "amax_compute_algo", self.amax_compute_algo)
        if self.scaling_factor_compute_algo is not None and not callable(
            self.scaling_factor_compute_algo
        ):
            raise ValueError(
                f"{owner}.scaling_factor_compute_algo must be None or a callable, "
                f"got {self.scaling_factor_compute_algo!r}"
            )
        check_bool(owner, "reduce_amax", self.reduce_amax)
        _check_fp8_attention(owner, self.fp8_dpa, self.fp8_mha)
        check_overrides(owner, self, delayed_forward=True)


@dataclasses.dataclass(frozen=True)
class Float8CurrentScaling(PassOverrides):
    """Per-tensor FP8 with the scale computed from each tensor's own amax."""

    fp8_format: Format = dataclasses.field(default=Format.HYBRID, metadata=_FORMAT)
    """HYBRID: E4M3 forward, E5M2 backward; E4M3: E4M3 both ways."""
    use_power_2_scales: bool = False
    """Round each scale down to a power of two."""
    amax_epsilon: float = 0.0
    """Floor for the amax before the scale is computed."""
    fp8_dpa: bool = False
    """Run dot-product attention in FP8."""
    fp8_mha: bool = False
    """Keep FP8 across the attention block's projections (needs fp8_dpa)."""

    def __post_init__(self) -> None:
        owner = "Float8CurrentScaling"
        check_format(owner, "fp8_format", self.fp8_format, _PER_TENSOR_FORMATS, _NO_E5M2_FORWARD)
        check_bool(owner, "use_power_2_scales", self.use_power_2_scales)
        eps = check_float(owner, "amax_epsilon", self.amax_epsilon, 0.0)
        # 0 and 0.0 must give the same key *and* the same JSON
        object.__setattr__(self, "amax_epsilon", eps)
        _check_fp8_attention(owner, self.fp8_dpa, self.fp8_mha)
        check_overrides(owner, self)


@dataclasses.dataclass(frozen=True)
class MXFP8BlockScaling(PassOverrides):
    """MXFP8: blocks of 32 elements sharing a power-of-two E8M0 scale."""

    fp8_format: Format = dataclasses.field(default=Format.E4M3, metadata=_FORMAT)
    """E4M3 only (as in Transformer Engine), forward and backward."""

    def __post_init__(self) -> None:
        check_format("MXFP8BlockScaling", "fp8_format", self.fp8_format, (Format.E4M3,), _E4M3_ONLY)
        check_overrides("MXFP8BlockScaling", self)


@dataclasses.dataclass(frozen=True)
class Float8BlockScaling(PassOverrides):
    """FP8 with one fp32 scale per 1x128 tile (activations, gradients) or 128x128 block (weight)."""

    fp8_format: Format = dataclasses.field(default=Format.E4M3, metadata=_FORMAT)
    """E4M3 only (as in Transformer Engine), forward and backward."""
    use_power_2_scales: bool = True
    """Round each tile scale down to a power of two."""

    def __post_init__(self) -> None:
        owner = "Float8BlockScaling"
        check_format(owner, "fp8_format", self.fp8_format, (Format.E4M3,), _E4M3_ONLY)
        check_bool(owner, "use_power_2_scales", self.use_power_2_scales)
        check_overrides(owner, self)


@dataclasses.dataclass(frozen=True)
class NVFP4BlockScaling(PassOverrides):
    """NVFP4, Transformer Engine's contract: E2M1 values (two per byte), an E4M3 decode scale per
    16 consecutive elements (16x16 blocks for weights with `weight_2d`) and an fp32 global scale
    per tensor and direction, from that copy's own amax. Defaults follow Transformer Engine: a
    16x16 random Hadamard transform on the wgrad operands (the input's and the output gradient's
    columnwise copies), 2D weight blocks, stochastic rounding of the output gradient.

    The built-in name is "nvfp4". GEMMs are emulated exactly (per 16-block products in fp32) on
    CPUs and on Hopper, which has no FP4 tensor cores (see docs/nvfp4.md)."""

    input_rht: bool = True
    """Random Hadamard transform of the input's columnwise (wgrad) copy before it is quantized
    (its amax taken after the transform)."""
    grad_output_rht: bool = True
    """Random Hadamard transform of the output gradient's columnwise (wgrad) copy."""
    weight_2d: bool = True
    """16x16 weight blocks (rowwise and columnwise copies then hold the same values); False:
    1x16 blocks along each copy's contracted dim."""
    stochastic_rounding: bool = True
    """Round the output gradient's elements stochastically (unbiased) instead of to nearest."""
    seed: int = 0
    """Seed of the stochastic rounding; each cast draws from (seed, a per-quantizer offset that
    advances by one per cast), so a run is reproducible."""
    reduce_amax: bool = True
    """Max-reduce each global amax over the tensor-parallel group wherever a rank holds a shard
    of the tensor (sequence-parallel and feature-sharded operands), so the ranks quantize with
    the global scale a single rank would use; False: every shard with its own."""

    def __post_init__(self) -> None:
        owner = "NVFP4BlockScaling"
        for field in ("input_rht", "grad_output_rht", "weight_2d", "stochastic_rounding"):
            check_bool(owner, field, getattr(self, field))
        check_int(owner, "seed", self.seed, 0, 2**63 - 1)
        check_bool(owner, "reduce_amax", self.reduce_amax)
        check_overrides(owner, self)


@dataclasses.dataclass(frozen=True)
class CustomRecipe(PassOverrides):
    """Per-slot choice: `qfactory(role)` returns a quantizer or a `DelayedScalingRequest`.

    The factory's key is `qfactory_key` when given, else its `@quantizer_factory(key=...)`, else a
    fallback digest of its code and captured values (see `dist_quant.factory_keys`).
    """

    qfactory: Callable = dataclasses.field(metadata=_CALLABLE)
    """`f(role: QuantizerRole) -> Quantizer | DelayedScalingRequest`, called once per slot."""
    qfactory_key: str | None = None
    """Stable semantic key of `qfactory`; overrides the factory's own key."""
    fp8_format: Format = dataclasses.field(default=Format.HYBRID, metadata=_FORMAT)
    """Informational, as in Transformer Engine: the factory picks each slot's format."""
    fp8_dpa: bool = False
    """Run dot-product attention in FP8."""
    fp8_mha: bool = False
    """Keep FP8 across the attention block's projections (needs fp8_dpa)."""

    def __post_init__(self) -> None:
        owner = "CustomRecipe"
        if not callable(self.qfactory):
            raise ValueError(f"{owner}.qfactory must be callable, got {self.qfactory!r}")
        if self.qfactory_key is not None and not (
            isinstance(self.qfactory_key, str) and self.qfactory_key
        ):
            raise ValueError(
                f"{owner}.qfactory_key must be None or a non-empty str, got {self.qfactory_key!r}"
            )
        check_format(owner, "fp8_format", self.fp8_format, tuple(Format))
        _check_fp8_attention(owner, self.fp8_dpa, self.fp8_mha)
        check_overrides(owner, self)

    def _key_value(self, name: str, value: Any) -> Any:
        if name == "qfactory" and self.qfactory_key is not None:
            return self.qfactory_key  # the user's explicit key; no fallback digest, no warning
        return super()._key_value(name, value)


@dataclasses.dataclass(frozen=True)
class HighPrecision(Recipe):
    """Every slot in high precision: each quantizer is the identity and every GEMM runs in its
    inputs' own dtype (BF16 in a BF16 model). The "bf16" built-in; its key, name and JSON type are
    "bf16". Runs on any device, with or without FP8 tensor cores."""

    name = "bf16"


_RECIPE_TYPES: dict[str, type[Recipe]] = {
    cls.name: cls
    for cls in (
        DelayedScaling,
        Float8CurrentScaling,
        MXFP8BlockScaling,
        Float8BlockScaling,
        NVFP4BlockScaling,
        CustomRecipe,
        HighPrecision,
    )
}


# Recipe types written by hand as `{"type": T, ...params}` and built by a factory builder of a
# higher layer (imported by path when used, as any builder): a `CustomRecipe` of that factory,
# whose `to_dict()` is the general `{"builder": ..., "params": ...}` form.
_BUILT_TYPES: dict[str, str] = {"policy": "dist_quant.policy:policy"}


def builtin_recipe(name: str) -> Recipe:
    """ "delayed", "current", "mxfp8", "block", "nvfp4" (each with API defaults) or "bf16" (all identity)."""
    choice = name.strip().lower()
    if choice == "delayed":
        return DelayedScaling()
    if choice == "current":
        return Float8CurrentScaling()
    if choice == "mxfp8":
        return MXFP8BlockScaling()
    if choice == "block":
        return Float8BlockScaling()
    if choice == "nvfp4":
        return NVFP4BlockScaling()
    if choice == "bf16":
        return HighPrecision()
    raise ValueError(
        f"unknown built-in recipe {name!r}; valid: {', '.join(BUILTIN_RECIPE_NAMES)}, "
        'or a dict / JSON object with a "type" field'
    )


def recipe_from_dict(d: Mapping[str, Any] | str) -> Recipe:
    """Inverse of `Recipe.to_dict()`; also accepts a built-in name (see `builtin_recipe`).

    Fields with defaults may be left out; unknown fields, a missing required field or a missing or
    unknown "type" raise ValueError naming it and listing the valid ones. Callable fields take
    `"pkg.module:qualname"`, which is imported.
    """
    if isinstance(d, str):
        return builtin_recipe(d)
    if not isinstance(d, Mapping):
        raise ValueError(
            f"a recipe must be a dict or a built-in name, got {type(d).__name__}: {d!r}"
        )
    valid_types = ", ".join([*_RECIPE_TYPES, *_BUILT_TYPES])
    if "type" not in d:
        raise ValueError(f'recipe dict has no "type" field; valid types: {valid_types}')
    if isinstance(d["type"], str) and d["type"] in _BUILT_TYPES:
        builder = _import_callable(d["type"], _BUILT_TYPES[d["type"]])
        return CustomRecipe(builder(**{k: v for k, v in d.items() if k != "type"}))
    cls = _RECIPE_TYPES.get(d["type"]) if isinstance(d["type"], str) else None
    if cls is None:
        raise ValueError(f"unknown recipe type {d['type']!r}; valid types: {valid_types}")
    fields = {f.name: f for f in recipe_fields(cls)}
    unknown = sorted(set(d) - set(fields) - {"type"}, key=str)
    if unknown:
        raise ValueError(
            f"{cls.__name__} has no field {', '.join(map(repr, unknown))}; "
            f"valid fields: {', '.join(fields)}"
        )
    kwargs: dict[str, Any] = {}
    for name, f in fields.items():
        if name in d:
            kwargs[name] = _decode(f"{cls.__name__}.{name}", f.metadata.get("kind"), d[name])
        elif f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            raise ValueError(
                f"{cls.__name__}.{name} is required and missing; valid fields: {', '.join(fields)}"
            )
    return cls(**kwargs)


def recipe_from_json(text: str) -> Recipe:
    """A recipe from JSON text (an object, or a quoted built-in name) or a bare built-in name."""
    stripped = text.strip()
    if not stripped:
        raise ValueError(f"empty recipe; give JSON or one of {', '.join(BUILTIN_RECIPE_NAMES)}")
    try:
        value = json.loads(stripped)
    except RecursionError as e:  # json nests by recursion: deep input exhausts the stack
        raise ValueError("recipe JSON is nested too deeply to be a recipe") from e
    except json.JSONDecodeError as e:
        if stripped[0] in '{["':
            raise ValueError(f"recipe is not valid JSON: {e}") from e
        return builtin_recipe(stripped)
    return recipe_from_dict(value)


def _decode(where: str, kind: str | None, value: Any) -> Any:
    """One JSON field value -> the constructor argument (the constructor validates the rest)."""
    if kind == "format" and isinstance(value, str):
        try:
            return Format[value]
        except KeyError:
            raise ValueError(
                f"{where}: unknown format {value!r}; valid: {', '.join(f.name for f in Format)}"
            ) from None
    if kind in ("callable", "algo") and isinstance(value, str):
        if kind == "algo" and ":" not in value:
            return value  # "max" / "most_recent"; the recipe checks the choice
        return _import_callable(where, value)
    if kind == "callable" and isinstance(value, Mapping) and set(value) == {"builder", "params"}:
        # a factory with bound parameters (`factory_keys.built_by`): call its builder again
        builder = _import_callable(where, value["builder"])
        if not isinstance(value["params"], Mapping):
            raise ValueError(f"{where}: builder params must be an object, got {value['params']!r}")
        try:
            return builder(**value["params"])
        except Exception as e:  # the builder validates its own parameters
            raise ValueError(
                f"{where}: builder {value['builder']!r} refused {dict(value['params'])!r}: "
                f"{type(e).__name__}: {e}"
            ) from e
    return value


def _import_callable(where: str, path: str) -> Callable:
    module_name, sep, qualname = path.partition(":")
    if not (sep and module_name and qualname):
        raise ValueError(f'{where}: expected an import path "pkg.module:name", got {path!r}')
    if module_name.startswith("."):
        raise ValueError(f"{where}: {path!r} is relative; give the absolute module name")
    try:
        obj: Any = importlib.import_module(module_name)
    except Exception as e:  # the module's own top-level code may raise anything
        raise ValueError(
            f"{where}: cannot import module {module_name!r} of {path!r}: {type(e).__name__}: {e}"
        ) from e
    for part in qualname.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            raise ValueError(
                f"{where}: {path!r} does not exist ({module_name!r} has no {qualname!r})"
            ) from None
        except Exception as e:  # a module __getattr__ or class property may raise anything
            raise ValueError(f"{where}: cannot resolve {path!r}: {type(e).__name__}: {e}") from e
    if not callable(obj):
        raise ValueError(f"{where}: {path!r} is a {type(obj).__name__}, not a callable")
    return obj


def _import_path(fn: Callable, where: str) -> str:
    """`"pkg.module:qualname"` for a callable that importing that path gives back."""
    module_name = getattr(fn, "__module__", None)
    qualname = getattr(fn, "__qualname__", None)
    if not (isinstance(module_name, str) and isinstance(qualname, str)) or "<" in qualname:
        raise ValueError(
            f"{where}: {fn!r} cannot be serialised: only module-level functions (or class "
            'attributes) can be written as "pkg.module:name"; lambdas, closures, local '
            "functions, partials and bound methods cannot. Define it at module level."
        )
    path = f"{module_name}:{qualname}"
    try:
        resolved = _import_callable(where, path)
    except ValueError as e:
        raise ValueError(f"{where}: {fn!r} cannot be serialised as {path!r}: {e}") from e
    if resolved is not fn and resolved != fn:
        raise ValueError(
            f"{where}: {path!r} names a different object than {fn!r} (shadowed or rebound); "
            "serialise a callable reachable by its own name"
        )
    return path
