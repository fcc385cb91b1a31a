"""What a dist-quant module's forward runs: the one owner of that decision, and of its enrolment.

A module's forward asks `forward_plan(module)` once. Three modes:
- eager (the fast path): one autocast context read and one integer comparison (the recipe
  revision) when nothing moved since the last forward, then the plan stored in the module's
  `QuantBinding` (built at publish, or here when the region's amax reduction group is new);
- traced by torch.compile: the runtime is judged fresh from values the graph's guards can hold,
  and the plan is built inside the trace, never stored;
- inside an activation-checkpoint frame or during backward (`dist_quant.recompute`): a forward
  records the plan it ran, a recompute replays it.
When the recipe revision moved, `_resolve` picks the recipe (pinned by `apply_recipe` / the
coordinator, else autocast's, else the default) and, if the runtime key changed, plans, validates
and publishes this module, or every unpinned module of its planned root at once.

The amax reduction group is read from the autocast region once, when a plan is built, and carried
by the plan (its GEMM slots keep the plan's copy for the backward). A plan whose runtime has
delayed-scaling groups enrols them in the region's amax reduction at every forward, and its backward
enrols the backward groups in the autograd pass's reduction. Those enrolments are Python side
effects: a `torch.compile`'d forward or an AOT-compiled backward would perform them once, while
tracing. So traced code enrols through side-effecting `torch.library` ops (never dead-code
eliminated, never run at trace time) that name the module by its binding's key, held in a 0-dim
int64 CPU tensor (`QuantBinding.enrol_tag`): a graph input, not a constant, so structurally
identical blocks compiled one at a time share one graph. A CUDA graph replays kernels only: see
`dist_quant.graphs` for how a graphed callable re-enrols (`Recorder`).

This file sits one layer below the modules and knows them only as `binding.BoundModule`; only it
and `binding.py` write a binding's fields.
"""

from __future__ import annotations

import sys
import warnings
from typing import Any

import torch
from torch import Tensor
from torch.library import Library, register_fake

from dist_quant import context as _context
from dist_quant import recompute
from dist_quant.amax import discard_step, enrol_backward, name_groups
from dist_quant.binding import (
    BoundModule,
    ForwardPlan,
    QuantBinding,
    assign_role_names,
    bound,
    planned_root,
)
from dist_quant.runtime import (
    ModuleRuntime,
    dist_quant_modules,
    plan_module,
    plan_modules,
    publish_candidates,
)


# ---- the decision --------------------------------------------------------------------------------
def forward_plan(module: BoundModule) -> ForwardPlan | None:
    """This forward's plan, or None when autocast is off (exact high precision); enrols the plan's
    delayed-scaling groups in the autocast region. In an activation-checkpoint recompute: the plan
    the forward ran, enrolling nothing."""
    binding = module.quant_binding
    if torch.compiler.is_compiling() or recompute.intercepts():
        return _intercepted_plan(module, binding)
    ctx = _context.current_context()
    if ctx is None or not ctx.enabled:
        binding._last_runtime = None
        return None
    if binding._seen_revision != _context.recipe_revision():  # -1 while no runtime is installed
        _resolve(module, binding, ctx)
    plan = binding._plan
    group = ctx.region.reduction_group
    if plan is None or plan.reduction_group is not group:
        plan = binding._plan = module.plan_forward(binding._runtime, group)
    binding._last_runtime = plan.runtime
    if plan.enrol_anchor is not None:
        _enrol(binding, plan.runtime, ctx)
    return plan


def active_runtime(module: BoundModule) -> ModuleRuntime | None:
    """The runtime `module`'s forward runs now, or None when autocast is off. In an
    activation-checkpoint frame the call is recorded (or replayed) like a forward, enrolling
    nothing: a block asking ahead of its child's forward (`MultiheadAttention`) stays in step."""
    if torch.compiler.is_compiling():
        return current_runtime(module)  # a recompute of a compiled region is eager
    binding = module.quant_binding
    if recompute.intercepts():
        plan = _recorded_plan(module, binding)
        return None if plan is None else plan.runtime
    runtime = binding._last_runtime = current_runtime(module)
    return runtime


def current_runtime(module: BoundModule) -> ModuleRuntime | None:
    """The runtime `module` would run under the innermost autocast region (resolved, planned and
    published if the recipe moved), or None when autocast is off. Records nothing."""
    ctx = _context.current_context()
    if ctx is None or not ctx.enabled:
        return None
    binding = module.quant_binding
    if torch.compiler.is_compiling():
        return _traced_runtime(module, binding, ctx)
    if binding._seen_revision == _context.recipe_revision() and binding._runtime is not None:
        return binding._runtime
    return _resolve(module, binding, ctx)


