"""A backward run by the calling thread trains exactly as one run by the engine's device thread.

`torch.autograd.set_multithreading_enabled(False)` around `backward()` makes the autograd engine run
a CUDA backward on the thread that called it instead of handing it to its per-device worker
thread; the docs recommend it for host-bound eager FP8 steps. Nothing dist-quant does in a
backward may depend on the thread: the gradient casts, the enrolment of delayed-scaling groups and
the engine's final callback that reduces their amaxes and updates the backward scales must all
run, in the same order, either way, and so must the recompute of an activation-checkpointed block
(`dq.activation_checkpoint`, reentrant or not), which runs inside the backward. Two copies of one
model train side by side, one per setting;
after every step their losses, gradients, parameters and scaling buffers must be equal, and the
backward scales must have moved (the final callback ran). On a CPU the engine always uses the
calling thread, so there the test checks that the flag changes nothing; the CUDA case compares the
two threads.
"""

from __future__ import annotations

import copy

import pytest
import torch
from model_state import scaling_buffers

import dist_quant as dq

STEPS = 4
SEQ, BATCH, HIDDEN = 32, 2, 64

DEVICES = [
    pytest.param("cpu", id="cpu"),
    pytest.param("cuda", id="cuda", marks=pytest.mark.gpu),
]


class _Model(torch.nn.Module):
    def __init__(self, device: str, checkpointing: str) -> None:
        super().__init__()
        self.block = dq.TransformerLayer(
            HIDDEN, 2 * HIDDEN, 4, params_dtype=torch.bfloat16, device=device
        )
        self.head = dq.Linear(HIDDEN, HIDDEN, params_dtype=torch.bfloat16, device=device)
        self.checkpointing = checkpointing

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.checkpointing == "none":
            return self.head(self.block(x))
        reentrant = self.checkpointing == "reentrant"
        return self.head(dq.activation_checkpoint(self.block, x, use_reentrant=reentrant))


def _models(
    device: str, recipe: str, checkpointing: str
) -> tuple[torch.nn.Module, torch.nn.Module]:
    torch.manual_seed(0)
    model = _Model(device, checkpointing)
    twin = copy.deepcopy(model)
    for m in (model, twin):
        dq.apply_recipe(m, dq.recipe_from_dict(recipe))
    return model, twin


def _step(model: torch.nn.Module, x: torch.Tensor, *, on_caller: bool) -> torch.Tensor:
    model.zero_grad(set_to_none=True)
    with dq.autocast():
        loss = model(x).float().square().mean()
    with torch.autograd.set_multithreading_enabled(not on_caller):
        loss.backward()
    with torch.no_grad():
        for p in model.parameters():
            p -= 0.1 * p.grad
    return loss.detach()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("recipe", ["delayed", "current"])
@pytest.mark.parametrize("checkpointing", ["none", "non-reentrant", "reentrant"])
def test_backward_on_calling_thread_trains_like_the_device_thread(
    device: str, recipe: str, checkpointing: str
) -> None:
    engine_thread, caller = _models(device, recipe, checkpointing)
    backward_scales = {k: v for k, v in scaling_buffers(caller).items() if ".backward." in k}
    for step in range(STEPS):
        g = torch.Generator(device=device).manual_seed(step)
        # requires grad: a reentrant checkpoint passes gradients to the block's weights only then
        x = torch.randn(SEQ, BATCH, HIDDEN, device=device, dtype=torch.bfloat16, generator=g)
        x.requires_grad_()
        loss_e = _step(engine_thread, x, on_caller=False)
        loss_c = _step(caller, x, on_caller=True)
        assert torch.equal(loss_e, loss_c), f"step {step}: loss {loss_e} != {loss_c}"
        for (name, p_e), p_c in zip(engine_thread.named_parameters(), caller.parameters()):
            assert torch.equal(p_e.grad, p_c.grad), f"step {step}: {name}.grad differs"
            assert torch.equal(p_e, p_c), f"step {step}: {name} differs"
        b_e, b_c = scaling_buffers(engine_thread), scaling_buffers(caller)
        assert b_e.keys() == b_c.keys()
        for name in b_e:
            assert torch.equal(b_e[name], b_c[name]), f"step {step}: {name} differs"
    if recipe == "delayed":
        after = scaling_buffers(caller)
        assert backward_scales, "delayed scaling has backward scaling buffers"
        moved = [k for k, v in backward_scales.items() if not torch.equal(v, after[k])]
        assert moved, "the backward's final callback never updated a backward scale"
