"""Checkpoint and resume of dist-quant models, bit-exact: reached as `dq.checkpoint.*`.

`module_state.py`: each module's extra state (format, validation, staged load). `model.py`: the
all-or-nothing model load, `recipe_of`, `save` / `load` over plain `torch.save`. `dcp.py`: the
same for torch.distributed.checkpoint (tensor and FSDP2 sharding). `shards.py`: a single-rank
state dict loaded into a tensor-parallel model. The job's switch state
(`dist_quant.coordinator.job_state`) is stored as the opaque `job` entry. See docs/checkpoint.md.
"""

from __future__ import annotations

import importlib
from typing import Any

from dist_quant.checkpoint.model import CHECKPOINT_FORMAT, load, load_state_dict, recipe_of, save
from dist_quant.checkpoint.module_state import (
    FORMAT,
    ONE_LINER,
    load_module_extra_state,
    module_extra_state,
    read_digest,
)
from dist_quant.checkpoint.shards import load_full_state_dict_into_shards

_DCP_NAMES = ("dcp_load", "dcp_save", "dcp_state_dict")


# The switch protocol's part of a checkpoint lives with the protocol.
_MOVED = {"job_state": "dist_quant.coordinator", "restore_job_state": "dist_quant.coordinator"}


def __getattr__(name: str) -> Any:
    # torch.distributed.checkpoint is imported only by jobs that use it (it adds ~1 s to import)
    if name in _DCP_NAMES:
        return getattr(importlib.import_module("dist_quant.checkpoint.dcp"), name)
    if name in _MOVED:
        raise AttributeError(
            f"{__name__}.{name} moved to {_MOVED[name]}.{name} (the checkpoint stores the job "
            "state it is given and knows nothing of the switch protocol)"
        )
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "CHECKPOINT_FORMAT",
    "FORMAT",
    "ONE_LINER",
    "load",
    "load_full_state_dict_into_shards",
    "load_module_extra_state",
    "load_state_dict",
    "module_extra_state",
    "read_digest",
    "recipe_of",
    "save",
    *_DCP_NAMES,
]
