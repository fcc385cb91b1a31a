"""What a dq forward saves for its backward goes through `ctx.save_for_backward`.

Saved-tensor hooks (what non-reentrant checkpointing and CPU offload intercept) must see every
tensor a dq GEMM keeps: its quantized input and weight, each FP8 copy with its scales. The expected
saves are derived from the shapes alone (each recipe's storage layout, written out below), never
from the code under test. Under `dq.activation_checkpoint` nothing of the block stays saved but the
checkpoint's own input.
"""

from __future__ import annotations

import math

import pytest
import torch
from module_ref import DEVICE

import dist_quant as dq

M, H, FFN, HEADS = 32, 64, 128, 2
E4M3, F32, U8 = torch.float8_e4m3fn, torch.float32, torch.uint8


@dq.quantizer_factory(key="test-saved-identity")
def identity_factory(role):
    return dq.IdentityQuantizer()


@dq.quantizer_factory(key="test-saved-identity-input")
def identity_input_factory(role):
    # high-precision GEMM inputs with current-scaling weights and gradients: the dq GEMM runs
    # and saves its input as the plain tensor
    if role is not None and role.tensor_type == "input":
        return dq.IdentityQuantizer()
    return dq.Float8CurrentScalingQuantizer(torch.float8_e4m3fn)


RECIPES = {
    "identity": dq.CustomRecipe(identity_factory),
    "identity_input": dq.CustomRecipe(identity_input_factory),
    "delayed": dq.DelayedScaling(amax_history_len=4),
    "current": dq.Float8CurrentScaling(),
    "mxfp8": dq.MXFP8BlockScaling(),
    "block": dq.Float8BlockScaling(),
}


def _input_saves(recipe: str, rows: int, cols: int) -> list:
    """The (shape, dtype) saves of a GEMM input (rows, cols): the wgrad operand x^T alone."""
    if recipe == "identity":  # all high precision: torch's F.linear saves x itself
        return [((rows, cols), F32)]
    if recipe == "identity_input":  # a dq GEMM with a high-precision input: the view x^T
        return [((cols, rows), F32)]
    if recipe in ("delayed", "current"):  # the transposed bytes and one fp32 scale inverse
        return [((cols, rows), E4M3), ((1,), F32)]
    if recipe == "mxfp8":  # one E8M0 byte per 32 elements along the copy's last dim
        return [((cols, rows), E4M3), ((cols, math.ceil(rows / 32)), U8)]
    # 1x128 tiles: one fp32 scale per 128 elements along the copy's last dim
    return [((cols, rows), E4M3), ((cols, math.ceil(rows / 128)), F32)]


def _weight_saves(recipe: str, rows: int, cols: int) -> list:
    """The (shape, dtype) saves of a weight (rows, cols) quantized with both usages."""
    if recipe == "identity":  # all high precision: torch's F.linear saves the view W^T
        return [((cols, rows), F32)]
    data, data_t = ((rows, cols), E4M3), ((cols, rows), E4M3)
    if recipe in ("delayed", "current"):  # the dgrad operand W^T alone and its scale inverse
        return [data_t, ((1,), F32)]
    if recipe == "identity_input":  # the transpose comes from the cast
        return [data, ((1,), F32), data_t]
    if recipe == "mxfp8":
        return [
            data,
            ((rows, math.ceil(cols / 32)), U8),
            data_t,
            ((cols, math.ceil(rows / 32)), U8),
        ]
    # 128x128 blocks: the rowwise copy and its tile grid; the transpose is rebuilt on use
    return [data, ((math.ceil(rows / 128), math.ceil(cols / 128)), F32)]


def _saved(fn) -> tuple[torch.Tensor, list]:
    """`fn()` and the (shape, dtype) of every tensor it saved for backward, sorted."""
    seen = []

    def pack(t):
        seen.append((tuple(t.shape), t.dtype))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    return out, sorted(seen, key=repr)


def _sorted(entries: list) -> list:
    return sorted(entries, key=repr)


def _input() -> torch.Tensor:
    torch.manual_seed(0)
    return torch.randn(M, H, device=DEVICE, requires_grad=True)


@pytest.mark.parametrize("recipe", RECIPES)
def test_linear_saves_its_quantized_input_and_weight(recipe):
    torch.manual_seed(1)
    layer = dq.Linear(H, FFN, device=DEVICE)
    dq.apply_recipe(layer, RECIPES[recipe])
    with dq.autocast():
        _, seen = _saved(lambda: layer(_input()))
    expected = _input_saves(recipe, M, H) + _weight_saves(recipe, FFN, H)
    assert seen == _sorted(expected)


