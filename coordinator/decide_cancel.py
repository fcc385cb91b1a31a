"""The rules that decide cancelling a committed switch (a second vote over the same ranks): the
pure `decide_cancel()` over the cancel votes, and `settle_cancel()`, what the ranks and the client
hear once logging the outcome failed or ended past the commit window.

Free of threads, clocks and I/O, so each rule is tested as a table (tests/coordinator/
test_decide_cancel.py, test_settle.py); `coordinator_state.py` and `coordinator.py` call them.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from dist_quant.coordinator.protocol import CancelDecision, CancelPrepare, CancelVote


def decide_cancel(
    prepare: CancelPrepare,
    votes: Mapping[int, CancelVote],
    expected_ranks: Sequence[int],
    deadline_passed: bool,
) -> CancelDecision | None:
    """The outcome of cancelling a committed switch; None while votes are still due.

    Cancelled only if every expected rank voted YES before the deadline with a last step before
    the commit step (so none has published, and each holds its publish at that step until it
    hears the outcome). Otherwise the switch stays committed and every rank publishes as planned.
    """
    missing = [r for r in expected_ranks if r not in votes]
    if missing and not deadline_passed:
        return None
    reasons: dict[int, str] = {
        r: f"no cancel vote before the deadline ({prepare.timeout_s:g} s)" for r in missing
    }
    for r in expected_ranks:
        vote = votes.get(r)
        if vote is None:
            continue
        if not vote.yes:
            reasons[r] = vote.reason or "voted no"
        elif vote.last_step is not None and vote.last_step >= prepare.step:
            reasons[r] = f"already passed step {vote.last_step}, at or after step {prepare.step}"
    if reasons:
        summary = "not cancelled: " + "; ".join(f"rank {r}: {reasons[r]}" for r in sorted(reasons))
        return CancelDecision(
            prepare.switch_id, False, prepare.step, dict(sorted(reasons.items())), summary
        )
    return CancelDecision(
        prepare.switch_id, True, prepare.step, {}, f"cancelled before step {prepare.step}"
    )


def settle_cancel(
    outcome: CancelDecision,
    *,
    log_error: str | None,
    logged_late_s: float,
    commit_window_s: float,
) -> CancelDecision:
    """The cancel outcome the ranks and the client hear, given how logging `outcome` went: the
    same two rules as `settle_decision` keep the switch committed (a rank may already have stopped
    holding its publish at the commit step). Returns `outcome` itself when neither applies."""
    if log_error is not None:
        summary = f"not cancelled: {log_error}"
        return CancelDecision(outcome.switch_id, False, outcome.step, {}, summary)
    if outcome.cancelled and logged_late_s > commit_window_s:
        summary = f"not cancelled: the cancel was logged {logged_late_s:.2f} s after its deadline"
        return CancelDecision(outcome.switch_id, False, outcome.step, {}, summary)
    return outcome
