"""What tests compare between two runs of one model, read through public seams."""

from __future__ import annotations

import torch


def scaling_buffers(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every module's scaling buffers (delayed scaling's scale and amax history), read from its
    checkpoint state and keyed by state-dict name and buffer."""
    out = {}
    for name, value in model.state_dict().items():
        if name.endswith("_extra_state") and isinstance(value, dict):
            for buf, t in value.get("buffers", {}).items():
                out[f"{name}.{buf}"] = t
    return out