@pytest.mark.parametrize("recipe", RECIPES)
def test_layernorm_mlp_saves_fp8_gemm_inputs_and_high_precision_norm_and_activation(recipe):
    torch.manual_seed(1)
    mlp = dq.LayerNormMLP(H, FFN, device=DEVICE)
    dq.apply_recipe(mlp, RECIPES[recipe])
    with dq.autocast():
        _, seen = _saved(lambda: mlp(_input()))
    # F.layer_norm: input, weight, bias, mean, rstd; tanh GELU: its fp32 input
    torch_saves = [((M, H), F32), ((H,), F32), ((H,), F32), ((M, 1), F32), ((M, 1), F32)]
    torch_saves.append(((M, FFN), F32))
    gemms = _input_saves(recipe, M, H) + _weight_saves(recipe, FFN, H)
    gemms += _input_saves(recipe, M, FFN) + _weight_saves(recipe, H, FFN)
    assert seen == _sorted(torch_saves + gemms)


def _modules():
    return {
        "linear": lambda: dq.Linear(H, H, device=DEVICE),
        "layernorm_mlp": lambda: dq.LayerNormMLP(H, FFN, device=DEVICE),
        "transformer_layer": lambda: dq.TransformerLayer(H, FFN, HEADS, device=DEVICE),
    }


@pytest.mark.parametrize("module", _modules())
@pytest.mark.parametrize("recipe", RECIPES)
def test_non_reentrant_checkpoint_keeps_only_the_block_input(module, recipe):
    torch.manual_seed(1)
    block = _modules()[module]()
    dq.apply_recipe(block, RECIPES[recipe])
    x = _input().reshape(M // 4, 4, H).detach().requires_grad_()  # (seq, batch, hidden)
    with dq.autocast():
        y, seen = _saved(lambda: dq.activation_checkpoint(block, x, use_reentrant=False))
        _, plain_seen = _saved(lambda: block(x))
    # torch 2.11's non-reentrant checkpoint saves a 0-element dummy of its own (2.13 does not):
    # nothing of the block's GEMMs, which is what this pins, holds a byte
    seen = [(shape, dtype) for shape, dtype in seen if math.prod(shape) > 0]
    assert seen == [((M // 4, 4, H), F32)]
    fp8_bytes = sum(math.prod(s) for s, dt in plain_seen if dt == E4M3)
    assert (fp8_bytes > 0) == (recipe != "identity")  # the plain run does keep the FP8 operands
    y.backward(torch.ones_like(y))  # the recompute rebuilds every GEMM's saved operands


@pytest.mark.parametrize("recipe", RECIPES)
def test_backward_reads_the_saved_operands_through_the_unpack_hook(recipe):
    # an offload-style pair: pack hands the hook a copy and the backward gets only that copy back;
    # the gradients must be bit-identical to the plain run's
    def grads(hooked: bool) -> list:
        torch.manual_seed(1)
        mlp = dq.LayerNormMLP(H, FFN, device=DEVICE)
        dq.apply_recipe(mlp, RECIPES[recipe])
        x = _input()
        store: list = []

        def pack(t):
            store.append(t.detach().clone())
            return len(store) - 1

        with dq.autocast():
            if hooked:
                with torch.autograd.graph.saved_tensors_hooks(pack, store.__getitem__):
                    y = mlp(x)
            else:
                y = mlp(x)
        y.backward(torch.cos(y.detach()))
        assert (len(store) > 0) == hooked
        return [x.grad] + [p.grad for p in mlp.parameters()]

    for got, want in zip(grads(True), grads(False), strict=True):
        assert torch.equal(got, want)


@pytest.mark.parametrize("recipe", ["delayed", "mxfp8", "block"])
def test_linear_keeps_only_the_operands_its_gradients_need(recipe):
    torch.manual_seed(1)
    layer = dq.Linear(H, FFN, bias=False, device=DEVICE)
    dq.apply_recipe(layer, RECIPES[recipe])
    with dq.autocast():
        layer.weight.requires_grad_(False)  # no wgrad: the input is not kept
        _, frozen = _saved(lambda: layer(_input()))
        layer.weight.requires_grad_(True)
        _, no_dx = _saved(lambda: layer(_input().detach()))  # no dgrad: the weight is not kept
    assert frozen == _sorted(_weight_saves(recipe, FFN, H))
    assert no_dx == _sorted(_input_saves(recipe, M, H))
