"""A node leader's Bundle carries its messages as runs (each field once per run of one kind: a
list of every message's value, or one value they all share). Each run decodes to exactly the
messages that `Message.from_dict` makes of them one by one, in order; a malformed run is refused
naming the kind, the field and the position; the coordinator drops a malformed run (or a run of a
kind ranks do not send) and takes the bundle's other runs in."""

import json
import math

import pytest
from dist_quant.coordinator.protocol import (
    Ack,
    Alive,
    Bundle,
    Hello,
    Message,
    ProtocolError,
    StatusQuery,
    SwitchRequest,
    Vote,
    run_messages,
)
from dist_quant.coordinator.wire import seal, unseal
from test_coordinator import Job

DIGEST = "ab" * 32


def vote(rank, **kw):
    fields = dict(switch_id=4, rank=rank, yes=True, digest=DIGEST, last_step=10, reason="")
    fields.update(prepare_s=0.05 + rank / 1000, hold_step=14, part_digests={"rule": "x"})
    fields.update(kw)
    return Vote(**fields)


MIXED = [vote(0), vote(1), Alive(4, 2), vote(2), Ack(3, 1, 9, True, "", "B"), Hello(5, "k")]


def messages_of(bundle):
    return [m for run in bundle.runs for m in run_messages(run)]


def test_a_bundle_gives_back_every_message_in_order_through_the_seal():
    bundle = unseal(seal(Bundle.of(0, MIXED), "tok"), "tok")
    assert messages_of(bundle) == MIXED
    # consecutive messages of one kind share a run: vote vote | alive | vote | ack | hello
    assert [(run["kind"], run["count"]) for run in bundle.runs] == [
        ("vote", 2), ("alive", 1), ("vote", 1), ("ack", 1), ("hello", 1),
    ]  # fmt: skip


def test_a_field_goes_once_only_where_every_message_has_the_same_json_text():
    votes = [vote(0, prepare_s=0.0), vote(1, prepare_s=-0.0), vote(2, prepare_s=0.0)]
    (run,) = json.loads(json.dumps(Bundle.of(0, votes).runs))
    # 0.0 == -0.0, but they are written differently: each vote keeps its own
    assert sorted(run["each"]) == ["prepare_s", "rank"]
    assert run["same"] == {
        "switch_id": 4, "yes": True, "digest": DIGEST, "last_step": 10, "reason": "",
        "hold_step": 14, "part_digests": {"rule": "x"},
    }  # fmt: skip
    decoded = run_messages(run)
    assert [math.copysign(1.0, m.prepare_s) for m in decoded] == [1.0, -1.0, 1.0]
    assert decoded == votes


def test_each_run_decodes_as_its_messages_decode_one_by_one():
    """Values that a message's own check converts (an int where a float is due) come out the
    same from a run, whichever of the two forms carries them."""
    each = {"rank": [0, 1], "prepare_s": [1, 0.5], "hold_step": [12, 14]}
    same = {"switch_id": 4, "yes": True, "digest": "d", "last_step": None, "reason": ""}
    same["part_digests"] = {}
    run = {"kind": "vote", "count": 2, "each": each, "same": same}
    one_by_one = [
        Message.from_dict({"kind": "vote", **same, **{k: v[i] for k, v in each.items()}})
        for i in range(2)
    ]
    decoded = run_messages(run)
    assert decoded == one_by_one
    assert [type(m.prepare_s) for m in decoded] == [float, float]


def ack_run(**change):
    """A run of two acks; `change` replaces (or with None removes) keys of the run, of "each"
    (`each_<field>`) or of "same" (`same_<field>`)."""
    run = {
        "kind": "ack",
        "count": 2,
        "each": {"rank": [0, 1]},
        "same": {"switch_id": 3, "step": 9, "ok": True, "error": "", "recipe_key": "B"},
    }
    for key, value in change.items():
        part, _, name = key.partition("_") if key.startswith(("each_", "same_")) else ("", "", key)
        target = run[part] if part else run
        if value is None:
            target.pop(name)
        else:
            target[name] = value
    return run


