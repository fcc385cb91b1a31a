"""Fault scenarios: the reliability tally (`tests/reliability.py`) and the multi-rank harness
(`tests/distributed/harness.py`) on the import path."""

import sys
from pathlib import Path

_TESTS = Path(__file__).resolve().parents[1]
for _path in (_TESTS, _TESTS / "distributed"):
    if str(_path) not in sys.path:
        sys.path.insert(0, str(_path))

import reliability  # noqa: E402


def pytest_configure(config):
    reliability.register(config)
