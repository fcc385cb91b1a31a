"""`settle_decision()` / `settle_cancel()` as tables: how logging went -> what ranks and client
hear.

What these catch: a COMMIT announced although the log could not record it (a rank would publish
without a recorded decision), or one recorded after some rank may have given up (it kept its old
recipe while the others switch); the same two rules for a cancel, which then must stay committed.
"""

import pytest
from dist_quant.coordinator.decide import settle_decision
from dist_quant.coordinator.decide_cancel import settle_cancel
from dist_quant.coordinator.protocol import CancelDecision, Decision

COMMIT = Decision(4, True, 12, {}, "commit at step 12")
ABORT = Decision(4, False, None, {1: "factory raised"}, "rank 1: factory raised")
WINDOW = 0.5

# (name, decision, log_error, logged_late_s, expected): expected is "same" (the decision itself)
# or (commit, step, reasons, summary)
DECISION_CASES = [
    ("commit logged in time", COMMIT, None, -3.0, "same"),
    ("commit logged within the window after the deadline", COMMIT, None, WINDOW, "same"),
    (
        "commit logged past the window -> abort",
        COMMIT,
        None,
        WINDOW + 0.01,
        (False, None, {}, "COMMIT was logged 0.51 s after the vote deadline; aborted instead"),
    ),
    (
        "commit the log could not record -> abort with the log's error",
        COMMIT,
        "disk full",
        -3.0,
        (False, None, {}, "disk full"),
    ),
    (
        "commit the log could not record, late too: the log's error wins",
        COMMIT,
        "read-only file system",
        9.0,
        (False, None, {}, "read-only file system"),
    ),
    ("abort logged late stays the same abort", ABORT, None, 9.0, "same"),
    (
        "abort the log could not record keeps each rank's reason",
        ABORT,
        "disk full",
        0.0,
        (False, None, {1: "factory raised"}, "disk full"),
    ),
]


@pytest.mark.parametrize(
    "decision, log_error, late, expected",
    [c[1:] for c in DECISION_CASES],
    ids=[c[0] for c in DECISION_CASES],
)
def test_settle_decision(decision, log_error, late, expected):
    got = settle_decision(decision, log_error=log_error, logged_late_s=late, commit_window_s=WINDOW)
    if expected == "same":
        assert got is decision
        return
    commit, step, reasons, summary = expected
    assert got == Decision(decision.switch_id, commit, step, reasons, summary)


CANCELLED = CancelDecision(4, True, 12, {}, "cancelled before step 12")
KEPT = CancelDecision(
    4, False, 12, {0: "reached step 12"}, "not cancelled: rank 0: reached step 12"
)

CANCEL_CASES = [
    ("cancel logged in time", CANCELLED, None, 0.1, "same"),
    (
        "cancel logged past the window -> stays committed for the same step",
        CANCELLED,
        None,
        2.0,
        (False, "not cancelled: the cancel was logged 2.00 s after its deadline"),
    ),
    (
        "cancel the log could not record -> stays committed",
        CANCELLED,
        "disk full",
        0.0,
        (False, "not cancelled: disk full"),
    ),
    ("a refused cancel logged late is the same refusal", KEPT, None, 5.0, "same"),
    (
        "a refused cancel the log could not record is still refused",
        KEPT,
        "disk full",
        0.0,
        (False, "not cancelled: disk full"),
    ),
]


@pytest.mark.parametrize(
    "outcome, log_error, late, expected",
    [c[1:] for c in CANCEL_CASES],
    ids=[c[0] for c in CANCEL_CASES],
)
def test_settle_cancel(outcome, log_error, late, expected):
    got = settle_cancel(outcome, log_error=log_error, logged_late_s=late, commit_window_s=WINDOW)
    if expected == "same":
        assert got is outcome
        return
    cancelled, summary = expected
    assert got == CancelDecision(outcome.switch_id, cancelled, outcome.step, {}, summary)
