"""`decide_cancel()` as a table: cancel votes -> cancelled, kept (with the blocking ranks), or open."""

import pytest
from dist_quant.coordinator.decide_cancel import decide_cancel
from dist_quant.coordinator.protocol import CancelPrepare, CancelVote

RANKS = (0, 1, 2, 3)
STEP = 50  # the step switch 7 committed for
PREPARE = CancelPrepare(7, STEP, 2.0)


def yes(rank, last):
    return CancelVote(7, rank, True, last, "")


def no(rank, reason):
    return CancelVote(7, rank, False, 49, reason)


def votes(*vs):
    return {v.rank: v for v in vs}


# (name, votes, deadline_passed, expected): None (still open), "cancelled", or
# ("kept", {rank: substring of its reason})
CASES = [
    ("every rank before the step", votes(*(yes(r, 40 + r) for r in RANKS)), False, "cancelled"),
    ("every rank one step before", votes(*(yes(r, STEP - 1) for r in RANKS)), False, "cancelled"),
    ("no rank has stepped yet", votes(*(yes(r, None) for r in RANKS)), False, "cancelled"),
    ("one vote missing, before the deadline", votes(*(yes(r, 1) for r in (0, 1, 2))), False, None),
    (
        "one vote missing at the deadline",
        votes(*(yes(r, 1) for r in (0, 1, 2))),
        True,
        ("kept", {3: "no cancel vote before the deadline"}),
    ),
    (
        "one rank already published",
        votes(yes(0, 45), yes(1, 45), yes(2, 45), no(3, "already published switch 7")),
        False,
        ("kept", {3: "already published switch 7"}),
    ),
    (
        "a YES whose last step is the commit step counts as no",
        votes(yes(0, 45), yes(1, STEP), yes(2, 45), yes(3, 45)),
        False,
        ("kept", {1: f"already passed step {STEP}"}),
    ),
    (
        "votes of ranks not in the job are ignored",
        votes(*(yes(r, 3) for r in (*RANKS, 9))),
        False,
        "cancelled",
    ),
]


@pytest.mark.parametrize(("name", "vs", "passed", "expected"), CASES, ids=[c[0] for c in CASES])
def test_decide_cancel_table(name, vs, passed, expected):
    d = decide_cancel(PREPARE, vs, RANKS, passed)
    if expected is None:
        assert d is None
        return
    assert (d.switch_id, d.step) == (7, STEP)
    if expected == "cancelled":
        assert d.cancelled and d.reasons == {} and d.summary == f"cancelled before step {STEP}"
        return
    _, blocking = expected
    assert not d.cancelled
    assert set(d.reasons) == set(blocking)
    for rank, text in blocking.items():
        assert text in d.reasons[rank]
        assert f"rank {rank}: " in d.summary
