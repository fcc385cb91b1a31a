"""Launching a Triton kernel without the JIT's per-call work, once it is compiled.

``kernel[grid](*args, **constexprs)`` binds and specialises every argument, builds a cache key,
checks the kernel's globals and canonicalises the grid on every call: tens of microseconds of host
time for the many-argument cast kernels, more than the GPU spends on a TP-shard-sized cast. A
``FastLaunch`` keys its own cache on what Triton specialises on (each tensor's dtype and 16-byte
alignment; each integer's ``== 1``, divisibility by 16 and width) plus a ``LaunchConfig`` (the
constexprs and launch options, built once per configuration by the caller), lets the JIT compile
and launch the first call of a key, and launches later calls of the key through the compiled
kernel's launcher, as the JIT itself does after its bookkeeping.

Only compiled GPU kernels take the fast path: under ``TRITON_INTERPRET=1`` (the CPU tests) every
call goes through the JIT, and so does any Triton whose compiled kernel lacks the launcher this
relies on (checked once per key, falling back to the JIT path for good).

While ``torch.compile`` traces a launcher (the ``torch.library.triton_op`` ops of ``_op.py``:
AOTAutograd runs them on fake and functional tensors), a launch goes through
``torch.library.wrap_triton`` instead, so the graph records the kernel call itself and inductor
launches the kernel from its own generated code.
"""

from __future__ import annotations

import functools
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from dist_quant.kernels._triton import driver, knobs
from torch.library import wrap_triton

_I32_MIN, _I32_END = -(2**31), 2**31


@dataclass(frozen=True)
class LaunchConfig:
    """Constexprs and launch options of one kernel configuration (hashable: build it once)."""

    constexprs: tuple[tuple[str, Any], ...]
    options: tuple[tuple[str, Any], ...] = ()
    kwargs: dict[str, Any] = field(init=False, compare=False, hash=False, repr=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "kwargs", {**dict(self.constexprs), **dict(self.options)})


@functools.cache
def launch_config(constexprs: tuple[tuple[str, Any], ...], options: tuple = ()) -> LaunchConfig:
    return LaunchConfig(constexprs, options)


_OPTIONS = ("num_warps", "num_stages")


def config_of(kwargs: dict[str, Any]) -> LaunchConfig:
    """The ``LaunchConfig`` of ``kernel[grid](*args, **kwargs)``'s keywords (constexprs and launch
    options mixed, as Triton takes them)."""
    constexprs = tuple((k, v) for k, v in kwargs.items() if k not in _OPTIONS)
    return launch_config(constexprs, tuple((k, kwargs[k]) for k in _OPTIONS if k in kwargs))


def _specialisation(args: Sequence[Any]) -> tuple:
    out = []
    for a in args:
        if isinstance(a, torch.Tensor):
            out.append((a.dtype, (a.data_ptr() & 15) == 0))
        elif isinstance(a, bool) or not isinstance(a, int):
            out.append(a if a is None or isinstance(a, bool) else type(a))
        else:
            out.append((a == 1, (a & 15) == 0, _I32_MIN <= a < _I32_END))
    return tuple(out)


def _launch_hooks() -> tuple[Any, Any]:
    """Triton's launch enter and exit hooks, each None while nothing is installed in it. Triton
    3.6+ keeps them as hook chains that are never None: passed as they are, every launch builds
    its metadata and calls two empty chains; None tells the launcher there is no hook, which is
    what an empty chain means."""
    return _installed(knobs.runtime.launch_enter_hook), _installed(knobs.runtime.launch_exit_hook)


def _installed(hook: Any) -> Any:
    calls = getattr(hook, "calls", None)  # a HookChain's hooks; older Triton: a callable or None
    return None if calls is not None and not calls else hook


@functools.cache
def _current_device_and_stream() -> tuple[Any, Any]:
    # resolved once: `driver.active` is a proxy that looks the backend up on every attribute
    active = driver.active
    return active.get_current_device, active.get_current_stream


EAGER_TENSOR_TYPES = (torch.Tensor, torch.nn.Parameter)
"""The types a launcher sees outside torch.compile's tracing, which hands it fake or functional
tensors instead (a parameter is itself a plain tensor to a kernel: the weight's cast)."""


def traced(t: torch.Tensor) -> bool:
    """Whether a launcher runs under torch.compile's tracing: its tensors are then fake or
    functional tensors (subclasses), never plain ones or parameters."""
    return type(t) not in EAGER_TENSOR_TYPES


PLAN_LIMIT = 1024
"""Most prepared launches a table keeps: a model sees a few layouts per module, but a run whose
sequence lengths vary would add one per length; a full table is emptied and refilled by the
next casts (each pays the full launch path once)."""


