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

# Every name is imported on first use: `modules/base.py` imports `module_state` (the extra-state
# format sits below the modules), and must not pull in `model.py`, which sits above them.
_EXPORTS = {
    "CHECKPOINT_FORMAT": "dist_quant.checkpoint.model",
    "load": "dist_quant.checkpoint.model",
    "load_state_dict": "dist_quant.checkpoint.model",
    "recipe_of": "dist_quant.checkpoint.model",
    "save": "dist_quant.checkpoint.model",
    "FORMAT": "dist_quant.checkpoint.module_state",
    "ONE_LINER": "dist_quant.checkpoint.module_state",
    "load_module_extra_state": "dist_quant.checkpoint.module_state",
    "module_extra_state": "dist_quant.checkpoint.module_state",
    "read_digest": "dist_quant.checkpoint.module_state",
    "load_full_state_dict_into_shards": "dist_quant.checkpoint.shards",
    # torch.distributed.checkpoint is imported only by jobs that use it (it adds ~1 s to import)
    "dcp_load": "dist_quant.checkpoint.dcp",
    "dcp_save": "dist_quant.checkpoint.dcp",
    "dcp_state_dict": "dist_quant.checkpoint.dcp",
}

# The switch protocol's part of a checkpoint lives with the protocol.
_MOVED = {"job_state": "dist_quant.coordinator", "restore_job_state": "dist_quant.coordinator"}


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        value = getattr(importlib.import_module(_EXPORTS[name]), name)
        globals()[name] = value
        return value
    if name in _MOVED:
        raise AttributeError(
            f"{__name__}.{name} moved to {_MOVED[name]}.{name} (the checkpoint stores the job "
            "state it is given and knows nothing of the switch protocol)"
        )
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(__all__)


__all__ = sorted(_EXPORTS)