@pytest.mark.parametrize(
    "run, fragment",
    [
        ([1, 2], "a bundle's run must be a JSON object, got list"),
        (ack_run(kind="nope"), "unknown message kind 'nope'"),
        (ack_run(kind=None), "unknown message kind None"),
        (ack_run(evil=1), "ack: unexpected keys ['evil'] in a run"),
        (ack_run(count=0), "ack.count: expected the number of messages (1 to 65536), got 0"),
        (ack_run(count=True), "ack.count: expected the number of messages (1 to 65536), got True"),
        (ack_run(count="2"), "ack.count: expected the number of messages (1 to 65536), got '2'"),
        (
            ack_run(count=10**9, each={}, same_rank=0),
            "ack.count: expected the number of messages (1 to 65536), got 1000000000",
        ),
        (ack_run(each=[0, 1]), "ack: a run's 'each' and 'same' must be JSON objects"),
        (ack_run(same=None), "ack: a run's 'each' and 'same' must be JSON objects"),
        (ack_run(each_rank=None), "ack: missing field 'rank'"),
        (ack_run(same_evil=1), "ack: unexpected fields ['evil']"),
        (ack_run(each_step=[9, 9]), "ack.step: both per message and the same for all"),
        (ack_run(each_rank=0), "ack.rank: expected a list of 2 values, got int"),
        (ack_run(each_rank=[0]), "ack.rank: expected a list of 2 values, got 1 values"),
        (ack_run(each_rank=[0, "x"]), "ack.rank[1]: expected int, got 'x'"),
        (ack_run(each_rank=[True, 1]), "ack.rank[0]: expected int, got True"),
        (ack_run(each_rank=[0, 1.0]), "ack.rank[1]: expected int, got 1.0"),
        (ack_run(same_step="9"), "ack.step: expected int, got '9'"),
        (ack_run(same_ok=1), "ack.ok: expected bool, got 1"),
    ],
)
def test_a_malformed_run_is_refused_naming_the_field_and_position(run, fragment):
    with pytest.raises(ProtocolError) as info:
        run_messages(run)
    assert fragment in str(info.value)


def test_a_malformed_vote_value_is_named_wherever_it_sits_in_its_column():
    run = json.loads(json.dumps(Bundle.of(0, [vote(0), vote(1)]).runs[0]))
    run["each"]["prepare_s"][1] = "slow"
    with pytest.raises(ProtocolError, match=r"vote\.prepare_s\[1\]: expected float, got 'slow'"):
        run_messages(run)
    run = json.loads(json.dumps(Bundle.of(0, [vote(0), vote(1)]).runs[0]))
    run["same"]["part_digests"] = {"rule": 5}
    with pytest.raises(ProtocolError, match=r"vote\.part_digests\[rule\]: expected str, got 5"):
        run_messages(run)


@pytest.fixture
def job(tmp_path):
    j = Job(tmp_path, world=4)
    yield j
    j.close()


def test_the_coordinator_drops_a_malformed_run_and_takes_the_bundles_other_runs(job):
    assert job.request("r1").status == "accepted"
    good = Bundle.of(0, [vote(0, switch_id=1), vote(1, switch_id=1)]).runs[0]
    bad = json.loads(json.dumps(Bundle.of(0, [vote(2, switch_id=1)]).runs[0]))
    bad["each"]["rank"] = ["2"]
    last = Bundle.of(0, [vote(3, switch_id=1)]).runs[0]
    job.s.send(Bundle(0, (good, bad, last)))
    job.s.send(StatusQuery("q"))
    assert job.s.recv("reply/q").body["waiting_for"] == [2]


def test_the_coordinator_ignores_a_run_of_a_kind_ranks_never_send(job):
    request = SwitchRequest("smuggled", {"name": "B"}, None, 5.0)
    job.s.send(Bundle.of(0, [request, Hello(1, "key-1")]))
    job.s.send(StatusQuery("q"))
    status = job.s.recv("reply/q").body
    assert status["phase"] == "idle"  # the request inside the bundle opened nothing
    assert status["recipe_keys"] == {"1": "key-1"}  # the hello after it was taken in
