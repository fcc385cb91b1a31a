"""Checkpoint and resume of dist-quant models, bit-exact: reached as `dq.checkpoint.*`.

`module_state.py`: each module's extra state (format, validation), the all-or-nothing model load,
`save` / `load` over plain `torch.save`. `dcp.py`: the same for torch.distributed.checkpoint
(tensor and FSDP2 sharding). See docs/checkpoint.md.
"""

from __future__ import annotations

import importlib
from typing import Any

from dist_quant.checkpoint.module_state import (
    CHECKPOINT_FORMAT,
    FORMAT,
    ONE_LINER,
    job_state,
    load,
    load_module_extra_state,
    load_state_dict,
    module_extra_state,
    recipe_digest,
    recipe_of,
    restore_job_state,
    save,
)

_DCP_NAMES = ("dcp_load", "dcp_save", "dcp_state_dict")


def __getattr__(name: str) -> Any:
    # torch.distributed.checkpoint is imported only by jobs that use it (it adds ~1 s to import)
    if name in _DCP_NAMES:
        return getattr(importlib.import_module("dist_quant.checkpoint.dcp"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "CHECKPOINT_FORMAT",
    "FORMAT",
    "ONE_LINER",
    "job_state",
    "load",
    "load_module_extra_state",
    "load_state_dict",
    "module_extra_state",
    "recipe_digest",
    "recipe_of",
    "restore_job_state",
    "save",
    *_DCP_NAMES,
]
