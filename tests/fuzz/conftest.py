"""Hypothesis profiles for the fuzz suites, and the reliability tally (`tests/reliability.py`).

Profiles, selected by `DIST_QUANT_FUZZ_PROFILE` (default "ci") for the tests of this folder only:
- "ci": few examples per test, derandomized (the same cases on every run, so CI is reproducible
  and the tally's figures are stable), no example database written into the checkout;
- "slow": 20x the examples, random seeds, the database kept in `.hypothesis/` so a failure
  found once is replayed first next time.
Tests scale their own budget from the profile with `fuzz_budget(n)` (tests/fuzz/fuzz_models.py),
so a test that asks for 10 cases under "ci" gets 200 under "slow".
Neither profile has a deadline: CPU emulation of FP8 and a loaded CI machine make per-case
timing meaningless.
"""

import sys
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, settings

_TESTS = Path(__file__).resolve().parents[1]
for _path in (_TESTS, _TESTS / "distributed"):  # reliability.py; harness.py (empty TP shards)
    if str(_path) not in sys.path:
        sys.path.insert(0, str(_path))

import reliability  # noqa: E402

_COMMON = {
    "deadline": None,
    "suppress_health_check": [HealthCheck.too_slow, HealthCheck.data_too_large],
    "print_blob": True,
}
settings.register_profile("ci", max_examples=10, derandomize=True, database=None, **_COMMON)
settings.register_profile("slow", max_examples=200, **_COMMON)
# Not `settings.load_profile`: that would change every other hypothesis test in the session (they
# keep hypothesis' defaults); each fuzz test takes the selected profile through `fuzz_budget`.


def pytest_configure(config):
    reliability.register(config)


@pytest.fixture(autouse=True)
def _one_intra_op_thread():
    """The fuzz models are tiny: on a shared 2-core CI machine intra-op threads only add
    synchronisation (a step takes ~6x longer with 2 threads under load). Restored afterwards."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