def remember(table: dict, key: Any, value: Any) -> None:
    """``table[key] = value``, emptying ``table`` first when it holds ``PLAN_LIMIT`` entries."""
    if len(table) >= PLAN_LIMIT:
        table.clear()
    table[key] = value


class PreparedLaunch:
    """One compiled kernel at one grid, relaunched with no lookup at all: ``launch(stream,
    *args)`` runs ``kernel[grid](*args, *fixed, **constexprs)`` on ``stream`` (a raw CUDA stream
    handle). Only valid for arguments that Triton specialises the same way as those of the launch
    it was prepared from (same dtypes, 16-byte alignments, integer properties): the caller keys
    its prepared launches on everything that decides those, so a hit skips the per-call
    specialisation and cache lookup of ``FastLaunch``. The launcher reads only the address of a
    tensor argument, so a tensor may be passed for its same-address view (an FP8 tensor for the
    uint8 view the kernel was compiled with)."""

    __slots__ = ("_compiled", "_run", "_function", "_packed", "_tail", "_grid")

    def __init__(self, entry: tuple, grid: Sequence[int], fixed: tuple) -> None:
        compiled, run, function, packed, tail = entry
        self._compiled, self._run, self._function, self._packed = compiled, run, function, packed
        self._tail = (*fixed, *tail)
        self._grid = (grid[0], grid[1] if len(grid) > 1 else 1, grid[2] if len(grid) > 2 else 1)

    def launch(self, stream: int, *args: Any) -> None:
        enter, exit_ = _launch_hooks()
        gx, gy, gz = self._grid
        metadata = (
            None
            if enter is None
            else self._compiled.launch_metadata(self._grid, stream, *args, *self._tail)
        )
        self._run(gx, gy, gz, stream, self._function, self._packed, metadata, enter, exit_,
                  *args, *self._tail)  # fmt: skip


class FastLaunch:
    """``launch(grid, args, config, interpreted=...)`` == ``kernel[grid](*args, **config.kwargs)``;
    ``args`` are the kernel's runtime parameters in order, the constexprs follow them."""

    def __init__(self, kernel: Any) -> None:
        self.kernel = kernel
        self._compiled: dict[Hashable, Any] = {}

    def launch(
        self, grid: Sequence[int], args: Sequence[Any], kwargs: dict[str, Any], *, interpreted: bool
    ) -> None:
        """``kernel[grid](*args, **kwargs)``, keywords as Triton takes them (``config_of``)."""
        self(grid, args, config_of(kwargs), interpreted=interpreted)

    def prepare(
        self, grid: Sequence[int], args: Sequence[Any], config: LaunchConfig, n_fixed: int
    ) -> PreparedLaunch | None:
        """After a GPU launch of ``args`` under ``config``: a ``PreparedLaunch`` of the same
        compiled kernel whose last ``n_fixed`` runtime arguments are fixed to those of ``args``;
        None where the kernel has no fast path (the JIT fallback)."""
        device = _current_device_and_stream()[0]()
        entry = self._compiled.get((config, device, _specialisation(args)))
        if not entry:
            return None
        return PreparedLaunch(entry, grid, tuple(args[len(args) - n_fixed :]))

    def __call__(
        self, grid: Sequence[int], args: Sequence[Any], config: LaunchConfig, *, interpreted: bool
    ) -> None:
        if interpreted:
            self.kernel[grid](*args, **config.kwargs)
            return
        if traced(args[0]):
            wrap_triton(self.kernel)[tuple(grid)](*args, **config.kwargs)
            return
        current_device, current_stream = _current_device_and_stream()
        device = current_device()
        key = (config, device, _specialisation(args))
        entry = self._compiled.get(key)
        if entry is None:
            compiled = self.kernel[grid](*args, **config.kwargs)
            constexprs = dict(config.constexprs)
            try:  # the launcher API this module relies on (Triton 3.6 .. 3.9)
                tail = tuple(constexprs[name] for name in self.kernel.arg_names[len(args) :])
                entry = (compiled, compiled.run, compiled.function, compiled.packed_metadata, tail)
            except (AttributeError, KeyError):
                entry = False
            self._compiled[key] = entry
            return
        if entry is False:
            self.kernel[grid](*args, **config.kwargs)
            return
        compiled, run, function, packed, tail = entry
        stream = current_stream(device)
        enter, exit_ = _launch_hooks()
        metadata = None if enter is None else compiled.launch_metadata(grid, stream, *args, *tail)
        gx = grid[0]
        gy = grid[1] if len(grid) > 1 else 1
        gz = grid[2] if len(grid) > 2 else 1
        run(gx, gy, gz, stream, function, packed, metadata, enter, exit_,
            *args, *tail)  # fmt: skip
