"""Hugging Face transformers models converted to dist-quant: `save_pretrained` / `from_pretrained`
with the recipe and scaling state kept.

A converted model's state dict holds one `<module>._extra_state` per dist-quant module (recipe,
roles, delayed-scaling history): not tensors, so safetensors cannot hold them and
`model.save_pretrained` fails on them. `save_pretrained(model, path)` writes the weights the
Hugging Face way (the very files an unconverted model writes, loadable by plain transformers)
and the extra state beside them in `EXTRA_STATE_FILE`; `from_pretrained(cls, path)` loads the
weights with transformers, converts the model (`convert_model`, same filter) and loads the
extra state into it, so the model continues exactly where the saved one stopped. Without the
extra-state file (weights from the Hub) the model is converted and runs whatever recipe it is
given next.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch
from torch import nn

from dist_quant.checkpoint.model import EXTRA_STATE_SUFFIX
from dist_quant.convert import ModuleFilter, convert_model

EXTRA_STATE_FILE = "dist_quant_extra_state.pt"


def save_pretrained(model: nn.Module, path: str | os.PathLike[str], **kwargs: Any) -> None:
    """`model.save_pretrained(path, **kwargs)` of the weights, plus `EXTRA_STATE_FILE` beside."""
    state = model.state_dict()
    extra = {k: v for k, v in state.items() if k.endswith(EXTRA_STATE_SUFFIX)}
    if "state_dict" in kwargs:
        raise ValueError("save_pretrained: state_dict is taken from the model; do not pass one")
    model.save_pretrained(
        path, state_dict={k: v for k, v in state.items() if k not in extra}, **kwargs
    )
    torch.save(extra, Path(path) / EXTRA_STATE_FILE)


def from_pretrained(
    cls: Any,
    path: str | os.PathLike[str],
    *,
    module_filter_fn: ModuleFilter | None = None,
    **kwargs: Any,
) -> nn.Module:
    """`cls.from_pretrained(path, **kwargs)`, converted, with the saved extra state loaded."""
    model = convert_model(cls.from_pretrained(path, **kwargs), module_filter_fn=module_filter_fn)
    extra_file = Path(path) / EXTRA_STATE_FILE
    if extra_file.is_file():
        extra = torch.load(extra_file, weights_only=True)
        result = model.load_state_dict(extra, strict=False)
        if result.unexpected_keys:
            raise ValueError(
                f"from_pretrained: {extra_file} holds extra state for modules the converted model "
                f"does not have: {result.unexpected_keys[:5]} (another model, or another filter)"
            )
        missing = [k for k in result.missing_keys if k.endswith(EXTRA_STATE_SUFFIX)]
        if missing:
            raise ValueError(
                f"from_pretrained: {extra_file} has no extra state for {missing[:5]}: the model "
                "was saved with another module_filter_fn"
            )
    return model
