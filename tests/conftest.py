"""Test-wide setup: Triton runs in its interpreter on CPU-only machines, and GPU tests skip there."""

import os

import torch

if not torch.cuda.is_available():
    # Must be set before any @triton.jit function is decorated, i.e. before dist_quant is imported.
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

from dist_quant import amax  # noqa: E402
from dist_quant.kinds import Direction  # noqa: E402


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


@pytest.fixture
def backward_reductions(monkeypatch):
    """The (direction, group) of every backward amax reduction the test runs: the backward
    region's `amax.reduce_and_update`, spied on, which reduces over no group (the tests pass plain
    objects as groups to see which one a backward picks)."""
    reductions = []
    real = amax.reduce_and_update

    def spy(groups, group, *, direction=Direction.FORWARD):
        reductions.append((direction, group))
        real(groups, None, direction=direction)

    monkeypatch.setattr(amax, "reduce_and_update", spy)
    return reductions
