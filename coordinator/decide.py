"""The rules that decide a switch: the pure `decide()` over the votes, and `settle_decision()`,
what the ranks and the client hear once logging the outcome failed or ended past the commit
window. `decide_cancel.py` holds the same two rules for a cancel's second vote.

Free of threads, clocks and I/O, so each rule is tested as a table (tests/coordinator/
test_decide.py, test_settle.py); `coordinator_state.py` and `coordinator.py` call them.
"""

from __future__ import annotations

import itertools
from collections import Counter
from collections.abc import Mapping, Sequence

from dist_quant.coordinator.protocol import Decision, Prepare, Vote, VoteSummary
from dist_quant.coordinator.tally import Tally


def decide(
    prepare: Prepare,
    votes: Tally[Vote],
    tp_groups: Sequence[Sequence[int]],
    deadline_passed: bool,
) -> Decision | None:
    """The outcome of one switch from the votes so far (every rank of the tally's world is
    expected); None while it is still open.

    The switch stays open until every expected rank voted or the deadline passed. It commits only
    if every expected rank voted YES, digests agree within each tensor-parallel group, and (with a
    requested `at_step`) no rank has already passed that step. The commit step is the requested
    one, else the largest hold step the votes carry (each rank's own, `timing.hold_step`): no
    rank passes its hold step undecided, so every rank can still reach the commit step. A YES
    vote whose hold step is not past its last step would break that and is refused. A node's
    `VoteSummary` stands for its ranks' YES votes, with the largest of their hold steps. A commit
    costs O(votes taken in one by one + summaries); ranks are listed one by one only to abort.
    """
    missing = votes.missing()
    if missing and not deadline_passed:
        return None
    reasons: dict[int, str] = {
        r: f"no vote before the deadline ({prepare.timeout_s:g} s)" for r in missing
    }
    held = prepare.at_step is None  # else every hold is the requested step, checked below
    for r, vote in votes.by_rank.items():
        if not vote.yes:
            reasons[r] = vote.reason or "voted no"
        elif held and not _holds_ahead(vote.last_step, vote.hold_step):
            reasons[r] = f"hold step {vote.hold_step} not past last step {vote.last_step}"
    summaries: list[VoteSummary] = []
    for first, last, s in votes.ranges:
        if held and not _holds_ahead(s.last_step, s.hold_step):
            why = f"hold step {s.hold_step} not past last step {s.last_step} (node summary)"
            reasons.update(dict.fromkeys(range(first, last + 1), why))
        else:
            summaries.append(s)
    yes = {r: v for r, v in votes.by_rank.items() if r not in reasons}
    if len({v.digest for v in yes.values()} | {s.digest for s in summaries}) > 1:
        # digests differ somewhere: each TP group is looked at, rank by rank
        digest_of: dict[int, Vote | VoteSummary] = dict(yes)
        for s in summaries:
            digest_of.update(dict.fromkeys(range(s.first, s.last + 1), s))
        for group in tp_groups:
            reasons.update(_digest_mismatches(group, digest_of, reasons))
    if prepare.at_step is not None:
        passed_at = [(r, v.last_step) for r, v in yes.items()]
        for s in summaries:
            if s.last_step >= prepare.at_step:
                passed_at += [(r, s.last_step) for r in range(s.first, s.last + 1)]
        for r, last in passed_at:
            if r not in reasons and last is not None and last >= prepare.at_step:
                reasons[r] = (
                    f"already passed step {last}, at or after the requested step {prepare.at_step}"
                )
    if reasons:
        summary = "; ".join(f"rank {r}: {reasons[r]}" for r in sorted(reasons))
        return Decision(prepare.switch_id, False, None, dict(sorted(reasons.items())), summary)
    if prepare.at_step is not None:
        step = prepare.at_step
    else:
        step = max(v.hold_step or 0 for v in itertools.chain(yes.values(), summaries))
    return Decision(prepare.switch_id, True, step, {}, f"commit at step {step}")


def _holds_ahead(last_step: int | None, hold: int | None) -> bool:
    """A YES vote's hold step is a boundary the rank has not passed yet."""
    return hold is not None and (last_step is None or hold > last_step)


def _digest_mismatches(
    group: Sequence[int], votes: Mapping[int, Vote | VoteSummary], reasons: Mapping[int, str]
) -> dict[int, str]:
    """Ranks of a TP group whose YES digest differs from the group's strict majority, each with
    the plan parts (policy rules) that answer it differently."""
    if len({votes[r].digest for r in group if r in votes and r not in reasons}) <= 1:
        return {}  # the common case, checked without building the group's votes
    yes = {r: votes[r] for r in group if r in votes and r not in reasons}
    top, count = Counter(v.digest for v in yes.values()).most_common(1)[0]
    members = sorted(group)
    if count * 2 > len(yes):
        majority = next(v for v in yes.values() if v.digest == top)
        return {
            r: f"plan digest {v.digest[:12]} differs from TP group {members} majority {top[:12]}"
            + _differing_parts([v, majority])
            for r, v in yes.items()
            if v.digest != top
        }
    return {
        r: f"plan digests disagree within TP group {members} with no majority (this rank: "
        f"{v.digest[:12]})" + _differing_parts(list(yes.values()))
        for r, v in yes.items()
    }


def _differing_parts(votes: Sequence[Vote | VoteSummary]) -> str:
    """The named parts (policy rules) whose digests are not the same in all of `votes`."""
    names = sorted({name for v in votes for name in v.part_digests})
    differ = [n for n in names if len({v.part_digests.get(n) for v in votes}) > 1]
    if not differ:
        return ""
    return f"; the rules answering differently: {', '.join(map(repr, differ))}"


def settle_decision(
    decision: Decision, *, log_error: str | None, logged_late_s: float, commit_window_s: float
) -> Decision:
    """The decision the ranks and the client hear, given how logging `decision` went.

    Two rules turn it into ABORT: the log could not record it (`log_error`; no rank may publish
    without a recorded decision), or a COMMIT was recorded `logged_late_s` after the vote deadline,
    more than `commit_window_s` (a rank may already have stopped waiting and kept its recipe).
    Returns `decision` itself when neither applies.
    """
    if log_error is not None:
        return Decision(decision.switch_id, False, None, dict(decision.reasons), log_error)
    if decision.commit and logged_late_s > commit_window_s:
        summary = (
            f"COMMIT was logged {logged_late_s:.2f} s after the vote deadline; aborted instead"
        )
        return Decision(decision.switch_id, False, None, {}, summary)
    return decision
