"""Inputs and a bitwise comparison shared by the Triton kernel tests (test_triton_*.py).

``assert_bitwise_equal`` is the whole contract: same dtype and shape, same strides wherever a stride
matters (dims of size > 1 in a non-empty tensor, as torch's own layout checks count them), and the
same bits in every element. The only freedom is the bits of a NaN (sign and payload): torch's own
CPU cast turns one NaN into 0x7F or 0xFF depending on input dtype and vector width, and GPU
arithmetic canonicalises NaN payloads, so NaN positions are compared instead.
"""

from __future__ import annotations

import numpy as np
import torch

FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
# Ragged shapes: rows/cols that are no multiple of any block size, 1D, 3D, one row, empty.
RAGGED_SHAPES = [(5, 123), (3, 7, 33), (130, 200), (1, 77), (77,), (0, 5), (4, 0)]

_INT_VIEW = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _significant_strides(t: torch.Tensor) -> tuple[tuple[int, int], ...]:
    if t.numel() == 0:
        return ()
    return tuple((d, s) for d, (n, s) in enumerate(zip(t.shape, t.stride())) if n > 1)


def assert_bitwise_equal(actual: torch.Tensor, expected: torch.Tensor, what: str = "") -> None:
    """Equal dtype, shape, significant strides and bits; NaN positions instead of NaN bits."""
    assert actual.dtype == expected.dtype, f"{what}: dtype {actual.dtype} != {expected.dtype}"
    assert actual.shape == expected.shape, f"{what}: shape {actual.shape} != {expected.shape}"
    assert _significant_strides(actual) == _significant_strides(expected), (
        f"{what}: strides {actual.stride()} != {expected.stride()}"
    )
    a, e = actual.detach().cpu(), expected.detach().cpu()
    if a.dtype.is_floating_point:
        a_nan, e_nan = torch.isnan(a.float()), torch.isnan(e.float())
        assert torch.equal(a_nan, e_nan), f"{what}: NaN positions differ"
        ints = _INT_VIEW[a.element_size()]
        a_bits, e_bits = a.view(ints)[~a_nan], e.view(ints)[~e_nan]
    else:
        a_bits, e_bits = a, e
    if not torch.equal(a_bits, e_bits):
        bad = (a_bits != e_bits).nonzero()[:5].flatten().tolist()
        raise AssertionError(
            f"{what}: {(a_bits != e_bits).sum().item()} elements differ, first at {bad}: "
            f"{a_bits.flatten()[bad].tolist()} != {e_bits.flatten()[bad].tolist()}"
        )


def fp8_grid_values(fp8_dtype: torch.dtype) -> torch.Tensor:
    """fp32 values that pin the rounding: every FP8 code point, every midpoint between neighbours
    (exact in fp32) with its two fp32 neighbours, values past max, fp32 subnormals and specials."""
    codes = torch.arange(256, dtype=torch.uint8).view(fp8_dtype).float().numpy()
    finite = np.unique(codes[np.isfinite(codes)].astype(np.float64))  # sorted, +-0 merged
    mids = ((finite[:-1] + finite[1:]) / 2).astype(np.float32)
    up = np.nextafter(mids, np.float32(np.inf))
    down = np.nextafter(mids, np.float32(-np.inf))
    fmax = np.float32(finite[-1])
    edges = np.array(
        [0.0, -0.0, np.inf, -np.inf, np.nan, fmax * 1.0625, -fmax * 1.5, 3.0e38, -3.4e38,
         1e-45, -1e-45, 1e-40, 2.0**-126, np.nextafter(fmax, np.float32(np.inf))],
        dtype=np.float32,
    )  # fmt: skip
    return torch.from_numpy(np.concatenate([codes, mids, up, down, edges]).astype(np.float32))


def random_values(shape: tuple[int, ...], dtype: torch.dtype, seed: int) -> torch.Tensor:
    """Normal values spread over 2**-40..2**40 (FP8 subnormals, normals and saturation all hit)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g)
    x *= torch.exp2(torch.randint(-40, 41, shape, generator=g).float())
    return x.to(dtype)


def with_specials(x: torch.Tensor) -> torch.Tensor:
    """``x`` with a NaN, +-inf and -0 planted (a copy; inputs with < 8 elements stay as they are)."""
    x = x.clone()
    flat = x.view(-1)
    if flat.numel() >= 8:
        flat[1], flat[-2], flat[flat.numel() // 2], flat[3] = (
            float("nan"), float("inf"), -float("inf"), -0.0,
        )  # fmt: skip
    return x


# The kernels run where a GPU is (compiled), else on the CPU under TRITON_INTERPRET=1 (conftest);
# the reference always runs on the CPU: it is the definition (torch's CUDA division by a Python
# scalar multiplies by a reciprocal, so the reference itself is not bit-stable on CUDA).
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def on_device(*tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Copies on the kernel device (a copy even on the CPU, so a kernel cannot alias the input)."""
    return tuple(t.to(DEVICE, copy=True) for t in tensors)
