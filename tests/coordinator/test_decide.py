"""`decide()` as a table: vote sets -> outcome (commit step, or the ranks that block the switch)."""

import pytest
from dist_quant.coordinator.decide import decide
from dist_quant.coordinator.protocol import Prepare, Vote
from dist_quant.coordinator.tally import Tally
from dist_quant.coordinator.timing import PACE_STEPS, hold_step, lead_time, pace

RANKS = (0, 1, 2, 3)
TP = ((0, 1), (2, 3))


def yes(rank, step, digest="d", hold=None):
    """A YES vote after `step`, holding at `hold` (default: the next boundary, as with no lead)."""
    return Vote(7, rank, True, digest, step, "", 0.01, step + 1 if hold is None else hold)


def no(rank, reason="boom"):
    return Vote(7, rank, False, "", 3, reason, 0.01)


def votes(*vs):
    return {v.rank: v for v in vs}


def tally(by_rank, expected):
    """The votes as the coordinator counts them, for ranks 0..len(expected)-1."""
    t = Tally(len(expected))
    for rank, vote in by_rank.items():
        t.add(rank, vote)
    return t


# (name, votes, at_step, deadline_passed, expected): expected is None (still open),
# ("commit", step) or ("abort", {rank: substring of its reason}).
CASES = [
    (
        "all yes -> one past the largest step",
        votes(*(yes(r, 10 + r) for r in RANKS)),
        None,
        False,
        ("commit", 14),
    ),
    ("all yes, equal steps", votes(*(yes(r, 5) for r in RANKS)), None, False, ("commit", 6)),
    ("requested step in the future", votes(*(yes(r, 5) for r in RANKS)), 40, False, ("commit", 40)),
    (
        "requested step just after the largest",
        votes(*(yes(r, 5) for r in RANKS)),
        6,
        False,
        ("commit", 6),
    ),
    (
        "requested step already passed by one rank",
        votes(yes(0, 5), yes(1, 5), yes(2, 9), yes(3, 5)),
        9,
        False,
        ("abort", {2: "already passed step 9"}),
    ),
    (
        "one missing before the deadline -> still open",
        votes(yes(0, 1), yes(1, 1), yes(2, 1)),
        None,
        False,
        None,
    ),
    (
        "one missing at the deadline",
        votes(yes(0, 1), yes(1, 1), yes(2, 1)),
        None,
        True,
        ("abort", {3: "no vote before the deadline"}),
    ),
    ("nobody voted at the deadline", {}, None, True, ("abort", {r: "no vote" for r in RANKS})),
    ("a NO waits for the others before deciding", votes(no(3)), None, False, None),
    (
        "one NO",
        votes(yes(0, 1), yes(1, 1), yes(2, 1), no(3, "factory raised")),
        None,
        False,
        ("abort", {3: "factory raised"}),
    ),
    (
        "every rank NO",
        votes(*(no(r, f"bad {r}") for r in RANKS)),
        None,
        False,
        ("abort", {r: f"bad {r}" for r in RANKS}),
    ),
    (
        "digests differ across TP groups (allowed)",
        votes(yes(0, 1, "a"), yes(1, 1, "a"), yes(2, 1, "b"), yes(3, 1, "b")),
        None,
        False,
        ("commit", 2),
    ),
    (
        "digests differ inside a TP group of two: no majority, both named",
        votes(yes(0, 1), yes(1, 1), yes(2, 1, "x"), yes(3, 1, "y")),
        None,
        False,
        ("abort", {2: "no majority", 3: "no majority"}),
    ),
    (
        "a vote from an unexpected rank is ignored",
        votes(*(yes(r, 1) for r in RANKS), yes(9, 50)),
        None,
        False,
        ("commit", 2),
    ),
]


@pytest.mark.parametrize("name,vs,at_step,passed,expected", CASES, ids=[c[0] for c in CASES])
def test_decide_table(name, vs, at_step, passed, expected):
    d = decide(Prepare(7, {"name": "B"}, at_step, 2.5), tally(vs, RANKS), TP, passed)
    if expected is None:
        assert d is None
        return
    assert d is not None and d.switch_id == 7
    outcome, detail = expected
    if outcome == "commit":
        assert (d.commit, d.step, d.reasons) == (True, detail, {})
    else:
        assert d.commit is False and d.step is None
        assert set(d.reasons) == set(detail)
        for rank, text in detail.items():
            assert text in d.reasons[rank], d.reasons
            assert f"rank {rank}: " in d.summary


def test_majority_digest_names_only_the_odd_rank():
    groups = ((0, 1, 2),)
    vs = votes(yes(0, 4, "good"), yes(1, 4, "good"), yes(2, 4, "odd"))
    d = decide(Prepare(7, "b", None, 1.0), tally(vs, (0, 1, 2)), groups, False)
    assert d.commit is False
    assert list(d.reasons) == [2]
    assert "differs from TP group [0, 1, 2] majority good" in d.reasons[2]


