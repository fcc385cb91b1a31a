"""QuantizerRole and DelayedScalingRequest: frozen, hashable, readable, validated."""

import dataclasses

import pytest

from dist_quant.formats import Format
from dist_quant.roles import DelayedScalingRequest, QuantizerRequest, QuantizerRole


def test_role_str_reads_module_tensor_and_name():
    assert str(QuantizerRole("linear", "input", "layers.0.fc1")) == "linear/input@layers.0.fc1"
    assert str(QuantizerRole("dpa", "s")) == "dpa/s"
    assert str(QuantizerRole(tensor_type="weight", name="proj")) == "?/weight@proj"
    assert str(QuantizerRole()) == "<no role>"


def test_roles_are_hashable_and_equal_by_value():
    a = QuantizerRole("linear", "weight", "layers.1.fc2")
    b = QuantizerRole("linear", "weight", "layers.1.fc2")
    c = QuantizerRole("linear", "weight", "layers.2.fc2")
    assert a == b and hash(a) == hash(b)
    assert a != c
    assert {a: 1, c: 2}[b] == 1


def test_role_is_frozen():
    role = QuantizerRole("linear", "input", "fc")
    with pytest.raises(dataclasses.FrozenInstanceError):
        role.name = "other"  # type: ignore[misc]


@pytest.mark.parametrize("field", ["module_type", "tensor_type", "name"])
def test_role_rejects_non_string_field_by_name(field):
    with pytest.raises(ValueError, match=f"QuantizerRole.{field}"):
        QuantizerRole(**{field: 3})


def test_delayed_request_defaults_follow_the_api():
    req = DelayedScalingRequest()
    assert isinstance(req, QuantizerRequest)
    assert (req.fp8_format, req.margin, req.amax_history_len) == (Format.HYBRID, 0, 1024)
    assert (req.amax_compute_algo, req.reduce_amax) == ("max", True)
    assert hash(req) == hash(DelayedScalingRequest())


def test_delayed_request_accepts_e5m2_and_callable_algo():
    def newest(history):
        return history[0]

    req = DelayedScalingRequest(fp8_format=Format.E5M2, amax_compute_algo=newest)
    assert req.fp8_format is Format.E5M2 and req.amax_compute_algo is newest


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"fp8_format": "HYBRID"}, "fp8_format"),
        ({"margin": -1}, "margin"),
        ({"margin": 1.5}, "margin"),
        ({"margin": True}, "margin"),
        ({"amax_history_len": 0}, "amax_history_len"),
        ({"amax_compute_algo": "mean"}, "amax_compute_algo"),
        ({"reduce_amax": 1}, "reduce_amax"),
    ],
)
def test_delayed_request_validation_names_the_field(kwargs, field):
    with pytest.raises(ValueError, match=f"DelayedScalingRequest.{field}"):
        DelayedScalingRequest(**kwargs)
