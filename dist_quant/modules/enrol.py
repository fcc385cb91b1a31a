"""Delayed-scaling enrolment as side-effecting ``torch.library`` ops.

Every forward that ran a module with delayed-scaling slots tells the autocast region (the forward
amax reduction at its outermost exit) and, from its backward, the backward region (the reduction
after the last module's backward). Those are Python side effects: a ``torch.compile``'d forward or
an AOT-compiled backward would perform them once, while tracing, and never again. As ops marked
side-effecting (never dead-code eliminated, never run at trace time) they run on every call of the
compiled step, eager and compiled alike. A CUDA graph replays kernels only: see
``dist_quant.graphs`` for how a graphed callable re-enrols.

A module is named to the ops by an integer key (``module_key``), assigned once per module and
passed to the ops as a 0-dim int64 CPU tensor holding it (``QuantBinding.enrol_tag``): a graph input,
not a constant, so that structurally identical blocks compiled one at a time (torchtitan's per-block
``torch.compile``) share one graph, each call naming its own module. The op reads the module's
current runtime when it runs, so a compiled graph never holds on to a runtime that a later publish
replaced (publishing also changes what the graph's guards see, so the graph is retraced where the
new quantizers differ).
"""

from __future__ import annotations

import itertools
import sys
import threading
import weakref
from typing import Any

import torch
from torch import Tensor
from torch.library import Library, register_fake

from dist_quant import context as _context
from dist_quant import recompute
from dist_quant.amax import discard_step, enrol_backward, name_groups

_lock = threading.Lock()
_keys = itertools.count()
# key -> [module ref, reduction group of its latest forward, runtime of its latest forward]
_modules: dict[int, list[Any]] = {}


def module_key(module: torch.nn.Module) -> int:
    """A fresh key for `module` (called once, from its constructor); forgotten with the module."""
    with _lock:
        key = next(_keys)
        ref = weakref.ref(module, lambda _r, k=key: _modules.pop(k, None))
        _modules[key] = [ref, None, None]
    return key


class Recorder:
    """While active (`recording()`), enrolments are recorded instead of performed: a CUDA graph
    capture of a forward and backward records which groups a replay must enrol (the replay runs no
    Python), and its warm-up steps update no scale."""

    def __init__(self) -> None:
        self.forward: dict[int, Any] = {}  # id(amax_history) -> DelayedGroup
        self.backward: dict[int, Any] = {}

    def add(self, groups: list, backward: bool) -> None:
        table = self.backward if backward else self.forward
        for g in groups:
            table.setdefault(id(g.amax_history), g)


# process-wide, not thread-local: CUDA backward passes run on the autograd engine's device threads
_active_recorder: Recorder | None = None


class recording:  # noqa: N801 - used as a context manager, like torch.no_grad
    def __init__(self, recorder: Recorder) -> None:
        self.recorder = recorder

    def __enter__(self) -> Recorder:
        global _active_recorder
        if _active_recorder is not None:
            raise RuntimeError("dist_quant: one CUDA graph capture at a time")
        _active_recorder = self.recorder
        return self.recorder

    def __exit__(self, *exc: object) -> None:
        global _active_recorder
        _active_recorder = None


def _recorder() -> Recorder | None:
    return _active_recorder


def _under_compiled_autograd() -> bool:
    # read from sys.modules: importing torch._dynamo here would cost every process its import
    compiled_autograd = sys.modules.get("torch._dynamo.compiled_autograd")
    return compiled_autograd is not None and compiled_autograd.in_compiled_autograd_region


def _entry(key: int) -> tuple[Any, list[Any]]:
    entry = _modules.get(key)
    module = entry[0]() if entry is not None else None
    if module is None or module.quant_binding.runtime is None:
        raise RuntimeError(f"dist_quant::enrol: no live module with a runtime has key {key}")
    return module, entry


# Python side effects, not GPU work: a CUDA graph would drop them on replay. The tag makes inductor's
# cudagraphs (`mode="reduce-overhead"`) run them outside its graphs (it partitions the graph
# around them, or graphs nothing where partitioning is off) instead of capturing them once.
_HOST_ONLY = (torch.Tag.cudagraph_unsafe,)


# Defined through a `Library` with one CompositeExplicitAutograd kernel rather than `custom_op`,
# whose Python wrapper layers cost a compiled step ~16 us of host time per call (2.4 us this way,
# measured on the CPU): a compiled model calls each op once per module and step.
_lib = Library("dist_quant", "FRAGMENT")
_lib.define("enrol_forward(Tensor anchor, Tensor key) -> ()", tags=_HOST_ONLY)
_lib.define("enrol_backward(Tensor anchor, Tensor key) -> ()", tags=_HOST_ONLY)


