"""Exact activation checkpointing of dist-quant modules: record in the forward, replay in the recompute.

A checkpointed block runs its forward twice: once in the forward pass, once during backward to
rebuild the activations. Plain `torch.utils.checkpoint` cannot make the second run quantize like the
first: delayed-scaling scales were updated at the autocast exit in between, the recompute would fold
its amaxes into the history a second time, and a backward outside `autocast` would recompute in high
precision. `activation_checkpoint` wraps the block in a frame that, during the forward, records for
every dist-quant module call (in call order) the forward plan it ran (its runtime and the autocast
region's amax reduction group) and a copy of its forward delayed-scaling scales; the recompute
replays those calls: the same plan whether or not autocast is active, the recorded scales swapped
into the scale buffers, no amax enrolment, and every scale and amax-history row the recompute
touched restored when it ends. The result is the forward's quantization, bit for bit, and the
scaling state of the run without checkpointing.

A dist-quant forward that runs during backward outside such a frame is a plain torch recompute. It is
exact only when neither the recompute nor the module's last forward quantize anything (autocast off,
or an all-identity recipe); otherwise it raises `RecomputeError` naming the module.

Compiled around the checkpoint (torchtitan: the checkpoint wrapper, then `torch.compile`), the
recompute is part of the compiled backward graph and no frame can replay it: traced, the checkpoint
is torch's with a selective policy that saves the casts reading a scale buffer, and a delayed-scaling
forward traced inside any other recomputed region is refused while tracing.
"""

from __future__ import annotations

import functools
import re
import threading
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
import torch.fx.traceback as fx_traceback
import torch.utils.checkpoint as torch_checkpoint
from torch.utils._python_dispatch import _disable_current_modes
from torch.utils.checkpoint import CheckpointPolicy

from dist_quant import context as _context
from dist_quant.binding import WRAPPER_ATTRIBUTES, BoundModule, ForwardPlan, QuantBinding
from dist_quant.quantizers import IdentityQuantizer

if TYPE_CHECKING:
    from dist_quant.runtime import ModuleRuntime


class RecomputeError(RuntimeError):
    """A recompute that would not quantize as its forward did; nothing was changed."""


@dataclass
class _CallRecord:
    module: BoundModule
    plan: ForwardPlan | None  # None: the forward ran with autocast off
    scales: list[torch.Tensor]  # the forward delayed groups' scales when the call ran


@dataclass
class _Frame:
    """The dist-quant module calls of one checkpointed block."""

    records: list[_CallRecord] = field(default_factory=list)
    recorded: bool = False
    replaying: bool = False
    cursor: int = 0
    # id(group) -> (group, its live scale, its live amax row 0), saved before the first swap
    live: dict[int, tuple[Any, torch.Tensor, torch.Tensor]] = field(default_factory=dict)
    # id(binding) -> [(group, its forward scale)] of delayed-scaling modules whose forward ran
    # compiled: their calls leave no record, the frame swaps these scales in for the recompute
    compiled: dict[int, list[tuple[Any, torch.Tensor]]] = field(default_factory=dict)

    def begin(self) -> None:
        self.replaying, self.recorded = self.recorded, True
        self.cursor = 0

    def record(self, module: BoundModule, plan: ForwardPlan | None) -> None:
        scales = []
        if plan is not None:
            # bookkeeping stays invisible to selective checkpointing's op caches
            with _disable_current_modes(), torch.no_grad():
                scales = [g.scale.clone() for g in plan.runtime.delayed_groups(fwd=True)]
        self.records.append(_CallRecord(module, plan, scales))

    def replay(self, module: BoundModule) -> ForwardPlan | None:
        if self.cursor >= len(self.records) or self.records[self.cursor].module is not module:
            expected = (
                _name(self.records[self.cursor].module)
                if self.cursor < len(self.records)
                else "no further dist-quant module"
            )
            raise RecomputeError(
                f"activation_checkpoint: the recompute called module {_name(module)!r} where the "
                f"forward called {expected} (call {self.cursor}): a checkpointed block must take "
                "the same path through its dist-quant modules both times"
            )
        rec = self.records[self.cursor]
        self.cursor += 1
        if rec.plan is not None and rec.scales:
            with _disable_current_modes(), torch.no_grad():
                for g, scale in zip(rec.plan.runtime.delayed_groups(fwd=True), rec.scales):
                    if id(g) not in self.live:
                        self.live[id(g)] = (g, g.scale.clone(), g.amax_history[0].clone())
                    g.scale.copy_(scale)
        return rec.plan

    def swap_in_compiled_scales(self) -> None:
        """Before a recompute: the forward scales of every compiled module, the live ones kept."""
        with _disable_current_modes(), torch.no_grad():
            for pairs in self.compiled.values():
                for g, scale in pairs:
                    if id(g) not in self.live:
                        self.live[id(g)] = (g, g.scale.clone(), g.amax_history[0].clone())
                    g.scale.copy_(scale)

    def check_complete(self) -> None:
        if self.replaying and self.cursor != len(self.records):
            raise RecomputeError(
                f"activation_checkpoint: the recompute made {self.cursor} dist-quant module calls "
                f"where the forward made {len(self.records)}: a checkpointed block must take the "
                "same path through its dist-quant modules both times"
            )

    def end(self) -> None:
        """After a replay (finished, stopped early by torch, or failed): the live state back."""
        if self.replaying and self.live:
            with _disable_current_modes(), torch.no_grad():
                for g, scale, row in self.live.values():
                    g.scale.copy_(scale)
                    g.amax_history[0].copy_(row)
        self.live.clear()


