"""Kernel tests that run Triton (its interpreter on CPU) need the package; a CPU install without
it (Triton is not a dependency there, see pyproject) leaves them out and says so in the header.
The reference paths and everything else still run: see test_without_triton.py."""

import importlib.util

NEEDS_TRITON = [
    "compile_attention_targets.py",
    "compile_targets.py",
    "test_block_gemm.py",
    "test_encode_targets.py",
    "test_fast_launch.py",
    "test_fp8_stats.py",
    "test_swiglu.py",
    "test_swiglu_cast.py",
    "test_triton_block_scaled.py",
    "test_triton_cast.py",
    "test_triton_current.py",
    "test_triton_delayed_update.py",
    "test_triton_dequantize.py",
    "test_triton_gpu.py",
    "test_attention_targets.py",
    "test_triton_attention.py",
    "test_triton_gpu_attention.py",
]

HAVE_TRITON = importlib.util.find_spec("triton") is not None
collect_ignore = [] if HAVE_TRITON else NEEDS_TRITON


def pytest_report_header(config):
    if not HAVE_TRITON:
        return f"triton is not installed: tests/kernels leaves out {', '.join(NEEDS_TRITON)}"
    return None
