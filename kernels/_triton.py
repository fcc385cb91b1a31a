"""Triton where it is installed, a stand-in where it is not: the kernels' one import of it.

CUDA builds of torch bring their own Triton; a CPU-only install has none and needs none (every
kernel dispatcher sends CPU tensors to `reference.py`), so the package does not require it (see
pyproject). Every kernel module imports `triton` and `tl` from here. Without Triton they still
import: `@triton.jit` wraps the function in a kernel that refuses to launch, with the reason, and
`tl.constexpr` (the only other name used at import time: annotations and one module constant)
holds its value; `knobs` and `driver` (the fast launch path) and `libdevice` (CUDA's own math
functions, read when a kernel compiles) refuse when read, and `TensorDescriptor` (the attention
launchers' tile descriptors) refuses to be built. Nothing else of
Triton is reached without a CUDA tensor or `TRITON_INTERPRET=1`, both of which need the real
package.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

MISSING = (
    "Triton is not installed: it runs the CUDA kernels (a CUDA build of torch brings it) and the "
    "kernel tests under TRITON_INTERPRET=1 (pip install triton); CPU tensors never need it"
)

try:
    import triton
    import triton.language as tl
    from triton import knobs
    from triton.language.extra import libdevice
    from triton.runtime.driver import driver
    from triton.tools.tensor_descriptor import TensorDescriptor

    HAVE_TRITON = True
except ImportError:
    HAVE_TRITON = False

    class _AbsentKernel:
        """What `@triton.jit` makes without Triton: the function kept, any launch refused."""

        def __init__(self, fn: Callable[..., Any]) -> None:
            self.fn = fn
            self.__name__ = fn.__name__
            self.__doc__ = fn.__doc__

        def __getitem__(self, grid: Any) -> Any:
            raise RuntimeError(f"kernel {self.fn.__name__}: {MISSING}")

        def __call__(self, *args: Any, **kwargs: Any) -> Any:
            raise RuntimeError(f"kernel {self.fn.__name__}: {MISSING}")

    class _Constexpr:
        """`tl.constexpr(value)` keeps `value`; as an annotation it is never instantiated."""

        def __init__(self, value: Any) -> None:
            self.value = value

        def __bool__(self) -> bool:
            return bool(self.value)

    class _Language:
        constexpr = _Constexpr

        def __getattr__(self, name: str) -> Any:
            raise RuntimeError(f"triton.language.{name}: {MISSING}")

    class _Triton:
        language = _Language()

        @staticmethod
        def jit(fn: Callable[..., Any] | None = None, **options: Any) -> Any:
            # `@triton.jit` and `@triton.jit(do_not_specialize=...)` both
            return _AbsentKernel if fn is None else _AbsentKernel(fn)

        def __getattr__(self, name: str) -> Any:
            raise RuntimeError(f"triton.{name}: {MISSING}")

    class _Absent:
        """`knobs` and `driver`: read by the GPU launch path only."""

        def __init__(self, name: str) -> None:
            self._name = name

        def __getattr__(self, attr: str) -> Any:
            raise RuntimeError(f"triton {self._name}.{attr}: {MISSING}")

    class TensorDescriptor:  # type: ignore[no-redef]
        """Built only by a launch, which needs Triton."""

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            raise RuntimeError(f"triton TensorDescriptor: {MISSING}")

    triton = _Triton()  # type: ignore[assignment]
    tl = triton.language  # type: ignore[assignment]
    knobs = _Absent("knobs")  # type: ignore[assignment]
    libdevice = _Absent("libdevice")  # type: ignore[assignment]
    driver = _Absent("driver")  # type: ignore[assignment]


__all__ = [
    "HAVE_TRITON", "MISSING", "TensorDescriptor", "driver", "knobs", "libdevice", "tl", "triton",
]  # fmt: skip
