"""Every module constructor checks its sizes the same way: an int >= 1, never a bool or a float,
and the error names the module and the argument."""

import inspect
import re

import pytest
import torch

import dist_quant as dq

# Each public module with sizes that build it; every `int` argument of its constructor is here.
GOOD_SIZES = {
    dq.Linear: {"in_features": 4, "out_features": 4},
    dq.LayerNormLinear: {"in_features": 4, "out_features": 4},
    dq.LayerNormMLP: {"hidden_size": 4, "ffn_hidden_size": 8},
    dq.GroupedLinear: {"num_gemms": 2, "in_features": 4, "out_features": 4},
    dq.DotProductAttention: {"num_attention_heads": 2, "kv_channels": 4},
    dq.MultiheadAttention: {"hidden_size": 8, "num_attention_heads": 2},
    dq.TransformerLayer: {"hidden_size": 8, "ffn_hidden_size": 16, "num_attention_heads": 2},
}
# bool is an int subclass: True is a bug, not 1; a whole float is not a size either
NOT_SIZES = [True, False, 0, -3, 4.0, "4", None]

CASES = [
    pytest.param(cls, arg, bad, id=f"{cls.__name__}-{arg}-{bad!r}")
    for cls, sizes in GOOD_SIZES.items()
    for arg in sizes
    for bad in NOT_SIZES
]


def test_every_public_module_and_size_argument_is_covered() -> None:
    exported = {
        getattr(dq, name)
        for name in dq.__all__
        if isinstance(getattr(dq, name), type) and issubclass(getattr(dq, name), torch.nn.Module)
    }
    assert exported == set(GOOD_SIZES)
    for cls, sizes in GOOD_SIZES.items():
        int_args = {
            p.name
            for p in inspect.signature(cls.__init__).parameters.values()
            if p.annotation in (int, "int")
        }
        assert int_args == set(sizes), cls.__name__


@pytest.mark.parametrize("cls", list(GOOD_SIZES), ids=lambda c: c.__name__)
def test_good_sizes_build_the_module(cls: type) -> None:
    module = cls(**GOOD_SIZES[cls], name="m")
    for arg, value in GOOD_SIZES[cls].items():
        if hasattr(module, arg):
            assert getattr(module, arg) == value


@pytest.mark.parametrize(("cls", "arg", "bad"), CASES)
def test_a_size_that_is_not_a_positive_int_raises_naming_module_and_argument(
    cls: type, arg: str, bad: object
) -> None:
    sizes = GOOD_SIZES[cls] | {arg: bad}
    message = f"{cls.__name__} 'm': {arg} must be an int >= 1, got {bad!r}"
    with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
        cls(**sizes, name="m")


def test_linear_true_4_is_refused_as_in_features() -> None:
    with pytest.raises(
        ValueError, match=r"^Linear None: in_features must be an int >= 1, got True$"
    ):
        dq.Linear(True, 4)