class _Local(threading.local):
    def __init__(self) -> None:
        self.frame: _Frame | None = None


_local = _Local()


def _name(module: BoundModule) -> str:
    return module.role_name or type(module).__name__


def record_compiled_forward(binding: QuantBinding, groups: list) -> None:
    """A compiled forward enrolled its delayed-scaling `groups` (`dist_quant::enrol_forward`; an
    eager forward records itself in `record`): inside a recording frame, keep a copy of their
    scales, which the recompute swaps back in (the graph's casts read the scale buffers)."""
    frame = _local.frame
    if frame is None or frame.replaying or id(binding) in frame.compiled:
        return
    with _disable_current_modes(), torch.no_grad():
        frame.compiled[id(binding)] = [(g, g.scale.clone()) for g in groups]


def intercepts() -> bool:
    """Whether a dist-quant forward must be recorded or replayed (`record` / `replay`): inside a
    checkpoint frame, or during backward (a recompute)."""
    return _local.frame is not None or torch._C._current_graph_task_id() != -1


def replaying() -> bool:
    frame = _local.frame
    return frame is not None and frame.replaying


def quantizes(runtime: ModuleRuntime | None) -> bool:
    """Whether `runtime` changes any operand (forward or backward) from high precision."""
    if runtime is None:
        return False
    slots = (*runtime.fwd_quantizers, *runtime.bwd_quantizers)
    return any(q is not None and not isinstance(q, IdentityQuantizer) for q in slots)


def replay(module: BoundModule) -> ForwardPlan | None:
    """In a replaying frame: the plan `module`'s forward ran (None: autocast was off), its
    forward scales swapped in; RecomputeError when the recompute takes another path."""
    return _local.frame.replay(module)


def record(
    module: BoundModule, plan: ForwardPlan | None, last_runtime: ModuleRuntime | None
) -> None:
    """An eager forward inside a recording frame or during backward ran `plan` (None: autocast
    off): the frame records it; outside a frame (torch's own recompute), RecomputeError unless
    neither this run nor the module's last forward (`last_runtime`) quantizes anything."""
    frame = _local.frame
    if frame is not None:
        frame.record(module, plan)
    elif quantizes(None if plan is None else plan.runtime) or quantizes(last_runtime):
        raise RecomputeError(
            f"module {_name(module)!r} ({type(module).__name__}) runs its forward during backward, "
            "as torch.utils.checkpoint's recompute does, with FP8 quantization in the forward or "
            "the recompute: it would not quantize as the forward did (delayed scales move at the "
            "autocast exit and the amaxes would enter the history twice; outside autocast it runs "
            "in high precision). Checkpoint the block with dist_quant.activation_checkpoint(fn, "
            "*args), or checkpoint_wrapper(block, checkpoint_fn=dist_quant.activation_checkpoint)."
        )


def activation_checkpoint(
    fn: Callable[..., Any],
    *args: Any,
    use_reentrant: bool = False,
    context_fn: Callable[[], tuple[Any, Any]] | None = None,
    **kwargs: Any,
) -> Any:
    """`torch.utils.checkpoint.checkpoint(fn, *args, ...)` whose recompute quantizes every dist-quant
    module exactly as the forward did, with the scaling state left as without checkpointing.

    Takes torch's arguments (`use_reentrant`, `preserve_rng_state`, `determinism_check`, ...);
    `context_fn` (non-reentrant only, as in torch) composes with selective activation checkpointing
    (`torch.utils.checkpoint.create_selective_checkpoint_contexts`). Also usable as
    `checkpoint_wrapper(block, checkpoint_fn=activation_checkpoint, use_reentrant=False)`.
    """
    if not callable(fn):
        raise ValueError(f"activation_checkpoint: fn must be callable, got {fn!r}")
    if not isinstance(use_reentrant, bool):
        raise ValueError(
            f"activation_checkpoint: use_reentrant must be a bool, got {use_reentrant!r}"
        )
    if torch.compiler.is_compiling():
        return _compiled_checkpoint(fn, args, context_fn, kwargs)
    if _local.frame is not None:
        raise RecomputeError(
            "activation_checkpoint cannot nest: the block is already inside a checkpointed block "
            "(checkpoint the outer block or the inner ones, not both)"
        )
    frame = _Frame()
    forward_context: list[_context.AutocastContext | None] = []

    def run(*a: Any, **kw: Any) -> Any:
        outer, _local.frame = _local.frame, frame
        frame.begin()
        if not frame.replaying:
            forward_context.append(_context.current_context())
        try:
            if frame.replaying:
                frame.swap_in_compiled_scales()
            # the recompute runs in the forward's autocast context, usually exited by now: a
            # torch.compile'd block then replays the graph it ran (same guards, same saved tensors)
            with _context.reenter(forward_context[0] if frame.replaying else None):
                out = fn(*a, **kw)
            frame.check_complete()  # torch's early stop raises inside fn, before this
            return out
        finally:
            _local.frame = outer
            frame.end()

    if context_fn is not None:
        kwargs["context_fn"] = context_fn
    return torch_checkpoint.checkpoint(run, *args, use_reentrant=use_reentrant, **kwargs)


