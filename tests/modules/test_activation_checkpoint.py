"""Activation checkpointing: every way of checkpointing a dq block reproduces the plain run bit for bit.

The reference is the same model run without checkpointing: outputs, input and parameter gradients
and the whole state dict (weights after the optimizer step, delayed-scaling scales and amax history
in the modules' extra state) must be identical after every step, over steps that switch the recipe
with `apply_recipe` in between, with the backward outside `autocast`. Plain torch checkpoint must
refuse wherever its recompute would quantize, and stay exact where nothing is quantized.
"""

from __future__ import annotations

import functools

import pytest
import torch
from module_ref import DEVICE
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.utils.checkpoint import (
    CheckpointPolicy,
    checkpoint,
    create_selective_checkpoint_contexts,
)

import dist_quant as dq
from dist_quant.recipes import Format

S, B, HIDDEN, FFN, HEADS = 8, 4, 32, 64, 2


@dq.quantizer_factory(key="test-ckpt-identity")
def identity_factory(role):
    return dq.IdentityQuantizer()


@dq.quantizer_factory(key="test-ckpt-mixed")
def mixed_factory(role):
    # delayed scaling for weights, current scaling for activations and gradients
    if role is None:  # a role-less slot (a grad-input): current scaling, as for activations
        return dq.Float8CurrentScalingQuantizer(torch.float8_e4m3fn)
    if role.tensor_type == "weight":
        return dq.DelayedScalingRequest(fp8_format=Format.E4M3, amax_history_len=4)
    dtype = torch.float8_e5m2 if role.tensor_type.startswith("grad") else torch.float8_e4m3fn
    return dq.Float8CurrentScalingQuantizer(dtype)


RECIPES = {
    "identity": dq.CustomRecipe(identity_factory),
    "delayed": dq.DelayedScaling(amax_history_len=4, fp8_format=Format.HYBRID),
    "current": dq.Float8CurrentScaling(),
    "mxfp8": dq.MXFP8BlockScaling(),
    "block": dq.Float8BlockScaling(),
    "custom": dq.CustomRecipe(mixed_factory),
    "delayed_dpa": dq.DelayedScaling(amax_history_len=4, fp8_dpa=True),
    "current_dpa": dq.Float8CurrentScaling(fp8_dpa=True),
}
# each recipe runs two steps, then the next one two more: every recipe is both switched from and to
SWITCHES = [
    ("identity", "delayed"),
    ("delayed", "current"),
    ("current", "mxfp8"),
    ("mxfp8", "block"),
    ("block", "custom"),
    ("custom", "delayed"),
]


def _sac_policy(ctx, op, *args, **kwargs):
    # keep the matmuls' outputs, recompute everything else
    if op in (torch.ops.aten.mm.default, torch.ops.aten.addmm.default):
        return CheckpointPolicy.MUST_SAVE
    return CheckpointPolicy.PREFER_RECOMPUTE


def _sac_context():
    return create_selective_checkpoint_contexts(_sac_policy)


def _checkpoint_fns():
    return {
        "none": lambda layer, x: layer(x),
        "reentrant": lambda layer, x: dq.activation_checkpoint(layer, x, use_reentrant=True),
        "non_reentrant": lambda layer, x: dq.activation_checkpoint(layer, x, use_reentrant=False),
        "sac": lambda layer, x: dq.activation_checkpoint(
            layer, x, use_reentrant=False, context_fn=_sac_context
        ),
    }


class Stack(nn.Module):
    def __init__(self, wrap: str = "none", wrapper: bool = False, gqa: bool = False) -> None:
        super().__init__()
        torch.manual_seed(0)
        # gqa: 4 query heads sharing 2 KV heads
        heads = {"num_attention_heads": 4, "num_gqa_groups": 2} if gqa else {}
        self.layers = nn.ModuleList(
            dq.TransformerLayer(
                HIDDEN, FFN, **{"num_attention_heads": HEADS, **heads}, device=DEVICE
            )
            for _ in range(2)
        )
        if wrapper:
            # torch's wrapper, told to checkpoint with dist-quant's function
            fn = functools.partial(dq.activation_checkpoint, use_reentrant=False)
            self.layers = nn.ModuleList(
                checkpoint_wrapper(m, checkpoint_fn=fn) for m in self.layers
            )
        self.run = _checkpoint_fns()[wrap]

    def forward(self, x):
        for layer in self.layers:
            x = self.run(layer, x)
        return x


def _train(model: nn.Module, recipes: list[str], autocast_enabled: bool = True) -> list:
    """Two steps per recipe (SGD), backward outside autocast; every step's results."""
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    results = []
    step = 0
    for name in recipes:
        dq.apply_recipe(model, RECIPES[name])
        for _ in range(2):
            torch.manual_seed(100 + step)
            x = torch.randn(S, B, HIDDEN, device=DEVICE, requires_grad=True)
            dy = torch.randn(S, B, HIDDEN, device=DEVICE)
            opt.zero_grad(set_to_none=True)
            with dq.autocast(enabled=autocast_enabled):
                y = model(x)
            y.backward(dy)  # outside autocast
            grads = [x.grad] + [p.grad for p in model.parameters()]
            opt.step()
            results.append((y.detach(), grads, _flat_state(model.state_dict())))
            step += 1
    return results


def _flat_state(obj, prefix=""):
    """Every tensor of a state dict (extra states are nested dicts), by path, cloned."""
    out = {}
    if isinstance(obj, torch.Tensor):
        out[prefix] = obj.detach().clone()
    elif isinstance(obj, dict):
        for k, v in obj.items():
            out.update(_flat_state(v, f"{prefix}.{k}" if prefix else str(k)))
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            out.update(_flat_state(v, f"{prefix}.{i}"))
    return out