def _intercepted_plan(module: BoundModule, binding: QuantBinding) -> ForwardPlan | None:
    """`forward_plan` while torch.compile traces, in a checkpoint frame, or during backward."""
    if torch.compiler.is_compiling():
        runtime = current_runtime(module)
        if runtime is None:
            return None
        # built in the graph's trace, not stored on the module (a traced forward must not mutate it)
        plan = module.plan_forward(runtime, _context.current_context().region.reduction_group)
    else:
        plan = _recorded_plan(module, binding)
        if plan is None:
            return None
    if plan.enrol_anchor is not None and not recompute.replaying():
        # an op, so that a compiled forward enrols on every call, not once while tracing; not in a
        # recompute: the forward enrolled its groups
        enrol_forward(plan.enrol_anchor, binding.enrol_tag)
    return plan


def _recorded_plan(module: BoundModule, binding: QuantBinding) -> ForwardPlan | None:
    """An eager forward inside a checkpoint frame or during backward: the recorded plan in a
    replay; else the plan for the current runtime and region, which the frame records."""
    if recompute.replaying():
        return recompute.replay(module)
    runtime = current_runtime(module)
    plan = None
    if runtime is not None:
        group = _context.current_context().region.reduction_group
        plan = binding._plan
        if plan is None or plan.runtime is not runtime or plan.reduction_group is not group:
            plan = module.plan_forward(runtime, group)
            if runtime is binding._runtime:
                binding._plan = plan
    recompute.record(module, plan, binding._last_runtime)
    return plan


def _traced_runtime(
    module: BoundModule, binding: QuantBinding, ctx: _context.AutocastContext
) -> ModuleRuntime:
    """`current_runtime` while torch.compile traces: the revision counter is not read (a graph
    would be specialised on its value and recompiled at every bump); freshness is decided from
    values the graph's guards can hold (autocast's recipe key, the role revision), so a switch
    retraces. Planning allocates state and cannot be traced: a stale runtime is resolved eagerly,
    outside the graph (a graph break; under fullgraph=True, dynamo refuses it)."""
    rt = binding._runtime
    stale = (
        rt is None
        or binding._planned_roles != binding.role_revision
        or (binding._pinned is None and binding._resolved_for != ctx.recipe_key)
    )
    return _resolve_outside_graph(module) if stale else rt


@torch.compiler.disable
def _resolve_outside_graph(module: BoundModule) -> ModuleRuntime:
    """A compiled forward found `module`'s runtime stale (a lazy `autocast(recipe=...)` switch or a
    role change): plan it eagerly. Under `torch.compile(..., fullgraph=True)` this graph break is
    refused; switch with `apply_recipe` (or the coordinator) instead, whose publish retraces."""
    return active_runtime(module)


def _resolve(
    module: BoundModule, binding: QuantBinding, ctx: _context.AutocastContext
) -> ModuleRuntime:
    if not binding.planned:
        # built or first called where no planned model reaches it: it is its own root
        assign_role_names(module)
    revision = _context.recipe_revision()
    pinned = binding._pinned
    if pinned is not None:
        recipe = pinned
        if (
            ctx.recipe is not None
            and ctx.recipe_key != recipe.key()
            and not binding._warned_override
        ):
            binding._warned_override = True
            warnings.warn(
                f"module {binding.role_name!r} runs the recipe pinned by apply_recipe / the "
                "coordinator; autocast's recipe argument is ignored for it",
                stacklevel=4,
            )
    else:
        recipe = ctx.recipe if ctx.recipe is not None else _context.default_recipe()
    key = recipe.key()
    try:
        if binding._runtime is not None and binding._runtime.recipe_key == key:
            candidates = [plan_module(module, recipe, key)]  # only this module's roles moved
        else:
            # A new recipe switches every unpinned module of the planned model at once, so that a
            # failure anywhere leaves the whole model on its old recipe (as apply_recipe does).
            root = planned_root(module)
            modules = [module]
            if root is not None and pinned is None:
                unpinned = [
                    m for m in dist_quant_modules(root) if m.quant_binding.pinned_recipe is None
                ]
                if any(m is module for m in unpinned):
                    modules = unpinned
            candidates = plan_modules(modules, recipe, key)
    except Exception:
        ctx.region.failed = True
        raise
    if any(not c.unchanged for c in candidates):
        publish_candidates(candidates, key)
        revision = _context.recipe_revision()
    binding._seen_revision = revision
    binding._resolved_for = ctx.recipe_key
    binding._planned_roles = binding.role_revision
    return binding._runtime


def delayed_anchor(runtime: ModuleRuntime) -> torch.Tensor | None:
    """The tensor a forward enrols `runtime`'s delayed-scaling groups with (one of their scales),
    or None when it has none in either direction."""
    groups = runtime.delayed_groups(fwd=True) or runtime.delayed_groups(fwd=False)
    return groups[0].scale if groups else None


