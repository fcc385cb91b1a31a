"""dist-quant inside torchtitan 0.3: a model-config converter, activation checkpointing and a
Hugging Face state-dict adapter that know dist-quant modules.

    from torchtitan.models.llama3 import model_registry
    from dist_quant.integrations.torchtitan import DistQuantConverter
    from dist_quant.launch.torchtitan import enable_dist_quant

    config = llama3_debugmodel()  # a torchtitan Trainer.Config
    config.model_spec = model_registry(
        "debugmodel", converters=[DistQuantConverter.Config(recipe="policy.yaml")]
    )
    enable_dist_quant(config)

- `DistQuantConverter` (a torchtitan `ModelConfigConverter`, the API that replaced
  `register_model_converter`) turns every `Linear.Config` of the model config into a
  `DistQuantLinear.Config`, except those whose path contains one of `filter_fqns` and subclasses
  of torchtitan's Linear with a forward of their own. The built modules are torchtitan `Module`s
  (the trainer's protocol check passes, `init_states` and each config's `param_init` initialise
  them) and dist-quant `Linear`s. The root module's forward runs inside `dq.autocast`
  (`integrations.hooks.quantize_forward`), and `recipe` (a built-in name, a recipe/policy JSON
  object or a JSON/YAML file) is published at the first forward.
- `exact_ac_config` swaps torchtitan's `FullAC` / `SelectiveAC` for subclasses whose checkpoint
  wrapper calls `dq.activation_checkpoint` (exact recompute of FP8 blocks);
  `extra_state_adapter` makes a model's state-dict adapter keep `_extra_state` beside the HF
  weights. `dist_quant.launch.torchtitan.enable_dist_quant` applies both to a trainer config and,
  with the converter's `attach_coordinator`, joins the job's switch protocol: the trainer-level
  wiring lives with the other launchers, above the coordinator it attaches.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from typing import Any

import torch
from torch.utils.checkpoint import checkpoint as torch_checkpoint
from torchtitan.components.quantization import QuantizationConverter
from torchtitan.distributed.activation_checkpoint import FullAC, SelectiveAC
from torchtitan.models.common.linear import Linear as TitanLinear
from torchtitan.protocols.module import Module

from dist_quant.checkpoint.model import EXTRA_STATE_SUFFIX
from dist_quant.integrations.hooks import quantize_forward
from dist_quant.modules.linear import Linear
from dist_quant.recipe_files import read_recipe_spec
from dist_quant.recipes import Recipe, recipe_from_dict
from dist_quant.recompute import activation_checkpoint

logger = logging.getLogger(__name__)


class DistQuantLinear(Linear, Module):
    """torchtitan's `Linear` as a dist-quant `Linear` (built from the same config fields)."""

    @dataclasses.dataclass(kw_only=True, slots=True)
    class Config(TitanLinear.Config):
        pass

    def __init__(self, config: Config) -> None:
        Linear.__init__(self, config.in_features, config.out_features, bias=config.bias)


def load_recipe(spec: str | dict) -> Recipe:
    """A recipe from a built-in name, a recipe dict, JSON text or a JSON/YAML file path."""
    return recipe_from_dict(spec if isinstance(spec, dict) else read_recipe_spec(spec))


