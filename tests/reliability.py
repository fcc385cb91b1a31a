"""The reliability tally: what the bad-input and fault suites tried, and what they found.

`tests/fuzz` and `tests/faults` register this plugin from their conftests (once per session, by
name). It counts, for the test items under those two folders only:

- scenarios run and passed: every test item is one scenario (a hypothesis test is one scenario
  however many cases it draws); an item pinned `xfail(strict=True)` that fails as expected pins a
  known bug and is counted apart (one that passes is a failure: run, not passed); a setup error
  counts as run and not passed;
- fuzz cases: every call of a hypothesis test's body (generation, shrinking and replay alike), by
  wrapping `test.hypothesis.inner_test`, the hook hypothesis documents for plugins;
- states checked and states found corrupted: every comparison of a model's state against what
  it must be after a case (a snapshot taken before a refused change, a twin model, a value
  re-derived in the test) goes through `check_state`, which records it and fails the test on a
  difference.

At the end of the session the terminal summary prints one line to paste into the README, e.g.
`reliability: 42 scenarios run, 42 passed; 1830 fuzz cases; 0 states corrupted (312 checked)`
(plus `; N strict xfails pin known bugs` when there are such tests).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

PLUGIN_NAME = "dist_quant.reliability"
_SUITES = tuple(Path(__file__).resolve().parent / name for name in ("fuzz", "faults"))


@dataclass
class Tally:
    scenarios_run: int = 0
    scenarios_passed: int = 0
    known_bugs: int = 0
    fuzz_cases: int = 0
    states_checked: int = 0
    states_corrupted: int = 0

    def line(self) -> str:
        text = (
            f"reliability: {self.scenarios_run} scenarios run, {self.scenarios_passed} passed; "
            f"{self.fuzz_cases} fuzz cases; {self.states_corrupted} states corrupted "
            f"({self.states_checked} checked)"
        )
        if self.known_bugs:
            text += f"; {self.known_bugs} strict xfails pin known bugs"
        return text


TALLY = Tally()


def check_state(ok: bool, what: str) -> None:
    """Record one state comparison; fail the running test when the state is not what it must be."""
    TALLY.states_checked += 1
    if not ok:
        TALLY.states_corrupted += 1
        pytest.fail(f"state corrupted: {what}", pytrace=False)


def _in_suites(path: Path) -> bool:
    resolved = path.resolve()
    return any(resolved.is_relative_to(root) for root in _SUITES)


def _counting(inner: Any) -> Any:
    @functools.wraps(inner)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        TALLY.fuzz_cases += 1
        return inner(*args, **kwargs)

    return wrapper


class ReliabilityPlugin:
    """The pytest hooks; one instance per session (see `register`)."""

    def __init__(self) -> None:
        self._wrapped: set[int] = set()
        self._ours: set[str] = set()  # node ids of the items under tests/fuzz and tests/faults

    @pytest.hookimpl(trylast=True)
    def pytest_collection_modifyitems(self, items: list[pytest.Item]) -> None:
        for item in items:
            if not _in_suites(item.path):
                continue
            self._ours.add(item.nodeid)
            test = getattr(item, "obj", None)
            handle = getattr(test, "hypothesis", None)
            if handle is None or id(test) in self._wrapped:
                continue
            # parametrized items share one function object: wrap its inner test once
            self._wrapped.add(id(test))
            handle.inner_test = _counting(handle.inner_test)

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        if report.nodeid not in self._ours:
            return
        if report.when == "setup" and report.failed:
            TALLY.scenarios_run += 1
        elif report.when == "call":
            if hasattr(report, "wasxfail") and report.skipped:
                TALLY.known_bugs += 1
                return
            TALLY.scenarios_run += 1
            if report.passed:
                TALLY.scenarios_passed += 1

    def pytest_terminal_summary(self, terminalreporter: Any) -> None:
        if TALLY.scenarios_run or TALLY.known_bugs:
            terminalreporter.write_line(TALLY.line())


def register(config: pytest.Config) -> None:
    """Called from each suite's `pytest_configure`; registers the plugin once per session."""
    if config.pluginmanager.get_plugin(PLUGIN_NAME) is None:
        config.pluginmanager.register(ReliabilityPlugin(), PLUGIN_NAME)