# ---- enrolment -----------------------------------------------------------------------------------
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


def _under_compiled_autograd() -> bool:
    # read from sys.modules: importing torch._dynamo here would cost every process its import
    compiled_autograd = sys.modules.get("torch._dynamo.compiled_autograd")
    return compiled_autograd is not None and compiled_autograd.in_compiled_autograd_region


def _live(key: int) -> QuantBinding:
    binding = bound(key)
    if binding._runtime is None:
        raise RuntimeError(f"dist_quant::enrol: no live module with a runtime has key {key}")
    return binding


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
    remember the region's reduction group for its compiled backward. `anchor` (one of the module's
    scale buffers) is only read by nothing: an op without tensor inputs confuses inductor's buffer
    lifetimes (torch 2.13 frees a graph input before its last use)."""
    binding = _live(int(key))
    if recompute.replaying():
        # a compiled block's recompute under activation_checkpoint: the frame swapped the forward's
        # scales in and restores the amax rows after it; nothing is enrolled a second time
        return
    if torch._C._current_graph_task_id() != -1:
        # a compiled forward run again by plain torch checkpointing: it would quantize with the
        # scales of now, not those of its forward
        raise recompute.RecomputeError(
            f"module {binding.role_name!r}: a torch.compile'd forward with delayed scaling is "
            "being recomputed by torch.utils.checkpoint, which cannot replay its forward scales; "
            "wrap the block in dist_quant.activation_checkpoint instead"
        )
    ctx = _context.current_context()
    if ctx is None:
        raise RuntimeError(
            f"module {binding.role_name!r}: a quantized forward ran outside autocast (a compiled "
            "or graphed step must be called inside dist_quant.autocast)"
        )
    runtime = binding._runtime
    recompute.record_compiled_forward(binding, runtime.delayed_groups(fwd=True))
    # the compiled backward names the module by its key only: it reduces over this group
    binding._traced_runtime, binding._traced_group = runtime, ctx.region.reduction_group
    _enrol(binding, runtime, ctx)


def _enrol(binding: QuantBinding, runtime: ModuleRuntime, ctx: _context.AutocastContext) -> None:
    if binding._named_runtime is not runtime:  # once per runtime: the name orders packed amaxes
        name_groups(runtime.delayed_groups(fwd=True), binding.role_name)
        name_groups(runtime.delayed_groups(fwd=False), binding.role_name)
        binding._named_runtime = runtime
    groups = runtime.delayed_groups(fwd=True)
    recorder = _active_recorder
    if recorder is not None:
        recorder.add(groups, backward=False)
        recorder.add(runtime.delayed_groups(fwd=False), backward=True)
    elif groups:
        ctx.region.add(groups)


_lib.impl("enrol_forward", _enrol_forward_kernel, "CompositeExplicitAutograd")
enrol_forward = torch.ops.dist_quant.enrol_forward.default


def enrol_backward_from(
    anchor: Tensor, key: int | Tensor, groups: tuple, reduction_group: Any
) -> None:
    """What a module's backward calls with its plan's key, backward groups and reduction group:
    `enrol_backward_op` where the plan was traced (`key` is then its tag tensor, and the op keeps
    the enrolment in the compiled backward, reducing over the group its compiled forward ran
    under), the plan's own copies directly in an eager backward (the dispatcher costs ~40 us of
    host time)."""
    if isinstance(key, Tensor):
        enrol_backward_op(anchor, key)
    else:
        _enrol_backward(key, groups, reduction_group)


def _enrol_backward_kernel(anchor: Tensor, key: Tensor) -> None:
    """Enrol module `key`'s backward groups in this autograd pass's reduction. `anchor` (the
    incoming gradient) only ties the op to the backward graph."""
    binding = _live(int(key))
    runtime = binding._traced_runtime
    _enrol_backward(binding.enrol_key, runtime.delayed_groups(fwd=False), binding._traced_group)


_lib.impl("enrol_backward", _enrol_backward_kernel, "CompositeExplicitAutograd")
enrol_backward_op = torch.ops.dist_quant.enrol_backward.default


def _enrol_backward(key: int, groups: list | tuple, reduction_group: Any) -> None:
    if _active_recorder is not None:
        return  # recorded by the forward
    if _under_compiled_autograd():
        discard_step(groups)  # this pass's gradient amaxes: the step is refused
        raise RuntimeError(
            f"module {bound(key).role_name!r}: a delayed-scaling backward ran under compiled "
            "autograd (torch._dynamo.compiled_autograd), which drops the autograd engine's final "
            "callbacks that reduce the gradient amaxes and update the backward scales; the scales "
            "would silently stop following the gradients. Run the backward without compiled "
            "autograd (torch.compile of the model is supported), or use a recipe without delayed "
            "scaling"
        )
    enrol_backward(groups, reduction_group)


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