def _enrol_forward_kernel(anchor: Tensor, key: Tensor) -> None:
    """Enrol module `key`'s forward delayed-scaling groups in the innermost autocast region and
    remember the region's reduction group for its backward. `anchor` (one of the module's scale
    buffers) is only read by nothing: an op without tensor inputs confuses inductor's buffer
    lifetimes (torch 2.13 frees a graph input before its last use)."""
    module, entry = _entry(int(key))
    if recompute.replaying():
        # a compiled block's recompute under activation_checkpoint: the frame swapped the forward's
        # scales in and restores the amax rows after it; nothing is enrolled a second time
        return
    if torch._C._current_graph_task_id() != -1:
        # a compiled forward run again by plain torch checkpointing: it would quantize with the
        # scales of now, not those of its forward
        raise recompute.RecomputeError(
            f"module {module.role_name!r}: a torch.compile'd forward with delayed scaling is being "
            "recomputed by torch.utils.checkpoint, which cannot replay its forward scales; wrap "
            "the block in dist_quant.activation_checkpoint instead"
        )
    ctx = _context.current_context()
    if ctx is None:
        raise RuntimeError(
            f"module {module.role_name!r}: a quantized forward ran outside autocast (a compiled "
            "or graphed step must be called inside dist_quant.autocast)"
        )
    runtime = module.quant_binding.runtime
    recompute.record_compiled_forward(module, runtime.delayed_groups(fwd=True))
    _enrol(module, entry, runtime, ctx)


def enrol_forward_now(key: int, runtime: Any, ctx: _context.AutocastContext) -> None:
    """What `enrol_forward` does, called directly by an eager forward that is not a recompute
    (its module runs its installed `runtime` inside `ctx`): no dispatcher, no lookups."""
    entry = _modules[key]
    _enrol(entry[0](), entry, runtime, ctx)


def _enrol(module: Any, entry: list[Any], runtime: Any, ctx: _context.AutocastContext) -> None:
    if entry[2] is not runtime:  # name once per runtime: the name orders the packed amaxes
        name_groups(runtime.delayed_groups(fwd=True), module.role_name)
        name_groups(runtime.delayed_groups(fwd=False), module.role_name)
        entry[2] = runtime
    entry[1] = ctx.region.reduction_group
    groups = runtime.delayed_groups(fwd=True)
    recorder = _active_recorder
    if recorder is not None:
        recorder.add(groups, backward=False)
        recorder.add(runtime.delayed_groups(fwd=False), backward=True)
    elif groups:
        ctx.region.add(groups)


_lib.impl("enrol_forward", _enrol_forward_kernel, "CompositeExplicitAutograd")
enrol_forward = torch.ops.dist_quant.enrol_forward.default


def enrol_backward_from(anchor: Tensor, key: int | Tensor) -> None:
    """What a module's backward calls with its plan's key: `enrol_backward_op` where the plan was
    traced (`key` is then its tag tensor, and the op keeps the enrolment in the compiled backward),
    the op's body directly in an eager backward (the dispatcher costs ~40 us of host time)."""
    if isinstance(key, Tensor):
        enrol_backward_op(anchor, key)
    else:
        _enrol_backward(key)


def _enrol_backward_kernel(anchor: Tensor, key: Tensor) -> None:
    """Enrol module `key`'s backward groups in this autograd pass's reduction. `anchor` (the
    incoming gradient) only ties the op to the backward graph."""
    _enrol_backward(int(key))


_lib.impl("enrol_backward", _enrol_backward_kernel, "CompositeExplicitAutograd")
enrol_backward_op = torch.ops.dist_quant.enrol_backward.default


def _enrol_backward(key: int) -> None:
    module, entry = _entry(key)
    if _recorder() is not None:
        return  # recorded by the forward
    if _under_compiled_autograd():
        groups = entry[2].delayed_groups(fwd=False)
        discard_step(groups)  # this pass's gradient amaxes: the step is refused
        raise RuntimeError(
            f"module {module.role_name!r}: a delayed-scaling backward ran under compiled autograd "
            "(torch._dynamo.compiled_autograd), which drops the autograd engine's final callbacks "
            "that reduce the gradient amaxes and update the backward scales; the scales would "
            "silently stop following the gradients. Run the backward without compiled autograd "
            "(torch.compile of the model is supported), or use a recipe without delayed scaling"
        )
    # the runtime whose quantizers the forward saved for this backward (a publish in between
    # must not enrol another runtime's buffers)
    enrol_backward(entry[2].delayed_groups(fwd=False), entry[1])


@register_fake("dist_quant::enrol_forward", lib=_lib)
def _(anchor: Tensor, key: Tensor) -> None:
    recompute.refuse_compiled_recompute_of_delayed_scaling()
    return None


@register_fake("dist_quant::enrol_backward", lib=_lib)
def _(anchor: Tensor, key: Tensor) -> None:
    return None


# Nothing consumes these ops' (absent) outputs: without this, graph passes would drop them.
torch.fx.node.has_side_effect(torch.ops.dist_quant.enrol_forward.default)
torch.fx.node.has_side_effect(torch.ops.dist_quant.enrol_backward.default)