class DistQuantConverter(QuantizationConverter):
    """Linear configs -> `DistQuantLinear` configs; the built model runs under `dq.autocast`."""

    @dataclasses.dataclass(kw_only=True, slots=True)
    class Config(QuantizationConverter.Config):
        recipe: str = "delayed"
        """Built-in name, recipe or policy JSON, or a JSON/YAML file (see `dist_quant.policy`)."""
        filter_fqns: list[str] = dataclasses.field(default_factory=list)
        """Linears whose path contains any of these stay torchtitan Linears (e.g. "output")."""
        attach_coordinator: bool = False
        """Join the job's switch protocol (needs `enable_dist_quant(config)`)."""
        run_dir: str | None = None
        """The coordinator's run directory (`dist-quant switch --run-dir`); None: its default."""
        stats_interval: int = 0
        """FP8 telemetry every that many steps (0: off)."""

    def __init__(self, config: Config) -> None:
        self.config = config
        try:
            self.recipe = load_recipe(config.recipe)
        except (ValueError, TypeError) as e:
            raise ValueError(f"DistQuantConverter: recipe {config.recipe!r}: {e}") from e
        if not all(isinstance(f, str) and f for f in config.filter_fqns):
            raise ValueError(
                f"DistQuantConverter: filter_fqns must be non-empty strings: {config.filter_fqns}"
            )
        self.converted: list[str] = []
        self.skipped: list[tuple[str, str]] = []

    def convert(self, model_config: Any) -> Any:
        for fqn, linear, parent, attr in model_config.traverse(TitanLinear.Config):
            if type(linear) is not TitanLinear.Config:
                self.skipped.append((fqn, f"{type(linear).__qualname__} builds its own forward"))
                continue
            hit = next((f for f in self.config.filter_fqns if f in fqn), None)
            if hit is not None:
                self.skipped.append((fqn, f"filter_fqns entry {hit!r}"))
                continue
            new = DistQuantLinear.Config(
                in_features=linear.in_features,
                out_features=linear.out_features,
                bias=linear.bias,
                param_init=linear.param_init,
                sharding_config=linear.sharding_config,
            )
            if parent is None:
                model_config = new
            elif isinstance(parent, list):
                parent[attr] = new
            else:
                setattr(parent, attr, new)
            self.converted.append(fqn)
        logger.info(
            "dist-quant: %d Linear configs converted, %d left: %s",
            len(self.converted),
            len(self.skipped),
            ", ".join(f"{fqn} ({why})" for fqn, why in self.skipped) or "-",
        )
        if not self.converted:
            raise ValueError(
                "DistQuantConverter converted no Linear config of the model (left: "
                f"{self.skipped}); the run would train in high precision"
            )
        return _hooked_root(model_config, self)


_HOOKED_CONFIGS: dict[type, type] = {}
_HOOK_FIELD = "dist_quant"


def _hooked_root(model_config: Any, converter: DistQuantConverter) -> Any:
    """The root config as a subclass with the converter's config in a field, whose `build()`
    also installs the dist-quant hooks on the model it builds (the only moment a converter can
    reach the module tree)."""
    base = type(model_config)
    if base in _HOOKED_CONFIGS.values():
        base = base.__mro__[1]
    if base not in _HOOKED_CONFIGS:

        def build(self: Any, **kwargs: Any) -> Any:
            model = base.build(self, **kwargs)
            install(model, getattr(self, _HOOK_FIELD))
            return model

        namespace = {
            "__annotations__": {_HOOK_FIELD: "Any"},
            _HOOK_FIELD: None,
            "build": build,
            "__module__": base.__module__,
            "__qualname__": base.__qualname__,
        }
        cls = dataclasses.dataclass(kw_only=True, slots=True)(
            type(base.__name__, (base,), namespace)
        )
        _HOOKED_CONFIGS[base] = cls
    values = {f.name: getattr(model_config, f.name) for f in dataclasses.fields(model_config)}
    values[_HOOK_FIELD] = converter.config
    return _HOOKED_CONFIGS[base](**values)


def install(model: torch.nn.Module, config: DistQuantConverter.Config) -> None:
    """The forward hooks (`quantize_forward` with the converter's recipe) on a built model; the
    coordinator settings are kept on it for `enable_dist_quant`'s post-optimizer step."""
    recipe = load_recipe(config.recipe)
    model._dist_quant_forward = quantize_forward(model, recipe=recipe)
    model._dist_quant_config = config


