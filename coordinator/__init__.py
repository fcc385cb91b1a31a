"""Cluster-wide atomic recipe switch: coordinator, per-rank participant, transports.

    participant = attach(model, tp_group=tp)        # every rank, after init_process_group
    participant.step_boundary(step)                 # every step; cheap when nothing is pending
    result = request_switch("current", at_step=100) # from any process of the job's machine

See README.md in this folder for the protocol and its state machine.
"""

from dist_quant.coordinator.attach import attach
from dist_quant.coordinator.client import request_switch, status
from dist_quant.coordinator.errors import SwitchBusyError, SwitchError, SwitchRequestError
from dist_quant.coordinator.faults import fail_at
from dist_quant.coordinator.guard import PrecisionGuard
from dist_quant.coordinator.participant import Participant
from dist_quant.coordinator.protocol import SwitchResult

__all__ = [
    "Participant",
    "PrecisionGuard",
    "SwitchBusyError",
    "SwitchError",
    "SwitchRequestError",
    "SwitchResult",
    "attach",
    "fail_at",
    "request_switch",
    "status",
]
