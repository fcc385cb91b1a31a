"""Test-wide setup: Triton runs in its interpreter on CPU-only machines, and GPU tests skip there."""

import os

import torch

if not torch.cuda.is_available():
    # Must be set before any @triton.jit function is decorated, i.e. before dist_quant is imported.
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    skip_gpu = pytest.mark.skip(reason="needs a CUDA device")
    try:
        import ray  # noqa: F401

        has_ray = True
    except ImportError:
        has_ray = False
    skip_ray = pytest.mark.skip(reason="needs Ray (pip install 'dist-quant[ray]')")
    for item in items:
        if "gpu" in item.keywords and not torch.cuda.is_available():
            item.add_marker(skip_gpu)
        if "ray" in item.keywords and not has_ray:
            item.add_marker(skip_ray)


@pytest.fixture
def fresh_dynamo():
    """Dynamo's caches emptied before and after the test: compile tests build new module
    instances of the same classes, which without a reset pile up in one code object's cache and
    reach dynamo's recompile limit."""
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()
