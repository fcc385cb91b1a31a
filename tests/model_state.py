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


def assert_same_run(full: dict, resumed: dict, steps: range) -> None:
    """A resumed run equals the uninterrupted one bit for bit: the losses of `steps`, the final
    parameters and the optimizer state (`losses`, `params` and `opt` as the checkpoint jobs
    return them)."""
    for step in steps:
        assert torch.equal(full["losses"][step], resumed["losses"][step]), step
    for name, p in full["params"].items():
        assert torch.equal(p, resumed["params"][name]), name
    for i, st in full["opt"].items():
        for k, v in st.items():
            assert torch.equal(v, resumed["opt"][i][k]), (i, k)