def _save_scale_reading_casts(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    """Selective checkpointing's policy inside a compiled region: dist-quant's casts that read a
    scale buffer (delayed scaling's) are saved, since the autocast exit updates that buffer before
    the backward, and its side-effect ops (the enrolment, no outputs) never run again; everything
    else is recomputed as plain checkpointing would, casts that compute their scale from the data
    (current scaling, MXFP8, blocks) included: they recompute the same bytes."""
    if getattr(op, "namespace", None) == "dist_quant" and _kept_from_recompute(op):
        return CheckpointPolicy.MUST_SAVE
    return CheckpointPolicy.PREFER_RECOMPUTE


@functools.cache
def _kept_from_recompute(op: Any) -> bool:
    schema = op._schema
    return not schema.returns or any(argument.name == "scale" for argument in schema.arguments)


# the forward dispatch modes of the checkpointed regions `activation_checkpoint` is tracing under
# torch.compile (weakly held: a mode lives as long as its region's trace)
_own_regions: weakref.WeakSet = weakref.WeakSet()


def _save_scale_reading_casts_contexts() -> tuple[Any, Any]:
    forward_mode, recompute_mode = torch_checkpoint.create_selective_checkpoint_contexts(
        _save_scale_reading_casts
    )
    _own_regions.add(forward_mode)
    return forward_mode, recompute_mode


def _compiled_checkpoint(
    fn: Callable[..., Any], args: tuple, context_fn: Any, kwargs: dict[str, Any]
) -> Any:
    """`activation_checkpoint` traced by torch.compile, the block compiled around its checkpoint
    (torchtitan wraps each block for checkpointing, then compiles it). The recompute is then part
    of the compiled backward graph, not a Python re-run a frame could replay: the casts that read
    a scale buffer are saved (their FP8 outputs and scale inverses), because recomputed they would
    read the scale the autocast exit has updated since; the rest of the block is recomputed."""
    if context_fn is not None:
        raise RecomputeError(
            "activation_checkpoint: a context_fn (selective checkpointing) is not supported inside "
            "a torch.compile'd region, where dist-quant installs its own policy (the casts that "
            "read a scale buffer are saved, everything else recomputed); compile the block "
            "inside the checkpoint instead (activation_checkpoint(torch.compile(block), x))"
        )
    return torch_checkpoint.checkpoint(
        fn, *args, use_reentrant=False, context_fn=_save_scale_reading_casts_contexts, **kwargs
    )


_RECOMPUTED = (CheckpointPolicy.MUST_RECOMPUTE, CheckpointPolicy.PREFER_RECOMPUTE)


def refuse_compiled_recompute_of_delayed_scaling() -> None:
    """Called while torch.compile traces a forward with delayed scaling (the enrolment op's fake
    kernel): RecomputeError when the trace is inside a checkpointed region whose ops the compiled
    backward recomputes (plain `torch.utils.checkpoint` compiled around, torchtitan's order
    without `activation_checkpoint`). That recompute would cast with the scales the autocast exit
    updated since: silently other FP8 bytes on CUDA."""
    meta = fx_traceback.get_current_meta()
    if meta.get("recompute") not in _RECOMPUTED:
        return
    # torch tags every op of a region as recomputed while tracing it and applies the region's
    # policy afterwards: a region of activation_checkpoint's is told apart by its graph id
    region = meta.get("ac_graph_id")
    if any(getattr(mode, "ac_graph_id", None) == region for mode in _own_regions):
        return
    modules = list((meta.get("nn_module_stack") or {}).values())
    module = f"module {_traced_path(modules[-1][0])!r}" if modules else "a dist-quant module"
    raise RecomputeError(
        f"{module} (delayed scaling) is traced inside torch.utils.checkpoint in a "
        "torch.compile'd region: the compiled backward would recompute its FP8 casts with the "
        "scales updated at the autocast exit, not the forward's. Checkpoint the block with "
        "dist_quant.activation_checkpoint (checkpoint_wrapper(block, "
        "checkpoint_fn=dist_quant.activation_checkpoint)), which saves the casts under compile"
    )


def _traced_path(source: str) -> str:
    """A module's path in the compiled block from dynamo's source of it
    (``L['self'].__dict__['_modules']['_checkpoint_wrapped_module'].mlp`` -> ``mlp``)."""
    path = re.sub(r"\.__dict__\['_modules'\]\['(\w+)'\]", r".\1", source)
    path = re.sub(r"^L\['self'\]\.?", "", path)
    return ".".join(p for p in path.split(".") if p and p not in WRAPPER_ATTRIBUTES) or source
