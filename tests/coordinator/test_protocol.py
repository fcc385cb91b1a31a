"""Messages round-trip through JSON and the wire seal; malformed or unsealed ones are refused."""

import hashlib
import hmac
import json

import pytest
from dist_quant.coordinator.phases import TRANSITIONS, Phase
from dist_quant.coordinator.protocol import (
    Ack,
    Decision,
    Hello,
    Message,
    Prepare,
    ProtocolError,
    Reply,
    StatusQuery,
    Stop,
    SwitchRequest,
    Vote,
)
from dist_quant.coordinator.results import SwitchResult
from dist_quant.coordinator.wire import seal, unseal

EXAMPLES = [
    SwitchRequest("r1", {"type": "Float8CurrentScaling", "fp8_format": "HYBRID"}, None, 60.0),
    SwitchRequest("r2", "current", 120, 5.0),
    StatusQuery("r3"),
    Hello(3, "('delayed', 1024)"),
    Prepare(4, {"name": "B"}, None, 1.5),
    Vote(4, 2, True, "abc", 17, "", 0.25, 18),
    Vote(4, 3, False, "", None, "RecipeUpdateError: bad role", 0.5),
    Decision(4, True, 18, {}, "commit at step 18"),
    Decision(4, False, None, {1: "late", 3: "no"}, "rank 1: late; rank 3: no"),
    Ack(4, 2, 18, True, "", "key"),
    Reply("r1", "result", 4, "", {"committed": True}),
    Stop("rank 0"),
]


@pytest.mark.parametrize("msg", EXAMPLES, ids=lambda m: type(m).__name__)
def test_every_message_survives_json_and_the_seal(msg):
    assert Message.from_json(msg.to_json()) == msg
    assert unseal(seal(msg, "tok"), "tok") == msg


def test_decision_reasons_keep_integer_ranks_after_json():
    d = Message.from_json(Decision(1, False, None, {3: "x"}, "s").to_json())
    assert d.reasons == {3: "x"} and isinstance(next(iter(d.reasons)), int)


@pytest.mark.parametrize(
    "payload,fragment",
    [
        ({"kind": "vote", "switch_id": 1}, "missing field"),
        ({"kind": "nope"}, "unknown message kind"),
        ([1, 2], "must be a JSON object"),
        ({"kind": "stop", "target": "x", "evil": 1}, "unexpected fields"),
        ({"kind": "stop", "target": 5}, "stop.target"),
        (
            {
                "kind": "ack",
                "switch_id": True,
                "rank": 0,
                "step": 1,
                "ok": True,
                "error": "",
                "recipe_key": "",
            },
            "ack.switch_id",
        ),
        (
            {
                "kind": "decision",
                "switch_id": 1,
                "commit": False,
                "step": None,
                "reasons": {"x": "y"},
                "summary": "",
            },
            "not an integer",
        ),
    ],
)
def test_malformed_messages_are_refused_with_the_field_named(payload, fragment):
    with pytest.raises(ProtocolError, match=fragment):
        Message.from_json(json.dumps(payload))


def test_a_message_sealed_with_another_token_is_refused_but_readable_for_the_refusal():
    data = seal(SwitchRequest("r9", "current", None, 1.0), "wrong")
    with pytest.raises(ProtocolError, match="wrong token") as info:
        unseal(data, "right")
    assert info.value.unverified.request_id == "r9"


def test_a_tampered_message_is_refused():
    data = seal(Vote(1, 0, True, "d", 3, "", 0.0, 4), "tok")
    assert b'"yes":true' in data
    with pytest.raises(ProtocolError, match="wrong token"):
        unseal(data.replace(b'"yes":true', b'"yes":false'), "tok")


GOOD = seal(Stop("x"), "tok")
MAC = GOOD[8:72]


