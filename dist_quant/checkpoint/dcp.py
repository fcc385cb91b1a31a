"""torch.distributed.checkpoint (DCP) for dist-quant models, tensor parallelism included.

DCP writes each key once: entries under one key on several ranks are taken as replicas and only
one rank's copy is kept (tensors and pickled objects alike). A plain `model.state_dict()` of a
tensor-parallel model would therefore keep one rank's weight shard and one rank's scaling state.
`dcp_save` / `dcp_load` lay the state out so that nothing collides:

- parameters marked as TP shards (`parallel.mark_tp_split`) become DTensors sharded over a
  DeviceMesh of the TP group: the checkpoint holds the whole tensor and each rank reads its shard.
  A fused split (`parts` > 1, e.g. QKV) is viewed as `(..., parts, rows, ...)` so that each part is
  sharded on its own, as the shard loader of `parallel.py` cuts it;
- under FSDP2 x TP (a `(dp, tp)` mesh) such a parameter is FSDP2's DTensor of the TP shard; it
  is saved as a DTensor over a `(tp, dp)` mesh of the same process groups, placed `[Shard(tp dim),
  Shard(0)]`, so each rank writes its FSDP2 slice of its TP shard at its offset in the whole
  tensor. A fused split on dim 0 (QKV, SwiGLU's fc1) cannot be placed that way (FSDP2's slice of
  the concatenated parts is not one block of the parts view): its TP shard is all-gathered over
  the data-parallel ranks while saving and loading (one such parameter at a time);
- a fused split into unequal pieces (a grouped-query QKV: q rows, then the fewer k and v rows) has
  no view in which a rank's shard is one block: it is all-gathered over the TP group (and the
  data-parallel ranks under FSDP2) and saved whole, as a replicated tensor, one parameter at a
  time; loading reads it whole and cuts this rank's shard;
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
`checkpoint.load_state_dict`, which validates everything before touching the model. Weights
reshard to any data- and tensor-parallel size; a tensor whose saved shape is another TP layout's
(a fused view loaded without TP, or the reverse) is read whole and cut. On another TP size the
scaling rows must be identical across the saving TP ranks (amax reduced over TP), else refused.
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
from dist_quant.parallel import group_rank, group_size, shard_of, tp_splits, unshard

_MODEL, _JOB = "model", "job"  # top-level keys; the caller's `extra` sits beside them
_SEP = "/"  # between a module's extra-state key and its buffer names (never in a module path)


def _mesh(tp_group: Any, device: torch.device) -> DeviceMesh | None:
    if group_size(tp_group) == 1:
        return None
    return DeviceMesh.from_group(tp_group, device.type)


def _tp_dp_mesh(tp_group: Any, dp_mesh: DeviceMesh, device: torch.device) -> DeviceMesh:
    """A `(tp, dp)` mesh over the existing TP and FSDP2 groups (no new process group): rank
    (tp rank j, dp rank i) sits at [j, i]. Collective over the data-parallel group."""
    dp_group = dp_mesh.get_group()
    mine = sorted(
        dist.get_process_group_ranks(tp_group), key=lambda r: dist.get_group_rank(tp_group, r)
    )
    columns: list[Any] = [None] * dist.get_world_size(dp_group)
    dist.all_gather_object(columns, mine, group=dp_group)  # every replica's TP ranks, by dp rank
    layout = torch.tensor(columns, dtype=torch.int).t().contiguous()
    return DeviceMesh.from_group(
        [tp_group, dp_group], device.type, mesh=layout, mesh_dim_names=("tp", "dp")
    )


class _Layout:
    """Where each TP-split parameter goes in the checkpoint (see the module docstring)."""

    def __init__(self, model: nn.Module, tp_group: Any, device: torch.device) -> None:
        self.tp_group, self.device = tp_group, device
        self.mesh = _mesh(tp_group, device)
        self.splits = tp_splits(model) if self.mesh is not None else {}
        self._meshes: dict[Any, DeviceMesh] = {}
        self.whole: set[str] = set()  # keys loaded as the whole tensor (another TP layout)

    def split(self, key: str) -> tuple[int, int | tuple[int, ...]] | None:
        return self.splits.get(key)

    def mesh_2d(self, fsdp: DTensor) -> DeviceMesh:
        dp_mesh = fsdp.device_mesh
        if dp_mesh not in self._meshes:
            self._meshes[dp_mesh] = _tp_dp_mesh(self.tp_group, dp_mesh, self.device)
        return self._meshes[dp_mesh]

    def saved(self, key: str, t: Tensor) -> Tensor:
        """`t` (a TP shard, or FSDP2's DTensor of one) as the checkpoint holds it."""
        split = self.splits[key]
        if _uneven(split):
            if isinstance(t, DTensor):
                _check_fsdp(t, key)
                t = t.full_tensor()  # dp slices -> this rank's TP shard
            shards = [torch.empty_like(t) for _ in range(group_size(self.tp_group))]
            dist.all_gather(shards, t.contiguous(), group=self.tp_group)  # every rank's TP shard
            return unshard(shards, *split)
        if not isinstance(t, DTensor):
            view, dim = _split_view(t, split)
            return _sharded(view, dim, self.mesh)
        _check_fsdp(t, key)
        if _gathers(split):
            return self.saved(key, t.full_tensor())  # dp slices -> this rank's TP shard
        return self._placed(key, t, t.to_local())

    def template(self, key: str, value: Tensor) -> Tensor:
        """An empty tensor laid out as `saved(key, value)`, for DCP to load into."""
        split = self.splits[key]
        if _uneven(split):
            whole = list(value.shape)  # the TP shard's (FSDP2's global shape is the TP shard's)
            whole[split[0]] *= group_size(self.tp_group)
            return torch.empty(whole, dtype=value.dtype, device=self.device)
        if not isinstance(value, DTensor):
            return self.saved(key, torch.empty_like(value.detach()))
        _check_fsdp(value, key)
        if _gathers(split):
            return self.saved(key, torch.empty(value.shape, dtype=value.dtype, device=self.device))
        return self._placed(key, value, torch.empty_like(value.to_local()))

    def loaded(self, key: str, got: Tensor, value: Tensor) -> Tensor:
        """What DCP filled in (`template`'s layout) -> the model parameter's own layout."""
        local = _local(got)
        if _uneven(self.splits[key]):
            return self.cut(key, local, value)  # saved whole
        if not isinstance(value, DTensor):
            return local.reshape(value.shape)  # DCP checked the (parts, rows) view's shape
        if _gathers(self.splits[key]):
            return _fsdp_slice(local.reshape(value.shape), value, key)  # from the TP shard
        return _fsdp_slice(local.reshape(value.to_local().shape), value, key, sliced=True)

    def cut(self, key: str, whole: Tensor, value: Tensor) -> Tensor:
        """This rank's part of a whole saved tensor, in the parameter's layout (TP, FSDP2)."""
        split = self.splits.get(key)
        flat = list(value.shape)  # the TP shard's (FSDP2's global shape is the TP shard's)
        if split is not None:
            flat[split[0]] *= group_size(self.tp_group)
        if whole.numel() != torch.Size(flat).numel():
            raise ValueError(
                f"dcp_load: {key!r} is {tuple(whole.shape)} in the checkpoint; the model's "
                f"whole tensor is {tuple(flat)}"
            )
        whole = whole.reshape(flat)  # a saved (parts, rows) view flattens back exactly
        mine = whole
        if split is not None:
            mine = shard_of(whole, *split, group_rank(self.tp_group), group_size(self.tp_group))
        return _fsdp_slice(mine, value, key) if isinstance(value, DTensor) else mine

    def _placed(self, key: str, fsdp: DTensor, local: Tensor) -> DTensor:
        """`local` (FSDP2's slice of the TP shard, dim 0) at its offset in the whole tensor."""
        dim, parts = self.splits[key]
        tp = group_size(self.tp_group)
        whole = list(fsdp.shape)  # FSDP2's global shape is the TP shard's
        whole[dim] *= tp
        view, tp_dim = _split_view(local, (dim, parts))
        if parts > 1:
            whole[dim : dim + 1] = [parts, whole[dim] // parts]
        stride = torch.empty(whole, device="meta").stride()
        return DTensor.from_local(
            view,
            self.mesh_2d(fsdp),
            [Shard(tp_dim), Shard(0)],
            run_check=False,
            shape=torch.Size(whole),
            stride=stride,
        )


def _check_fsdp(fsdp: DTensor, key: str) -> None:
    """The layouts above assume fully_shard's default: dim 0 chunked over a 1-D mesh."""
    if fsdp.device_mesh.ndim != 1 or tuple(fsdp.placements) != (Shard(0),):
        raise ValueError(
            f"dcp: {key!r} is sharded {fsdp.placements} over a {fsdp.device_mesh.ndim}-D mesh; a "
            "tensor-parallel parameter, or one saved under another tensor-parallel layout, needs "
            "fully_shard's default Shard(0) over a 1-D data-parallel mesh"
        )


def _fsdp_slice(tp_shard: Tensor, value: DTensor, key: str, *, sliced: bool = False) -> DTensor:
    """FSDP2's DTensor of `value`'s layout from this rank's TP shard (FSDP2's dim-0 chunk of it),
    or from its own slice already (`sliced`)."""
    mine = tp_shard
    if not sliced:
        _check_fsdp(value, key)
        chunks = tp_shard.chunk(value.device_mesh.size(), 0)
        rank = value.device_mesh.get_local_rank()
        mine = chunks[rank] if rank < len(chunks) else tp_shard[:0]
    return DTensor.from_local(
        mine,
        value.device_mesh,
        value.placements,
        run_check=False,
        shape=value.shape,
        stride=value.stride(),
    )


def _uneven(split: tuple[int, int | tuple[int, ...]]) -> bool:
    """Pieces of unequal sizes (`mark_tp_split` keeps a tuple only then): saved whole."""
    return isinstance(split[1], tuple)


def _gathers(split: tuple[int, int]) -> bool:
    """A fused split along FSDP2's dim 0: its FSDP2 slice is not one block of the parts view."""
    return split[0] == 0 and split[1] > 1


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
    device = _device(state)
    layout = _Layout(model, tp_group, device)
    mesh = layout.mesh
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
            t = value.detach()
            out[key] = t if layout.split(key) is None else layout.saved(key, t)
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
    if md.size[0] != tp:  # another TP size: every rank reads every row (`_rows` checks them)
        return torch.empty(md.size, dtype=md.properties.dtype, device=device)
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
    device = _device(state)
    layout = _Layout(model, tp_group, device)
    mesh, tp = layout.mesh, group_size(tp_group)
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
            if layout.split(key) is None:  # DCP fills it; the model is untouched
                target[key] = torch.empty_like(value.detach())
            else:
                target[key] = layout.template(key, value)
            md = saved_md.get(f"{_MODEL}.{key}")
            if isinstance(md, TensorStorageMetadata) and md.size != target[key].shape:
                # saved under another TP layout (a TP checkpoint on another TP size, with or
                # without FSDP2): read the whole tensor, `_Layout.cut` takes this rank's part
                target[key] = torch.empty(md.size, dtype=md.properties.dtype, device=device)
                layout.whole.add(key)
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
    load_state_dict(model, _reassemble(sd[_MODEL], state, owners, layout), strict=strict)
    return json.loads(sd[_JOB]) if sd[_JOB] else None


def _reassemble(
    loaded: dict[str, Any], state: dict[str, Any], owners: dict, layout: _Layout
) -> dict[str, Any]:
    """DCP's layout -> a plain state dict for `checkpoint.load_state_dict`."""
    out: dict[str, Any] = {}
    for key, value in state.items():
        if key not in loaded:
            continue
        got = loaded[key]
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
            desc["buffers"] = {
                n: _rows(_local(r), f"{key!r} buffer {n!r}") for n, r in rows.items()
            }
            out[key] = desc
        elif key in layout.whole:
            out[key] = layout.cut(key, _local(got), value)
        elif isinstance(value, Tensor) and layout.split(key) is not None:
            out[key] = layout.loaded(key, got, value)
        elif isinstance(value, DTensor):
            out[key] = got  # a parameter sharded by its owner (FSDP2): loaded as the same DTensor
        elif isinstance(got, Tensor):
            out[key] = _local(got)
        else:
            out[key] = got
    return out


def _rows(rows: Tensor, where: str) -> Tensor:
    """This rank's scaling buffer from the rows DCP loaded: its own, or, loading on another TP
    size, the one row every saving TP rank held (the amax reduced over TP); else refuse."""
    if rows.shape[0] == 1:
        return rows[0]
    bits = rows.contiguous().view(torch.uint8).reshape(rows.shape[0], -1)
    if not all(torch.equal(b, bits[0]) for b in bits[1:]):
        raise ValueError(
            f"dcp_load: {where} differs between the {rows.shape[0]} tensor-parallel ranks that "
            "saved it (amaxes not reduced over the TP group): scaling state is per rank there, "
            "resume with the same tensor-parallel size"
        )
    return rows[0]


def _device(state: Mapping[str, Any]) -> torch.device:
    return next((t.device for t in state.values() if isinstance(t, Tensor)), torch.device("cpu"))


def _local(t: Tensor) -> Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


__all__ = ["dcp_load", "dcp_save", "dcp_state_dict"]
