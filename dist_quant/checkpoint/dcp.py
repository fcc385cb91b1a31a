"""torch.distributed.checkpoint (DCP) for dist-quant models, tensor parallelism included.

DCP writes each key once: entries under one key on several ranks are taken as replicas and only
one rank's copy is kept (tensors and pickled objects alike). A plain `model.state_dict()` of a
tensor-parallel model would therefore keep one rank's weight shard and one rank's scaling state.
`dcp_save` / `dcp_load` lay the state out so that nothing collides:

- parameters marked as TP shards (`parallel.mark_tp_split`) become DTensors sharded over a
  DeviceMesh of the TP group: the checkpoint holds the whole tensor and each rank reads its shard.
  A fused split (`parts` > 1, e.g. QKV) is viewed as `(..., parts, rows, ...)` so that each part is
  sharded on its own, as the shard loader of `parallel.py` cuts it;
- other parameters and buffers are replicated within the TP group and saved once;
- each dist-quant module's extra state is split in two: its description (recipe, key, roles,
  pinned), identical across a TP group (checked at save: no TP group runs two recipes), as one
  JSON string under `model.<prefix>_extra_state`; each scaling buffer under
  `model.<prefix>_extra_state/<buffer>` as a `(tp, *shape)` DTensor sharded on dim 0: every rank
  keeps its own row, since ranks may hold different amax histories (amax reduced over a smaller
  group, or `reduce_amax=False`).
Data-parallel replicas (same TP rank in other TP groups) write one copy, as for any DCP state.

Loading reads the checkpoint's metadata to learn which scaling buffers exist (a fresh model has no
runtime, hence no buffers to load into), loads into fresh tensors, and hands the result to
`checkpoint.load_state_dict`, which validates everything before touching the model. Resuming
needs the same TP size (the scaling rows are per rank); the weights themselves reshard.
Optimizer state is not included: save it per rank with `torch.save` (see docs/checkpoint.md).
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import Tensor, nn
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard

from dist_quant.checkpoint.model import _dq_modules_by_key, load_state_dict
from dist_quant.checkpoint.module_state import parse_extra_state
from dist_quant.parallel import group_rank, group_size

_MODEL, _JOB = "model", "job"  # top-level keys; the caller's `extra` sits beside them
_SEP = "/"  # between a module's extra-state key and its buffer names (never in a module path)


def _mesh(tp_group: Any, device: torch.device) -> DeviceMesh | None:
    if group_size(tp_group) == 1:
        return None
    return DeviceMesh.from_group(tp_group, device.type)


def _split_view(t: Tensor, split: tuple[int, int]) -> tuple[Tensor, int]:
    """`t` viewed so that its TP shard is one block along the returned dim."""
    dim, parts = split
    if parts == 1:
        return t, dim
    return t.unflatten(dim, (parts, t.shape[dim] // parts)), dim + 1


def _sharded(local: Tensor, dim: int, mesh: DeviceMesh | None) -> Tensor:
    if mesh is None:
        return local
    return DTensor.from_local(local, mesh, [Shard(dim)], run_check=False)


def _check_same_recipes(descriptions: dict[str, str], tp_group: Any) -> None:
    """Every rank of the TP group saves the same description under a key; else name who differs."""
    if group_size(tp_group) == 1:
        return
    gathered: list[Any] = [None] * group_size(tp_group)
    dist.all_gather_object(gathered, descriptions, group=tp_group)  # every rank's descriptions
    for key, mine in descriptions.items():
        for r, theirs in enumerate(gathered):
            if theirs.get(key) != mine:
                raise ValueError(
                    f"dcp_save: {key!r} differs between TP ranks {group_rank(tp_group)} and {r} "
                    "(different recipes or roles inside one TP group); not saving a mixed model"
                )


def dcp_state_dict(model: nn.Module, *, tp_group: Any = None) -> dict[str, Any]:
    """The model's entries as `dcp_save` writes them (see the module docstring)."""
    state = model.state_dict(keep_vars=True)
    owners = _dq_modules_by_key(model)
    device = next((t.device for t in state.values() if isinstance(t, Tensor)), torch.device("cpu"))
    mesh = _mesh(tp_group, device)
    out: dict[str, Any] = {}
    descriptions: dict[str, str] = {}
    for key, value in state.items():
        if key in owners:
            saved = parse_extra_state(value, f"{key!r}")
            buffers = saved.pop("buffers")
            saved["buffer_names"] = sorted(buffers)
            descriptions[key] = out[key] = json.dumps(saved, sort_keys=True)
            for name, t in buffers.items():
                out[f"{key}{_SEP}{name}"] = _sharded(t.unsqueeze(0), 0, mesh)  # this rank's row
        elif isinstance(value, Tensor):
            split = getattr(value, "tp_split", None)
            t = value.detach()
            if split is not None and mesh is not None:
                view, dim = _split_view(t, split)
                out[key] = _sharded(view, dim, mesh)
            else:
                out[key] = t
        else:
            out[key] = value  # another library's extra state: DCP pickles it
    _check_same_recipes(descriptions, tp_group)
    return out