@pytest.mark.parametrize(
    "data, fragment",
    [
        (b"", "unreadable sealed message"),
        (b"not json", "unreadable sealed message"),
        # the envelope of old: the message quoted as a string, the MAC after it
        (json.dumps({"m": Stop("x").to_json(), "mac": MAC.decode()}).encode(), "unreadable"),
        (GOOD[:40], "unreadable sealed message"),  # cut short
        (GOOD[:72] + b'"m":' + GOOD[78:], "unreadable sealed message"),  # no '","m":' after it
        (b'{"mac":"' + MAC + b'","m":}', "unreadable sealed message"),  # no message
        (b'{"mac":"' + b"\xff" * 64 + b'","m":{"kind":"stop","target":"x"}}', "not hex digits"),
        (b'{"mac":"' + MAC + b'","m":{"kind":"stop",}}', "message is not valid JSON"),
        (b'{"mac":"' + MAC + b'","m":{"kind":"nope"}}', "unknown message kind 'nope'"),
        (b'{"mac":"' + MAC + b'","m":{"kind":"stop","target":"y"}}', "stop message refused: wrong"),
    ],
)
def test_a_malformed_or_unauthentic_envelope_is_refused_saying_why(data, fragment):
    assert unseal(GOOD, "tok") == Stop("x")
    with pytest.raises(ProtocolError, match=fragment):
        unseal(data, "tok")


def test_the_token_never_appears_in_sealed_bytes():
    token = "s3cr3t-token-value"
    assert token.encode() not in seal(SwitchRequest("r", "current", None, 1.0), token)


def test_the_seal_is_the_hmac_sha256_of_the_message_text_under_its_own_token():
    """Each token's keyed HMAC is kept and copied per message: seals under tokens used in turn
    (one longer than SHA-256's 64-byte block, which HMAC hashes first) each match HMAC-SHA256
    computed afresh, and none is accepted under another token."""
    tokens = ["tok", "another", "k" * 100]
    for i in range(6):
        token = tokens[i % 3]
        msg = Vote(4, i, True, "d" * 64, 17, "", 0.25, 18)
        data = seal(msg, token)
        text = msg.to_json().encode()
        assert data == b'{"mac":"%s","m":%s}' % (
            hmac.new(token.encode(), text, hashlib.sha256).hexdigest().encode(),
            text,
        )
        assert unseal(data, token) == msg
        with pytest.raises(ProtocolError, match="wrong token"):
            unseal(data, tokens[(i + 1) % 3])


def test_switch_result_round_trip():
    r = SwitchResult(3, False, None, {2: "late"}, {"votes_s": 1.0}, {0: 0.1}, "rank 2: late")
    assert SwitchResult.from_dict(json.loads(json.dumps(r.to_dict()))) == r


def test_phases_know_which_are_terminal_and_open():
    assert {p for p in Phase if p.terminal} == {Phase.PUBLISHED, Phase.ABORTED, Phase.CANCELLED}
    assert {p for p in Phase if p.open} == {
        Phase.PREPARING,
        Phase.DECIDING,
        Phase.COMMITTED,
        Phase.CANCELLING,
    }
    # A new switch may start only from IDLE or a terminal phase.
    assert {p for p, nxt in TRANSITIONS.items() if Phase.PREPARING in nxt} == {
        Phase.IDLE,
        Phase.PUBLISHED,
        Phase.ABORTED,
        Phase.CANCELLED,
    }


def test_only_a_committed_switch_can_be_cancelled_and_a_cancel_ends_cancelled_or_committed():
    assert {p for p, nxt in TRANSITIONS.items() if Phase.CANCELLING in nxt} == {Phase.COMMITTED}
    assert TRANSITIONS[Phase.CANCELLING] == {Phase.CANCELLED, Phase.COMMITTED}
    # every phase has words for `dist-quant status`, naming the switch and its step
    assert Phase.COMMITTED.describe(3, 50) == "switch 3: committed, ranks publish at step 50"
    assert all(p.describe(1, 2) for p in Phase)