# ---- activation checkpointing -------------------------------------------------------------
def _exact_recompute(wrapped: torch.nn.Module) -> torch.nn.Module:
    """torchtitan's checkpoint wrapper, its checkpoint function swapped for
    `dq.activation_checkpoint` with the same arguments (policy context, RNG, determinism)."""
    fn = getattr(wrapped, "checkpoint_fn", None)
    if not isinstance(fn, functools.partial) or fn.func is not torch_checkpoint:
        raise TypeError(
            f"dist-quant AC: expected a checkpoint wrapper calling torch's checkpoint, got {fn!r}"
        )
    wrapped.checkpoint_fn = functools.partial(activation_checkpoint, *fn.args, **fn.keywords)
    return wrapped


class DistQuantFullAC(FullAC):
    """torchtitan's `FullAC`, recomputing dist-quant modules exactly (`dq.activation_checkpoint`)."""

    @dataclasses.dataclass(kw_only=True, slots=True)
    class Config(FullAC.Config):
        pass

    def _wrap_block(self, module: torch.nn.Module, *, base_fqn: str | None = None) -> Any:
        return _exact_recompute(super()._wrap_block(module, base_fqn=base_fqn))


class DistQuantSelectiveAC(SelectiveAC):
    """torchtitan's `SelectiveAC` (its op policy unchanged), recomputing dist-quant modules
    exactly (`dq.activation_checkpoint` composes with the selective-checkpoint context)."""

    @dataclasses.dataclass(kw_only=True, slots=True)
    class Config(SelectiveAC.Config):
        pass

    def _wrap_block(self, module: torch.nn.Module, *, base_fqn: str | None = None) -> Any:
        return _exact_recompute(super()._wrap_block(module, base_fqn=base_fqn))


_AC_SWAPS = (
    (SelectiveAC.Config, DistQuantSelectiveAC.Config),
    (FullAC.Config, DistQuantFullAC.Config),
)


def exact_ac_config(ac_config: Any) -> Any:
    """torchtitan's FullAC / SelectiveAC config as its dist-quant subclass, fields kept; any other
    (None, MemoryBudgetAC, already swapped) as it is."""
    for theirs, ours in _AC_SWAPS:
        if type(ac_config) is theirs:
            values = {f.name: getattr(ac_config, f.name) for f in dataclasses.fields(ac_config)}
            return ours(**values)
    return ac_config


# ---- Hugging Face state dicts ---------------------------------------------------------------
_ADAPTERS: dict[type, type] = {}


def extra_state_adapter(base: type) -> type:
    """A subclass of torchtitan state-dict adapter `base` for models with dist-quant modules.

    `to_hf` converts the weights and keeps each `<module>._extra_state` (recipe and scaling
    state) on the adapter (`extra_state`), beside the HF weights it returns; `from_hf` gives the
    weights back with the kept extra state, so a round trip loads with `strict=True`. An adapter
    that kept none returns weights only: load with `strict=False` and the model keeps the recipe
    it has (for an exact resume of scaling state, use torchtitan's DCP checkpoints).
    """
    if base not in _ADAPTERS:

        def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
            base.__init__(self, *args, **kwargs)
            self.extra_state = {}

        def to_hf(self: Any, state_dict: dict[str, Any]) -> dict[str, Any]:
            self.extra_state = {
                k: v for k, v in state_dict.items() if k.endswith(EXTRA_STATE_SUFFIX)
            }
            weights = {k: v for k, v in state_dict.items() if k not in self.extra_state}
            return base.to_hf(self, weights)

        def from_hf(self: Any, hf_state_dict: dict[str, Any]) -> dict[str, Any]:
            return {**base.from_hf(self, hf_state_dict), **self.extra_state}

        _ADAPTERS[base] = type(
            f"DistQuant{base.__name__}",
            (base,),
            {"__init__": __init__, "to_hf": to_hf, "from_hf": from_hf, "__module__": __name__},
        )
    return _ADAPTERS[base]


def converter_config_of(model_spec: Any) -> DistQuantConverter.Config | None:
    """The `DistQuantConverter.Config` a model spec was converted with, or None."""
    return getattr(model_spec.model, _HOOK_FIELD, None)
