"""torchtitan 0.3's trainer with dist-quant: `enable_dist_quant(config)` adapts a `Trainer.Config`
whose model spec `dist_quant.integrations.torchtitan.DistQuantConverter` converted.

It swaps torchtitan's `FullAC` / `SelectiveAC` for subclasses whose recompute is
`dq.activation_checkpoint` (exact FP8 recompute), the model's state-dict adapter for one that
keeps `_extra_state` beside the HF weights, and, with the converter's `attach_coordinator`,
attaches the coordinator on every rank after the optimizers are built, with a step boundary after
each optimizer step, so `dist-quant switch` reaches the trainer. It lives with the launchers
(as `ray_train` does): it wires a framework's training loop to the coordinator.
"""

from __future__ import annotations

import functools
from typing import Any

import torch.distributed as dist
from dist_quant.coordinator.attach import attach

from dist_quant.integrations.torchtitan import (
    DistQuantConverter,
    converter_config_of,
    exact_ac_config,
    extra_state_adapter,
)


def enable_dist_quant(config: Any) -> Any:
    """Adapt a torchtitan `Trainer.Config` whose model spec was converted by `DistQuantConverter`:
    exact activation checkpointing, the HF state-dict adapter and, when the converter asks, the
    coordinator (attached on every rank after the optimizers are built, a step boundary after
    each optimizer step). Returns `config`, changed in place."""
    spec = config.model_spec
    converter = converter_config_of(spec)
    if converter is None:
        raise ValueError(
            "enable_dist_quant: the model spec was not converted by DistQuantConverter; build it "
            "with model_registry(..., converters=[DistQuantConverter.Config(...)])"
        )
    config.activation_checkpoint = exact_ac_config(config.activation_checkpoint)
    if spec.state_dict_adapter is not None:
        spec.state_dict_adapter = extra_state_adapter(spec.state_dict_adapter)
    if converter.attach_coordinator:
        spec.post_optimizer_build_fn = functools.partial(
            _attach_after_optimizers, spec.post_optimizer_build_fn, converter
        )
    return config


def _attach_after_optimizers(
    previous: Any,
    converter: DistQuantConverter.Config,
    optimizers: Any,
    model_parts: list,
    parallel_dims: Any,
) -> None:
    if previous is not None:
        previous(optimizers, model_parts, parallel_dims)
    if len(model_parts) != 1:
        raise NotImplementedError(
            "dist-quant's coordinator attaches to one model part per rank; pipeline parallelism "
            f"gives {len(model_parts)}"
        )
    if not dist.is_initialized():
        raise ValueError("attach_coordinator needs torch.distributed initialised by the trainer")
    model = model_parts[0]
    tp_group = parallel_dims.get_mesh("tp").get_group() if parallel_dims.tp_enabled else None
    participant = attach(
        model, tp_group=tp_group, run_dir=converter.run_dir, stats_interval=converter.stats_interval
    )
    model._dist_quant_participant = participant
    steps = [0]

    def boundary(*_: Any) -> None:
        steps[0] += 1
        participant.step_boundary(steps[0])

    participant.step_boundary(0)
    optimizers.register_step_post_hook(boundary)
