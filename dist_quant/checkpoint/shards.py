"""Loading a single-rank (unsharded) state dict into a tensor-parallel model, shard by shard.

Parameters marked with `parallel.mark_tp_split` receive their shard (`parallel.shard_of`); every
other parameter and buffer the full tensor. See docs/parallelism.md.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from dist_quant.checkpoint.model import EXTRA_STATE_SUFFIX
from dist_quant.parallel import group_rank, group_size, shard_of, tp_splits


def load_full_state_dict_into_shards(
    model: nn.Module, full_state_dict: Mapping[str, Any], tp_group: Any
) -> None:
    """Copy a single-rank (unsharded) state dict into a tensor-parallel model on this rank.

    Parameters marked with `mark_tp_split` receive their shard; every other parameter and buffer
    receives the full tensor. Modules' extra state (FP8 recipe, scales, amax histories) is loaded
    unchanged: a slot's scale and history describe the whole tensor, which is what TP ranks share
    once their amaxes are reduced. Strict: a missing or unexpected key, or a shard whose shape
    differs from the parameter, raises ValueError naming it before anything is loaded; each
    module's extra state then validates itself as it loads.
    """
    rank, size = group_rank(tp_group), group_size(tp_group)
    current = model.state_dict(keep_vars=True)
    splits = tp_splits(model)  # read from the modules: fully_shard drops the parameters' marks
    extra = {k for k in current if k.rsplit(".", 1)[-1] == EXTRA_STATE_SUFFIX}
    targets = {k: v for k, v in current.items() if k not in extra}
    missing = sorted((targets.keys() | extra) - full_state_dict.keys())
    unexpected = sorted(full_state_dict.keys() - targets.keys() - extra)
    if missing or unexpected:
        raise ValueError(
            f"load_full_state_dict_into_shards: missing keys {missing}, unexpected keys {unexpected}"
        )
    staged = []
    for name, target in targets.items():
        full = full_state_dict[name]
        split = splits.get(name)
        try:
            value = full if split is None else shard_of(full, split[0], split[1], rank, size)
        except ValueError as e:
            raise ValueError(f"load_full_state_dict_into_shards: {name!r}: {e}") from e
        if value.shape != target.shape:
            raise ValueError(
                f"load_full_state_dict_into_shards: {name!r} is {tuple(target.shape)} on TP rank "
                f"{rank} of {size}, the state dict gives {tuple(value.shape)}"
            )
        staged.append((target, value))
    for key in sorted(extra):
        owner = key.rsplit(".", 1)[0] if "." in key else ""  # "" is the model itself
        model.get_submodule(owner).set_extra_state(full_state_dict[key])
    with torch.no_grad():
        for target, value in staged:
            target.copy_(value)


__all__ = ["load_full_state_dict_into_shards"]
