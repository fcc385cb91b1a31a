"""CUDA graphs of dist-quant steps: capture once, replay bit for bit like the eager step.

A replay runs the captured kernels and no Python. Everything a quantized step reads lives in fixed
buffers updated in place (delayed scaling's scale and amax history, current scaling's per-call
outputs from the graph's pool), so kernels replay into the right memory. Two things are Python and
need help:

- which delayed-scaling groups ran (the forward and backward amax reductions at autocast exit and
  after backward update exactly those);
- whether the model still runs the runtimes that were captured (a publish swaps them: a replay
  would then quantize with the old buffers, silently).

`make_graphed_callables(module, sample_args)` wraps `torch.cuda.make_graphed_callables` for a
forward+backward: it records the groups while capturing (its warm-up iterations change no scale:
the buffers are restored afterwards), and every call of the returned module enrols them again and
checks the captured runtimes. The amax reduction and scale update then run eagerly, outside the
graphs, as in an eager step.

`GraphedStep(step_fn, model)` captures a whole training step (autocast region, backward,
optimizer) with `torch.cuda.graph`; the update kernels are inside the graph. Its warm-up calls
of `step_fn` are real training steps. Every replay checks the captured runtimes.

Both raise `GraphInvalidated` after a recipe switch (`apply_recipe`, the coordinator's publish):
capture again. Amax reductions over more than one rank need the host (a mismatch guard) and
cannot be captured in a whole-step graph; `make_graphed_callables` keeps them outside the graph.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from dist_quant import context as _context
from dist_quant.amax import enrol_backward
from dist_quant.forward import Recorder, recording
from dist_quant.runtime import dist_quant_modules


class GraphInvalidated(RuntimeError):
    """The model's recipe changed since the graph was captured; capture again."""


class _CapturedRuntimes:
    """The runtimes a graph was captured with, checked before every replay."""

    def __init__(self, model: nn.Module, what: str) -> None:
        self.modules = dist_quant_modules(model)
        unplanned = [
            m.role_name or type(m).__name__ for m in self.modules if m.quant_binding.runtime is None
        ]
        if unplanned:
            raise ValueError(
                f"{what}: modules {unplanned} have no recipe yet; call "
                "dist_quant.apply_recipe(model, recipe) before capturing"
            )
        self.runtimes = [m.quant_binding.runtime for m in self.modules]
        self.what = what

    def check(self) -> None:
        for m, rt in zip(self.modules, self.runtimes):
            if m.quant_binding.runtime is not rt:
                name = m.role_name or type(m).__name__
                raise GraphInvalidated(
                    f"{self.what}: module {name!r} switched recipe since the capture "
                    "(apply_recipe or a coordinator publish); the graph would quantize with the "
                    "old recipe's buffers. Capture again."
                )

    def state_buffers(self) -> list[torch.Tensor]:
        out = []
        for rt in self.runtimes:
            for state in (rt.fwd_state, rt.bwd_state):
                out.extend(state.persistent_buffers().values())
        return out


class _EnrolBackward(torch.autograd.Function):
    """Identity on the outputs; its backward enrols the recorded backward groups, so the
    reduction after the backward pass updates them (the replayed backward runs no Python)."""

    @staticmethod
    def forward(ctx: Any, groups: list, reduction_group: Any, *outs: torch.Tensor) -> Any:
        ctx.groups, ctx.reduction_group = groups, reduction_group
        return tuple(o.view_as(o) for o in outs)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple:
        enrol_backward(ctx.groups, ctx.reduction_group)
        return (None, None, *grads)


def make_graphed_callables(
    module: nn.Module, sample_args: Sequence[torch.Tensor], *, num_warmup_iters: int = 3
) -> nn.Module:
    """`torch.cuda.make_graphed_callables(module, sample_args)` for a dist-quant model.

    Call it outside autocast, after `apply_recipe`; call the returned module (the same object,
    its forward replaced) inside `dist_quant.autocast()`. Every call enrols the delayed-scaling
    groups the capture recorded and raises `GraphInvalidated` once the recipe changed.
    """
    what = f"dist_quant.make_graphed_callables({type(module).__name__})"
    if _context.in_autocast():
        raise RuntimeError(f"{what}: call it outside autocast (it captures in its own region)")
    captured = _CapturedRuntimes(module, what)
    buffers = captured.state_buffers()
    saved = [b.clone() for b in buffers]
    recorder = Recorder()
    try:
        with recording(recorder), _context.autocast():
            graphed = torch.cuda.make_graphed_callables(
                module, tuple(sample_args), num_warmup_iters=num_warmup_iters
            )
    finally:
        with torch.no_grad():
            for b, s in zip(buffers, saved):
                b.copy_(s)  # in place: the graphs keep these pointers
    replay = graphed.forward
    fwd_groups = list(recorder.forward.values())
    bwd_groups = list(recorder.backward.values())

    def forward(*args: Any) -> Any:
        captured.check()
        ctx = _context.current_context()
        if ctx is None or not ctx.enabled:
            raise RuntimeError(f"{what}: call the graphed module inside dist_quant.autocast()")
        if fwd_groups:
            ctx.region.add(fwd_groups)
        out = replay(*args)
        if not bwd_groups or not torch.is_grad_enabled():
            return out
        single = isinstance(out, torch.Tensor)
        outs = _EnrolBackward.apply(
            bwd_groups, ctx.region.reduction_group, *((out,) if single else out)
        )
        return outs[0] if single else outs

    graphed.forward = forward
    return graphed


class GraphedStep:
    """A whole training step captured with `torch.cuda.graph` and replayed on every call.

    `step_fn()` runs one step on static tensors (copy each batch into them before calling), e.g.
    `with autocast(): loss = model(x).sum()`, `loss.backward()`, `opt.step()`; gradients must be
    zeroed in place (`zero_grad(set_to_none=False)`). The `warmup_steps` calls made before the
    capture, on a side stream, are real training steps. Amax reduction groups of more than one
    rank cannot be captured (their guard reads a header on the host).
    """

    def __init__(self, step_fn: Callable[[], Any], model: nn.Module, *, warmup_steps: int = 3):
        self.captured = _CapturedRuntimes(model, f"dist_quant.GraphedStep({type(model).__name__})")
        if warmup_steps < 1:
            raise ValueError(f"GraphedStep: warmup_steps must be >= 1, got {warmup_steps}")
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(warmup_steps):
                step_fn()
        torch.cuda.current_stream().wait_stream(side)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self.output = step_fn()

    def __call__(self) -> Any:
        """Replay one step; returns the captured step's (static) output."""
        self.captured.check()
        self.graph.replay()
        return self.output
