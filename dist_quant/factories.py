"""Reference quantizer factories for `CustomRecipe`, each with an explicit semantic key.

A factory maps a `QuantizerRole` to a quantizer or a `DelayedScalingRequest`. The six basic ones
reproduce the built-in recipes slot by slot; `bf16_first_last` and
`attention_current_linear_block` show dispatch by module name and by module type. Bump a key's
version suffix whenever the behaviour behind it changes, so running jobs see a new recipe key.

Roles the modules emit: linear slots "input", "weight", "grad_output" (module_type "linear" or
"grouped_linear"); attention slots "qkv", "o", "s", "do", "dp", "dqkv" (module_type "dpa"). Output
and grad-input slots carry whatever role the module was given, often none: factories receive
`None` there and must still return a quantizer. Every factory here also reads a role with
empty fields (`QuantizerRole()`) as "nothing known", so code written against the older convention
keeps working.
"""

from __future__ import annotations

import dataclasses
import json
import re
import zlib
from collections.abc import Callable, Sequence
from typing import Any

import torch

from dist_quant.factory_keys import built_by, quantizer_factory
from dist_quant.formats import Format, bwd_dtype, fwd_dtype
from dist_quant.nvfp4 import NVFP4Quantizer
from dist_quant.quantizers import (
    Float8BlockQuantizer,
    Float8CurrentScalingQuantizer,
    IdentityQuantizer,
    MXFP8Quantizer,
    Quantizer,
)
from dist_quant.recipes import (
    FALLBACK_TARGETS,
    CustomRecipe,
    DelayedScaling,
    Float8BlockScaling,
    Float8CurrentScaling,
    HighPrecision,
    MXFP8BlockScaling,
    NVFP4BlockScaling,
    PassOverrides,
    Recipe,
    builtin_recipe,
    recipe_from_dict,
)
from dist_quant.roles import DelayedScalingRequest, QuantizerRole

GRADIENT_TENSOR_TYPES = frozenset({"grad_output", "grad_input", "do", "dp", "dqkv"})
"""Tensor types of backward-pass gradients: E5M2 under HYBRID."""
LINEAR_MODULE_TYPES = frozenset({"linear", "grouped_linear"})

_LAYER_INDEX = re.compile(r"(?:^|\.)layers\.(\d+)(?:\.|$)")


def _tensor_type(role: QuantizerRole | None) -> str:
    return role.tensor_type if role is not None else ""


@quantizer_factory(key="dist_quant.factories.high_precision.v1")
def high_precision(role: QuantizerRole | None) -> Quantizer:
    """High precision for the slot: what the "bf16" built-in (`HighPrecision`) gives every slot."""
    return IdentityQuantizer()


@quantizer_factory(key="dist_quant.factories.delayed_scaling.v1")
def delayed_scaling(role: QuantizerRole | None) -> DelayedScalingRequest:
    """Delayed scaling with the API defaults (HYBRID, margin 0, history 1024, "max")."""
    return DelayedScalingRequest()


@quantizer_factory(key="dist_quant.factories.current_scaling.v1")
def current_scaling(role: QuantizerRole | None) -> Quantizer:
    """Current scaling under HYBRID: E5M2 for gradient roles, E4M3 for everything else."""
    if _tensor_type(role) in GRADIENT_TENSOR_TYPES:
        return Float8CurrentScalingQuantizer(bwd_dtype(Format.HYBRID))
    return Float8CurrentScalingQuantizer(fwd_dtype(Format.HYBRID))


@quantizer_factory(key="dist_quant.factories.mxfp8.v1")
def mxfp8(role: QuantizerRole | None) -> Quantizer:
    """MXFP8 (E4M3 data, E8M0 scales per 32 elements) for every slot."""
    return MXFP8Quantizer(torch.float8_e4m3fn)