def test_a_digest_mismatch_names_the_policy_rules_that_answer_the_ranks_differently():
    def ruled(rank, digest, parts):
        return Vote(7, rank, True, digest, 4, "", 0.01, 5, parts)

    same = {"default": "d0", "edges": "e0"}
    vs = votes(
        ruled(0, "good", {**same, "attention": "a0"}),
        ruled(1, "good", {**same, "attention": "a0"}),
        ruled(2, "odd", {**same, "attention": "a1"}),
        ruled(3, "x", {"default": "d0", "edges": "e1", "attention": "a0"}),
        ruled(4, "y", {"default": "d0", "edges": "e0", "attention": "a0"}),
    )
    d = decide(Prepare(7, "b", None, 1.0), tally(vs, range(5)), ((0, 1, 2), (3, 4)), False)
    assert d.commit is False
    assert d.reasons[2].endswith("; the rules answering differently: 'attention'")
    assert "majority good" in d.reasons[2] and 0 not in d.reasons
    for rank in (3, 4):  # no majority in a group of two: both named, with the rule
        assert d.reasons[rank].endswith("; the rules answering differently: 'edges'")


def test_rank_that_voted_no_does_not_count_toward_its_group_majority():
    groups = ((0, 1, 2),)
    vs = votes(yes(0, 4, "good"), no(1), yes(2, 4, "good"))
    d = decide(Prepare(7, "b", None, 1.0), tally(vs, (0, 1, 2)), groups, False)
    assert d.reasons == {1: "boom"}


# (name, last step, seconds per step, lead_s, at_step, hold step): a rank holds `lead_s` ahead
# of its vote at its own pace; worked out by hand: last + 1 + floor(lead / step_s)
HOLD_CASES = [
    ("no lead: the next boundary", 10, 0.1, 0.0, None, 11),
    ("0.5 s ahead at 0.1 s per step", 10, 0.1, 0.5, None, 16),
    ("a partial step does not count", 10, 0.1, 0.55, None, 16),
    ("a lead shorter than a step: the next boundary", 10, 0.1, 0.05, None, 11),
    ("a faster pace books further", 10, 0.05, 0.5, None, 21),
    ("a pace not measured yet adds no steps", 10, 0.0, 1.0, None, 11),
    ("a requested step is kept as it is", 10, 0.1, 0.5, 12, 12),
    ("a tiny step is capped", 10, 1e-9, 1.0, None, 10_011),
]


@pytest.mark.parametrize(
    "last, step_s, lead_s, at_step, hold", [c[1:] for c in HOLD_CASES],
    ids=[c[0] for c in HOLD_CASES],
)  # fmt: skip
def test_a_rank_holds_lead_seconds_ahead_of_its_vote_at_its_own_pace(
    last, step_s, lead_s, at_step, hold
):
    assert hold_step(last, step_s, lead_s, at_step) == hold


def test_the_commit_step_is_the_latest_hold_step_of_the_votes():
    vs = votes(yes(0, 10, hold=15), yes(1, 10, hold=21), yes(2, 12, hold=13), yes(3, 9, hold=21))
    d = decide(Prepare(7, "b", None, 2.5, 0.5), tally(vs, RANKS), TP, False)
    assert (d.commit, d.step) == (True, 21)


@pytest.mark.parametrize("hold", [None, 9, 10])
def test_a_yes_vote_whose_hold_step_is_not_ahead_aborts_naming_the_rank(hold):
    vs = votes(yes(0, 10), yes(1, 10), Vote(7, 2, True, "d", 10, "", 0.01, hold), yes(3, 10))
    d = decide(Prepare(7, "b", None, 2.5, 0.5), tally(vs, RANKS), TP, False)
    assert (d.commit, d.reasons) == (False, {2: f"hold step {hold} not past last step 10"})


@pytest.mark.parametrize(
    "world, latency, lead",
    [
        (4, None, 0.05 + 4 * 100e-6),
        (16384, None, 0.05 + 16384 * 100e-6),
        (4, 0.01, 0.05),  # twice the last latency, but never under the minimum
        (4, 0.2, 0.4),
        (16384, 0.2, 0.4),  # measured beats estimated
        (4, 30.0, 10.0),  # capped
    ],
)
def test_lead_time_is_twice_the_last_switch_latency_or_an_estimate_by_ranks(world, latency, lead):
    assert lead_time(world, latency) == pytest.approx(lead, rel=1e-12)


# (name, a rank's step intervals, oldest first, the pace its vote reports): worked out by hand
PACE_CASES = [
    ("no interval yet: unknown", [], 0.0),
    ("one interval", [0.25], 0.25),
    ("a steady pace", [0.125] * 5, 0.125),
    ("one slow step (a checkpoint) is not the pace", [0.125] * 4 + [2.0], 0.125),
    ("nor its catch-up after it", [0.125] * 4 + [2.0, 0.01], 0.125),
    ("an even count: the mean of the middle two", [0.125, 0.25, 0.5, 1.0], 0.375),
    ("a job that slowed for good follows within half a window", [0.125] * 4 + [0.5] * 5, 0.5),
    ("only the last PACE_STEPS count", [9.0] * 10 + [0.25] * PACE_STEPS, 0.25),
]


@pytest.mark.parametrize("intervals, step_s", [c[1:] for c in PACE_CASES],
                         ids=[c[0] for c in PACE_CASES])  # fmt: skip
def test_a_ranks_pace_is_the_median_of_its_last_steps(intervals, step_s):
    assert pace(intervals) == step_s
