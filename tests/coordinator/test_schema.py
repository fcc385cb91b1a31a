"""The wire schema's decoding (`schema.py`): a value whose exact type its field's check keeps is
taken without the check, and an object is built without its `__init__` where that changes
nothing. These pin that both shortcuts give exactly what the checks and the constructor give,
and refuse exactly what they refuse."""

from dataclasses import dataclass

import pytest
from dist_quant.coordinator.protocol import (
    MESSAGE_TYPES,
    AckSummary,
    AliveSummary,
    Bundle,
    CancelDecision,
    CancelVote,
    Message,
    ProtocolError,
    SwitchRequest,
    Vote,
    VoteSummary,
    run_messages,
)
from dist_quant.coordinator.schema import decode_fields, decode_run

DIGEST = "cd" * 32

# one message of every class, made by its constructor, with values of every JSON type
MADE = [
    SwitchRequest("r1", {"name": "B"}, None, 60.0),
    SwitchRequest("r2", "current", 120, 5.5),
    Vote(7, 3, True, DIGEST, 17, "", 0.25, 21, {"rule": "x"}),
    Vote(7, 4, False, "", None, "no", 0.5),
    VoteSummary(7, 8, 8, 15, DIGEST, {"rule": "x"}, 17, 21, 0.75),
    AckSummary(7, 8, 8, 15, 40, "B"),
    AliveSummary(7, 8, 8, 15),
    CancelVote(7, 2, True, None, ""),
    CancelDecision(7, False, 40, {3: "passed"}, "rank 3 passed"),
    Bundle.of(8, [AliveSummary(7, 8, 8, 15)]),
]


def test_every_message_class_is_covered_here_or_by_test_protocol():
    from test_protocol import EXAMPLES

    covered = {type(m) for m in MADE + EXAMPLES}
    missing = sorted(kind for kind, cls in MESSAGE_TYPES.items() if cls not in covered)
    # the rest have the same field types as covered ones (ints and strings only)
    assert missing == ["alive", "cancel_prepare", "cancel_request", "decision_query", "mark"]


@pytest.mark.parametrize("made", MADE, ids=lambda m: type(m).__name__)
def test_a_decoded_message_is_the_object_its_constructor_makes(made):
    decoded = Message.from_json(made.to_json())
    assert type(decoded) is type(made)
    assert vars(decoded) == vars(made)  # the same attributes, no more: as `__init__` leaves them
    assert {k: type(v) for k, v in vars(decoded).items()} == {
        k: type(v) for k, v in vars(made).items()
    }
    assert decoded == made
    with pytest.raises(AttributeError):  # still frozen
        decoded.kind_of_change = 1


def test_a_summary_run_decodes_to_as_many_equal_objects_as_its_count():
    same = {f: getattr(MADE[4], f) for f in vars(MADE[4])}
    decoded = decode_run(VoteSummary, {"count": 3, "each": {}, "same": same}, "vote_summary")
    assert decoded == [MADE[4]] * 3
    assert len({id(m) for m in decoded}) == 3


def test_ints_where_floats_are_due_come_out_as_floats_in_either_form():
    """A float field's int is converted by its check: the shortcut never keeps it."""
    fields = {**vars(MADE[4]), "prepare_s": 2}
    one = Message.from_dict({"kind": "vote_summary", **fields})
    (in_run,) = run_messages({"kind": "vote_summary", "count": 1, "each": {}, "same": fields})
    for m in (one, in_run):
        assert m.prepare_s == 2.0 and type(m.prepare_s) is float


def summary_run(**same):
    fields = {**vars(MADE[4]), **same}
    return {"kind": "vote_summary", "count": 1, "each": {}, "same": fields}


@pytest.mark.parametrize(
    "run, fragment",
    [
        (summary_run(first=True), "vote_summary.first: expected int, got True"),
        (summary_run(last=15.0), "vote_summary.last: expected int, got 15.0"),
        (summary_run(digest=None), "vote_summary.digest: expected str, got None"),
        (summary_run(hold_step=21.0), "vote_summary.hold_step: expected int, got 21.0"),
        (summary_run(hold_step=True), "vote_summary.hold_step: expected int, got True"),
        (summary_run(prepare_s="0.2"), "vote_summary.prepare_s: expected float, got '0.2'"),
        (summary_run(part_digests=[]), "vote_summary.part_digests: expected dict"),
        (summary_run(part_digests={"r": 1}), "vote_summary.part_digests[r]: expected str, got 1"),
        (summary_run(evil=1), "vote_summary: unexpected fields ['evil']"),
    ],
)
def test_a_malformed_summary_is_refused_naming_the_field(run, fragment):
    with pytest.raises(ProtocolError) as info:
        run_messages(run)
    assert fragment in str(info.value)
    # the same values as one message are refused the same way
    d = {"kind": "vote_summary", **run["same"]}
    with pytest.raises(ProtocolError) as one:
        Message.from_dict(d)
    assert fragment in str(one.value)


def test_a_summary_missing_a_field_is_refused_naming_the_first_missing_one():
    run = summary_run()
    del run["same"]["digest"], run["same"]["last_step"]
    with pytest.raises(ProtocolError, match="vote_summary: missing field 'digest'"):
        run_messages(run)


@dataclass(frozen=True)
class Checked:
    """A class whose constructor checks more than the types: decoding must run it."""

    count: int

    def __post_init__(self) -> None:
        if self.count < 0:
            raise ValueError(f"count must be >= 0, got {self.count}")


def test_a_class_with_post_init_is_built_by_its_constructor():
    assert decode_fields(Checked, {"count": 2}, "checked") == Checked(2)
    with pytest.raises(ValueError, match="count must be >= 0, got -1"):
        decode_fields(Checked, {"count": -1}, "checked")
    with pytest.raises(ValueError, match="count must be >= 0, got -1"):
        decode_run(Checked, {"count": 2, "each": {}, "same": {"count": -1}}, "checked")