@quantizer_factory(key="dist_quant.factories.nvfp4.v1")
def nvfp4(role: QuantizerRole | None) -> Quantizer:
    """NVFP4 with Transformer Engine's defaults, what `NVFP4BlockScaling()` gives each role:
    16x16 weight blocks, the Hadamard transform on the input's and the output gradient's
    columnwise (wgrad) copies, stochastic rounding of the output gradient; other slots 1x16.
    The stochastic rounding seed is a digest of the role (so slots draw different streams, the
    same on every rank); the `CustomRecipe`'s state counts the casts of each such quantizer in a
    buffer it checkpoints, as the recipe's own state does."""
    tensor_type = _tensor_type(role)
    grad = tensor_type == "grad_output"
    salt = zlib.crc32(repr(role).encode()) % 2**31
    return NVFP4Quantizer(
        block_2d=tensor_type == "weight",
        rht=tensor_type == "input" or grad,
        stochastic_rounding=grad,
        seed=salt,
    )


@quantizer_factory(key="dist_quant.factories.float8_block_scaling.v1")
def float8_block_scaling(role: QuantizerRole | None) -> Quantizer:
    """Float8 block scaling: 128x128 blocks for weights, 1x128 tiles for everything else."""
    dim = 2 if _tensor_type(role) == "weight" else 1
    return Float8BlockQuantizer(torch.float8_e4m3fn, block_scaling_dim=dim)


def layer_index(role: QuantizerRole | None) -> int | None:
    """N from a `layers.N` component of the role's module name, or None."""
    match = _LAYER_INDEX.search(role.name) if role is not None else None
    return int(match.group(1)) if match else None


INNER_FACTORIES: dict[str, Callable[[QuantizerRole | None], Quantizer]] = {
    "current": current_scaling,
    "mxfp8": mxfp8,
    "block": float8_block_scaling,
    "nvfp4": nvfp4,
}
"""What `bf16_first_last` runs the layers between the first and the last with."""


def bf16_first_last(
    num_layers: int, inner: str = "current"
) -> Callable[[QuantizerRole | None], Quantizer]:
    """First and last transformer layer in high precision, the layers between on `inner` (a key
    of `INNER_FACTORIES`: current scaling by default, or mxfp8, block, nvfp4).

    The layer comes from `layers.N` in the role's name. Slots outside the layer stack (embedding,
    head, roles without a name) stay in high precision too; a layer index >= `num_layers` means
    the factory was built for another model and raises ValueError. It serialises through its
    parameters (`CustomRecipe(bf16_first_last(...)).to_dict()` round-trips), so a schedule file
    or a `dist-quant switch` can name it.
    """
    if not isinstance(num_layers, int) or isinstance(num_layers, bool) or num_layers < 1:
        raise ValueError(f"bf16_first_last: num_layers must be an int >= 1, got {num_layers!r}")
    if inner not in INNER_FACTORIES:
        raise ValueError(
            f"bf16_first_last: inner must be one of {', '.join(INNER_FACTORIES)}, got {inner!r}"
        )
    inner_factory = INNER_FACTORIES[inner]
    # the key current scaling has had since v1; another inner recipe names itself
    params = f"num_layers={num_layers}" + ("" if inner == "current" else f", inner={inner}")

    @built_by("dist_quant.factories:bf16_first_last", {"num_layers": num_layers, "inner": inner})
    @quantizer_factory(key=f"dist_quant.factories.bf16_first_last.v1({params})")
    def factory(role: QuantizerRole | None) -> Quantizer:
        index = layer_index(role)
        if index is not None and index >= num_layers:
            raise ValueError(
                f"bf16_first_last: role {role} is in layer {index}, but the factory was built "
                f"for num_layers={num_layers}"
            )
        if index is None or index in (0, num_layers - 1):
            return high_precision(role)
        return inner_factory(role)

    return factory


