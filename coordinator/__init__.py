"""Cluster-wide atomic recipe switch: coordinator, per-rank participant, transports.

    participant = attach(model, tp_group=tp)        # every rank, after init_process_group
    participant.step_boundary(step)                 # every step; cheap when nothing is pending
    result = request_switch("current", at_step=100) # from any process of the job's machine

See README.md in this folder for the protocol and its state machine.
"""

from __future__ import annotations

import importlib
from typing import Any

# Public name -> defining module, imported on first use (PEP 562): a client (`request_switch`,
# `dist-quant switch`) then does not import torch through `attach` and the participant.
_EXPORTS: dict[str, str] = {
    "CancelRefusedError": "dist_quant.coordinator.errors",
    "CancelResult": "dist_quant.coordinator.results",
    "Participant": "dist_quant.coordinator.participant",
    "PrecisionGuard": "dist_quant.coordinator.guard",
    "SwitchBusyError": "dist_quant.coordinator.errors",
    "SwitchError": "dist_quant.coordinator.errors",
    "SwitchRequestError": "dist_quant.coordinator.errors",
    "SwitchResult": "dist_quant.coordinator.results",
    "attach": "dist_quant.coordinator.attach",
    "cancel_switch": "dist_quant.coordinator.switch_requests",
    "fail_at": "dist_quant.coordinator.faults",
    "job_state": "dist_quant.coordinator.job_checkpoint",
    "request_switch": "dist_quant.coordinator.switch_requests",
    "restore_job_state": "dist_quant.coordinator.job_checkpoint",
    "status": "dist_quant.coordinator.switch_requests",
}


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'dist_quant.coordinator' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))


__all__ = sorted(_EXPORTS)
