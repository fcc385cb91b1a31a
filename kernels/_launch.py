"""Launching a Triton kernel without the JIT's per-call work, once it is compiled.

``kernel[grid](*args, **constexprs)`` binds and specialises every argument, builds a cache key,
checks the kernel's globals and canonicalises the grid on every call: ~20-40 us of host time for
the many-argument cast kernels, more than the GPU spends on a TP-shard-sized cast. A
``FastLaunch`` keys its own cache on what Triton specialises on (each tensor's dtype and 16-byte
alignment; each integer's ``== 1``, divisibility by 16 and width; the constexprs), lets the JIT
compile and launch the first call of a key, and launches later calls of the key through the
compiled kernel's launcher, as the JIT itself does after its bookkeeping.

Only compiled GPU kernels take the fast path: under ``TRITON_INTERPRET=1`` (the CPU tests) every
call goes through the JIT, and so does any Triton whose compiled kernel lacks the launcher this
relies on (checked once per key, falling back to the JIT path for good).
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from typing import Any

import torch
from triton import knobs
from triton.runtime.driver import driver

_INT32 = (-(2**31), 2**31)


def _arg_key(arg: Any) -> Hashable:
    if isinstance(arg, torch.Tensor):
        return (arg.dtype, arg.data_ptr() % 16 == 0)
    if isinstance(arg, bool):
        return ("b", arg)
    if isinstance(arg, int):
        return ("i", arg == 1, arg % 16 == 0, _INT32[0] <= arg < _INT32[1], arg < 2**63)
    if isinstance(arg, float):
        return "f"
    return ("v", arg)  # None and anything else: by value, as the JIT treats it as a constant


class FastLaunch:
    """``launch(grid, args, constexprs, options)`` == ``kernel[grid](*args, **constexprs,
    **options)``; ``args`` are the kernel's runtime parameters in order, ``constexprs`` every
    ``tl.constexpr`` parameter by name, ``options`` launch options such as ``num_warps``."""

    def __init__(self, kernel: Any) -> None:
        self.kernel = kernel
        self._compiled: dict[Hashable, Any] = {}

    def __call__(
        self,
        grid: Sequence[int],
        args: Sequence[Any],
        constexprs: dict[str, Any],
        options: dict[str, Any],
        *,
        interpreted: bool,
    ) -> None:
        if interpreted:
            self.kernel[grid](*args, **constexprs, **options)
            return
        device = driver.active.get_current_device()
        key = (
            tuple(_arg_key(a) for a in args),
            tuple(constexprs.items()),
            tuple(options.items()),
            device,
        )
        entry = self._compiled.get(key)
        if entry is None:
            compiled = self.kernel[grid](*args, **constexprs, **options)
            names = self.kernel.arg_names[len(args) :]
            try:  # the launcher API this module relies on (Triton 3.6 .. 3.9)
                tail = tuple(constexprs[name] for name in names)
                entry = (compiled, compiled.run, compiled.function, compiled.packed_metadata, tail)
            except (AttributeError, KeyError):
                entry = False
            self._compiled[key] = entry
            return
        if entry is False:
            self.kernel[grid](*args, **constexprs, **options)
            return
        compiled, run, function, packed, tail = entry
        stream = driver.active.get_current_stream(device)
        enter = knobs.runtime.launch_enter_hook
        metadata = None if enter is None else compiled.launch_metadata(grid, stream, *args, *tail)
        gx = grid[0]
        gy = grid[1] if len(grid) > 1 else 1
        gz = grid[2] if len(grid) > 2 else 1
        run(gx, gy, gz, stream, function, packed, metadata, enter,
            knobs.runtime.launch_exit_hook, *args, *tail)  # fmt: skip