@quantizer_factory(key="dist_quant.factories.attention_current_linear_block.v1")
def attention_current_linear_block(role: QuantizerRole | None) -> Quantizer:
    """Attention ("dpa") on current scaling, linears on float8 block scaling, the rest (slots
    whose role says nothing about the module) in high precision."""
    module_type = role.module_type if role is not None else ""
    if module_type == "dpa":
        return current_scaling(role)
    if module_type in LINEAR_MODULE_TYPES:
        return float8_block_scaling(role)
    return high_precision(role)


def fp8_fallback(
    layers: Sequence[str],
    to: str | dict[str, Any] = "current",
    base: dict[str, Any] | str = "delayed",
) -> Callable[[QuantizerRole | None], Quantizer | DelayedScalingRequest]:
    """`base` everywhere except the modules named in `layers`, which run `to`.

    A role belongs to a listed module when its name equals it or lies below it (`layers.1`
    covers `layers.1.mlp.fc1`); a slot the base keeps in high precision stays there (a fallback
    never lowers precision). `to` is a name in `FALLBACK_TARGETS` or a recipe dict (a declarative
    policy included: each listed module's slots then run what the policy gives them); `base` is
    a recipe dict or built-in name (delayed, current, mxfp8, block, bf16 or a CustomRecipe). Both
    are answered slot by slot as that recipe would. The precision guard builds this to move
    offending layers off FP8 trouble; it serialises through its parameters
    (`CustomRecipe(fp8_fallback(...)).to_dict()` round-trips), and its key names them. The
    base's per-pass overrides are recipe fields: `fallback_recipe` carries them.
    """
    names = list(layers) if not isinstance(layers, str) else None
    if not names or not all(isinstance(n, str) and n for n in names):
        raise ValueError(
            f"fp8_fallback: layers must be a non-empty list of module names, got {layers!r}"
        )
    if isinstance(to, str):
        if to not in FALLBACK_TARGETS:
            raise ValueError(
                f"fp8_fallback: to must be one of {FALLBACK_TARGETS} or a recipe dict, got {to!r}"
            )
        target = {"current": current_scaling, "mxfp8": mxfp8, "bf16": high_precision}[to]
        to_param: str | dict[str, Any] = to
    else:
        target_recipe = recipe_from_dict(to)
        target, to_param = slot_factory(target_recipe), target_recipe.to_dict()
    base_recipe = recipe_from_dict(base)
    base_factory = slot_factory(base_recipe)
    chosen = tuple(sorted(set(names)))
    params = {"layers": list(chosen), "to": to_param, "base": base_recipe.to_dict()}
    key = f"dist_quant.factories.fp8_fallback.v1({json.dumps(params, sort_keys=True)})"

    @built_by("dist_quant.factories:fp8_fallback", params)
    @quantizer_factory(key=key)
    def factory(role: QuantizerRole | None) -> Quantizer | DelayedScalingRequest:
        name = role.name if role is not None else ""
        kept = base_factory(role)
        if isinstance(kept, IdentityQuantizer):
            return kept  # a fallback never lowers precision: high precision stays high
        if any(name == layer or name.startswith(layer + ".") for layer in chosen):
            return target(role)
        return kept

    return factory


def fallback_recipe(
    base: dict[str, Any] | str, to: str | dict[str, Any], layers: Sequence[str] | None = None
) -> Recipe:
    """What the precision guard asks for instead of `base`: `to` for the modules in `layers`
    (`CustomRecipe(fp8_fallback(layers, to, base))`), or for the whole model when `layers` is
    None (the built-in `to`), carrying the base's per-pass overrides either way, so a run with
    `backward_override="high_precision"` keeps its high-precision backward wherever the guard
    does not move it to bf16 (which quantizes nothing, so takes none). The overrides are fields of
    the recipe, so `to_dict` / `recipe_from_dict` carry them. A recipe dict as the whole model's
    `to` (a policy, say) is taken as written, its own overrides included."""
    base_recipe = recipe_from_dict(base)
    overrides = {}
    if isinstance(base_recipe, PassOverrides):
        overrides = {
            f.name: getattr(base_recipe, f.name)
            for f in dataclasses.fields(PassOverrides)
            if getattr(base_recipe, f.name) != f.default
        }
    if layers is not None:
        return CustomRecipe(fp8_fallback(layers, to=to, base=base), **overrides)
    if isinstance(to, dict):
        return recipe_from_dict(to)
    if to not in FALLBACK_TARGETS:
        raise ValueError(f"fallback_recipe: to must be one of {FALLBACK_TARGETS}, got {to!r}")
    whole = builtin_recipe(to)
    return whole if isinstance(whole, HighPrecision) else dataclasses.replace(whole, **overrides)