def dcp_save(
    model: nn.Module,
    checkpoint_id: str | os.PathLike[str] | None = None,
    *,
    storage_writer: dcp.StorageWriter | None = None,
    tp_group: Any = None,
    job: Mapping[str, Any] | None = None,
    extra: Mapping[str, Any] | None = None,
) -> None:
    """`dcp.save` of the model with its dist-quant state, the coordinator's `job` state
    (`dist_quant.coordinator.job_state`) and `extra` (the step, ...). Collective: call on every
    rank."""
    sd = {
        _MODEL: dcp_state_dict(model, tp_group=tp_group),
        _JOB: ""
        if job is None
        else json.dumps(dict(job), sort_keys=True),  # one object, not a tree
        "extra": dict(extra or {}),
    }
    dcp.save(sd, checkpoint_id=checkpoint_id, storage_writer=storage_writer)


def _buffer_template(md: Any, where: str, tp: int, mesh: DeviceMesh | None, device) -> Tensor:
    if not isinstance(md, TensorStorageMetadata) or len(md.size) < 1:
        raise ValueError(f"dcp_load: {where} is not a saved scaling buffer (corrupted checkpoint)")
    if md.size[0] != tp:
        raise ValueError(
            f"dcp_load: {where} was saved by {md.size[0]} tensor-parallel rank(s); loading on {tp}"
            ": scaling state is per rank, resume with the same tensor-parallel size"
        )
    local = torch.empty((1, *md.size[1:]), dtype=md.properties.dtype, device=device)
    return _sharded(local, 0, mesh)


def dcp_load(
    model: nn.Module,
    checkpoint_id: str | os.PathLike[str] | None = None,
    *,
    storage_reader: dcp.StorageReader | None = None,
    tp_group: Any = None,
    extra: dict[str, Any] | None = None,
    strict: bool = True,
) -> dict[str, Any] | None:
    """Load what `dcp_save` wrote into `model` (all or nothing) and `extra` (in place, as DCP
    does); returns the saved job state, if any. Collective: call on every rank."""
    reader = storage_reader or dcp.FileSystemReader(checkpoint_id)
    saved_md = reader.read_metadata().state_dict_metadata
    state = model.state_dict(keep_vars=True)
    owners = _dq_modules_by_key(model)
    device = next((t.device for t in state.values() if isinstance(t, Tensor)), torch.device("cpu"))
    mesh, tp = _mesh(tp_group, device), group_size(tp_group)
    target: dict[str, Any] = {}
    for key, value in state.items():
        if key in owners:
            target[key] = ""  # the JSON description; DCP replaces it
            head = f"{_MODEL}.{key}{_SEP}"
            for fqn, md in saved_md.items():
                if fqn.startswith(head):
                    name = fqn[len(head) :]
                    where = f"{key!r} buffer {name!r}"
                    target[key + _SEP + name] = _buffer_template(md, where, tp, mesh, device)
        elif isinstance(value, Tensor):
            fresh = torch.empty_like(value.detach())  # DCP fills it; the model is untouched
            split = getattr(value, "tp_split", None)
            if split is not None and mesh is not None:
                view, dim = _split_view(fresh, split)
                target[key] = _sharded(view, dim, mesh)
            else:
                target[key] = fresh
        else:
            target[key] = value
    if strict:
        loadable = {f"{_MODEL}.{k}" for k in target}
        unexpected = sorted(k for k in saved_md if k.startswith(f"{_MODEL}.") and k not in loadable)
        if unexpected:
            raise ValueError(f"dcp_load: unexpected keys in the checkpoint: {unexpected}")
    sd = {_MODEL: target, _JOB: "", "extra": extra if extra is not None else {}}
    planner = DefaultLoadPlanner(allow_partial_load=not strict)
    dcp.load(sd, checkpoint_id=checkpoint_id, storage_reader=reader, planner=planner)
    load_state_dict(model, _reassemble(sd[_MODEL], state, owners), strict=strict)
    return json.loads(sd[_JOB]) if sd[_JOB] else None


def _reassemble(loaded: dict[str, Any], state: dict[str, Any], owners: dict) -> dict[str, Any]:
    """DCP's layout -> a plain state dict for `checkpoint.load_state_dict`."""
    out: dict[str, Any] = {}
    for key, value in state.items():
        if key not in loaded:
            continue
        got = loaded[key]
        split = isinstance(value, Tensor) and getattr(value, "tp_split", None) is not None
        if key in owners:
            if not isinstance(got, str):
                raise ValueError(f"dcp_load: {key!r}: corrupted description ({type(got).__name__})")
            try:
                desc = json.loads(got)
            except ValueError as e:
                raise ValueError(f"dcp_load: {key!r}: corrupted description: {e}") from e
            names = desc.pop("buffer_names", None) if isinstance(desc, dict) else None
            if not isinstance(names, list):
                raise ValueError(f"dcp_load: {key!r}: corrupted description (no buffer names)")
            rows = {n: loaded.get(f"{key}{_SEP}{n}") for n in names}
            if any(r is None for r in rows.values()):
                raise ValueError(f"dcp_load: {key!r}: a scaling buffer is missing")
            desc["buffers"] = {n: _local(r)[0] for n, r in rows.items()}
            out[key] = desc
        elif isinstance(value, DTensor):
            out[key] = got  # a parameter sharded by its owner (FSDP2): loaded as the same DTensor
        elif isinstance(got, Tensor):
            local = _local(got)
            # a split param's template was its (parts, rows) view: DCP checked that shape
            out[key] = local.reshape(value.shape) if split else local
        else:
            out[key] = got
    return out


def _local(t: Tensor) -> Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


__all__ = ["dcp_load", "dcp_save", "dcp_state_dict"]