def _strip_wrapper(key: str) -> str:
    return key.replace("._checkpoint_wrapped_module", "")


def _assert_identical(got, want):
    assert len(got) == len(want)
    for step, ((y, grads, state), (y_ref, grads_ref, state_ref)) in enumerate(zip(got, want)):
        assert torch.equal(y, y_ref), f"step {step}: output differs"
        for i, (g, g_ref) in enumerate(zip(grads, grads_ref)):
            assert torch.equal(g, g_ref), f"step {step}: gradient {i} differs"
        state = {_strip_wrapper(k): v for k, v in state.items()}
        assert state.keys() == state_ref.keys()
        for k in state_ref:
            assert torch.equal(state[k], state_ref[k]), f"step {step}: state {k} differs"


@functools.cache
def _reference(first: str, second: str):
    return _train(Stack("none"), [first, second])


@pytest.mark.parametrize("first,second", SWITCHES)
@pytest.mark.parametrize("mode", ["reentrant", "non_reentrant", "sac", "wrapper"])
def test_activation_checkpoint_matches_plain_run_bit_for_bit(first, second, mode):
    model = Stack("none", wrapper=True) if mode == "wrapper" else Stack(mode)
    _assert_identical(_train(model, [first, second]), _reference(first, second))


@pytest.mark.parametrize("mode", ["reentrant", "non_reentrant"])
def test_gqa_layers_with_fp8_attention_recompute_bit_for_bit(mode):
    """The recompute rounds k and v at KV-head shape with the forward's scales, as the forward
    did, across a switch from delayed to current scaling with FP8 attention."""
    recipes = ["delayed_dpa", "current_dpa"]
    got = _train(Stack(mode, gqa=True), recipes)
    want = _train(Stack("none", gqa=True), recipes)
    _assert_identical(got, want)


def test_the_reference_run_quantizes_and_moves_delayed_state():
    # guards the test above against comparing two high-precision runs or a frozen state
    fp8 = _reference("delayed", "current")
    hp = _train(Stack("none"), ["delayed", "current"], autocast_enabled=False)
    assert not torch.equal(fp8[0][0], hp[0][0])
    scales = [v for k, v in fp8[0][2].items() if k.endswith("scale")]
    later = [v for k, v in fp8[1][2].items() if k.endswith("scale")]
    assert scales and any(not torch.equal(a, b) for a, b in zip(scales, later))


@pytest.mark.parametrize("use_reentrant", [True, False])
@pytest.mark.parametrize("recipe", ["delayed", "current", "mxfp8", "block", "custom"])
def test_plain_torch_checkpoint_refuses_a_quantized_recompute(recipe, use_reentrant):
    model = Stack("none")
    model.run = lambda layer, x: checkpoint(layer, x, use_reentrant=use_reentrant)
    dq.apply_recipe(model, RECIPES[recipe])
    x = torch.randn(S, B, HIDDEN, device=DEVICE, requires_grad=True)
    with dq.autocast():
        y = model(x)
    with pytest.raises(dq.RecomputeError, match=r"layers\.1\..*dist_quant\.activation_checkpoint"):
        y.sum().backward()


@pytest.mark.parametrize("use_reentrant", [True, False])
def test_plain_torch_checkpoint_refuses_recomputing_an_fp8_forward_inside_autocast(use_reentrant):
    model = Stack("none")
    model.run = lambda layer, x: checkpoint(layer, x, use_reentrant=use_reentrant)
    dq.apply_recipe(model, RECIPES["current"])
    x = torch.randn(S, B, HIDDEN, device=DEVICE, requires_grad=True)
    with dq.autocast():
        y = model(x)
        with pytest.raises(dq.RecomputeError, match="activation_checkpoint"):
            y.sum().backward()


@pytest.mark.parametrize("use_reentrant", [True, False])
@pytest.mark.parametrize("enabled,recipe", [(False, "delayed"), (True, "identity")])
def test_plain_torch_checkpoint_stays_exact_where_nothing_is_quantized(
    use_reentrant, enabled, recipe
):
    model = Stack("none")
    model.run = lambda layer, x: checkpoint(layer, x, use_reentrant=use_reentrant)
    got = _train(model, [recipe], autocast_enabled=enabled)
    want = _train(Stack("none"), [recipe], autocast_enabled=enabled)
    _assert_identical(got, want)


def test_a_recompute_taking_another_path_is_refused():
    model = Stack("none")
    dq.apply_recipe(model, RECIPES["current"])
    calls = []

    def block(x):
        calls.append(1)
        # the recompute skips the first layer: it no longer matches the recorded forward
        if len(calls) == 1:
            x = model.layers[0](x)
        return model.layers[1](x)

    x = torch.randn(S, B, HIDDEN, device=DEVICE, requires_grad=True)
    with dq.autocast():
        y = dq.activation_checkpoint(block, x, use_reentrant=True)
    with pytest.raises(dq.RecomputeError, match="the same path"):
        y.sum().backward()


def test_nested_activation_checkpoint_is_refused():
    model = Stack("none")
    x = torch.randn(S, B, HIDDEN, device=DEVICE, requires_grad=True)

    def outer(x):
        return dq.activation_checkpoint(model.layers[0], x)

    with pytest.raises(dq.RecomputeError, match="cannot nest"):
        dq.activation_checkpoint(outer, x)


def test_activation_checkpoint_rejects_bad_arguments():
    with pytest.raises(ValueError, match="fn must be callable"):
        dq.activation_checkpoint(3, torch.ones(1))
    with pytest.raises(ValueError, match="use_reentrant must be a bool"):
        dq.activation_checkpoint(lambda t: t, torch.ones(1), use_reentrant=None)