def slot_factory(recipe: Recipe) -> Callable[[QuantizerRole | None], Any]:
    """What `recipe` gives each slot, as a factory (for the slots a fallback leaves alone)."""
    if isinstance(recipe, CustomRecipe):
        return recipe.qfactory
    if isinstance(recipe, HighPrecision):
        return high_precision
    if isinstance(recipe, DelayedScaling):
        if not isinstance(recipe.amax_compute_algo, str) or recipe.scaling_factor_compute_algo:
            raise ValueError(
                "fp8_fallback: a base DelayedScaling with callable amax_compute_algo or "
                "scaling_factor_compute_algo has no per-slot request; give a CustomRecipe base"
            )
        request = DelayedScalingRequest(
            fp8_format=recipe.fp8_format, margin=recipe.margin,
            amax_history_len=recipe.amax_history_len, amax_compute_algo=recipe.amax_compute_algo,
            reduce_amax=recipe.reduce_amax,
        )  # fmt: skip
        return lambda role: request
    fmt = recipe.fp8_format if hasattr(recipe, "fp8_format") else Format.E4M3

    def dtype_of(role: QuantizerRole | None) -> torch.dtype:
        grad = _tensor_type(role) in GRADIENT_TENSOR_TYPES
        return bwd_dtype(fmt) if grad else fwd_dtype(fmt)

    if isinstance(recipe, Float8CurrentScaling):
        return lambda role: Float8CurrentScalingQuantizer(
            dtype_of(role), use_power_2_scales=recipe.use_power_2_scales,
            amax_epsilon=recipe.amax_epsilon,
        )  # fmt: skip
    if isinstance(recipe, MXFP8BlockScaling):
        return lambda role: MXFP8Quantizer(dtype_of(role))
    if isinstance(recipe, NVFP4BlockScaling):
        return _nvfp4_slot_factory(recipe)
    if isinstance(recipe, Float8BlockScaling):
        return lambda role: Float8BlockQuantizer(
            dtype_of(role), block_scaling_dim=2 if _tensor_type(role) == "weight" else 1,
            use_power_2_scales=recipe.use_power_2_scales,
        )  # fmt: skip
    raise ValueError(f"fp8_fallback: no per-slot form of base recipe {type(recipe).__name__}")


def _nvfp4_slot_factory(recipe: NVFP4BlockScaling) -> Callable[[QuantizerRole | None], Quantizer]:
    """The quantizer `recipe` gives a slot, for a fallback's untouched slots (seeded per role, as
    `nvfp4` does). The base's per-pass overrides are recipe fields, not slot answers:
    `fallback_recipe` puts them on the `CustomRecipe` it builds around this."""

    def factory(role: QuantizerRole | None) -> Quantizer:
        tensor_type = _tensor_type(role)
        grad = tensor_type == "grad_output"
        rht = (recipe.input_rht and tensor_type == "input") or (recipe.grad_output_rht and grad)
        salt = zlib.crc32(repr(role).encode())
        return NVFP4Quantizer(
            block_2d=recipe.weight_2d and tensor_type == "weight",
            rht=rht,
            stochastic_rounding=recipe.stochastic_rounding and grad,
            seed=(recipe.seed * 0x9E3779B1 + salt) % 2**31,
            reduce_amax=recipe.reduce_amax,
        )

    return factory
