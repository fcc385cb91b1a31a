"""`torch.compile` on CUDA: inductor launches dist-quant's Triton kernels itself, bit for bit.

On CUDA every cast is traced into through its `dist_quant::<op>_triton` registration
(`torch.library.triton_op`), so the compiled graph holds the Triton kernel calls instead of opaque
custom ops. These tests pin both halves of that: the compiled step equals the eager step bit for
bit (outputs, both gradients, the delayed-scaling buffers) for every recipe, and inductor's code
calls the kernels, not the eager launchers. Needs a CUDA GPU with FP8 (sm89+); skipped elsewhere.
"""

from __future__ import annotations

import copy

import pytest
import torch
from model_state import scaling_buffers
from torch._inductor.utils import run_and_get_code
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

import dist_quant as dq

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9),
        reason="needs a CUDA GPU with FP8 (sm89+)",
    ),
    pytest.mark.usefixtures("fresh_dynamo"),
]

RECIPES = ["delayed", "current", "mxfp8", "block"]
# The eager launchers' op names: none of them may remain as a call in inductor's code for the
# recipe's casts (the delayed update runs outside the compiled region, at autocast exit).
OPAQUE_CASTS = ("dist_quant.delayed_cast", "dist_quant.current_scaling_cast", "dist_quant.mxfp8_cast",
                "dist_quant.block_cast", "dist_quant.cast_transpose", "dist_quant.cast_to_fp8")  # fmt: skip
STEPS = 3  # a delayed-scaling scale first depends on an earlier step's amax at step 2


def _linear() -> dq.Linear:
    torch.manual_seed(0)
    return dq.Linear(256, 384, bias=False, params_dtype=torch.bfloat16, device="cuda")


def _input(step: int, tokens: int = 192) -> torch.Tensor:
    g = torch.Generator(device="cuda").manual_seed(100 + step)
    x = torch.randn(tokens, 256, generator=g, device="cuda", dtype=torch.bfloat16) * (1 + step)
    return x.requires_grad_()


def _step(model: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    with dq.autocast():
        y = model(x)
    y.float().square().sum().backward()
    return y.detach()


def _eager_and_compiled(recipe: str, **compile_kwargs) -> tuple[dq.Linear, dq.Linear, object]:
    """Two identical Linears under `recipe`, and the second compiled (inductor, fullgraph)."""
    eager = _linear()
    compiled_src = copy.deepcopy(eager)
    for m in (eager, compiled_src):
        dq.apply_recipe(m, dq.recipe_from_dict(recipe))
    return eager, compiled_src, torch.compile(compiled_src, fullgraph=True, **compile_kwargs)


def _assert_same_step(eager: dq.Linear, compiled_src: dq.Linear, compiled, x_e, x_c, what: str):
    """One step of each model on equal inputs: outputs, both gradients and every scaling buffer
    equal bit for bit."""
    y_e, y_c = _step(eager, x_e), _step(compiled, x_c).clone()
    assert torch.equal(y_e, y_c), f"{what}: outputs differ"
    assert torch.equal(x_e.grad, x_c.grad), f"{what}: input gradients differ"
    assert torch.equal(eager.weight.grad, compiled_src.weight.grad), f"{what}: dW differs"
    buf_e, buf_c = scaling_buffers(eager), scaling_buffers(compiled_src)
    assert buf_e.keys() == buf_c.keys()
    for name in buf_e:
        assert torch.equal(buf_e[name], buf_c[name]), f"{what}: {name} differs"


@pytest.mark.parametrize("recipe", RECIPES)
def test_inductor_step_on_cuda_matches_eager_bit_for_bit(recipe: str) -> None:
    eager, compiled_src, compiled = _eager_and_compiled(recipe)
    for step in range(STEPS):
        _assert_same_step(eager, compiled_src, compiled, _input(step), _input(step), f"step {step}")


@pytest.mark.parametrize("recipe", RECIPES)
def test_inductor_calls_the_cast_kernels_itself(recipe: str) -> None:
    model = _linear()
    dq.apply_recipe(model, dq.recipe_from_dict(recipe))
    compiled = torch.compile(model, backend="inductor", fullgraph=True)
    _, code = run_and_get_code(lambda: _step(compiled, _input(0)))
    text = "\n".join(code)
    left = [name for name in OPAQUE_CASTS if name in text]
    assert not left, f"{recipe}: inductor still calls the eager launchers {left}"
    kernel = {"delayed": "_cast_transpose_kernel", "current": "_amax_partials_kernel",
              "mxfp8": "_mxfp8_rowwise_kernel", "block": "_block_cast_kernel"}[recipe]  # fmt: skip
    assert kernel in text, f"{recipe}: {kernel} is not launched by inductor's code"


@pytest.mark.parametrize("recipe", ["delayed", "current"])
def test_inductor_step_with_dynamic_shapes_matches_eager_bit_for_bit(recipe: str) -> None:
    # symbolic sizes keep the casts opaque ops (their launchers size grids in plain Python)
    eager, compiled_src, compiled = _eager_and_compiled(recipe, dynamic=True)
    for step, tokens in enumerate((192, 80, 320)):
        x_e, x_c = _input(step, tokens), _input(step, tokens)
        _assert_same_step(eager, compiled_src, compiled, x_e, x_c, f"{tokens} tokens")


@pytest.mark.parametrize("recipe", ["delayed", "current"])
def test_reduce_overhead_step_matches_eager_bit_for_bit_over_six_steps(recipe: str) -> None:
    # inductor's CUDA graphs replay kernels only: the delayed-scaling enrolment (Python) must
    # still run on every step, or the scales stop updating while the step runs on. Gradients
    # are set to None each step, as optimizer.zero_grad() does: a graph's output is overwritten
    # by its next replay, so a .grad that is one cannot be accumulated into
    eager, compiled_src, compiled = _eager_and_compiled(recipe, mode="reduce-overhead")
    for step in range(6):
        eager.weight.grad = compiled_src.weight.grad = None
        _assert_same_step(eager, compiled_src, compiled, _input(step), _input(step), f"step {step}")


def _mlp_stack() -> torch.nn.Sequential:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        dq.Linear(256, 512, bias=False, params_dtype=torch.bfloat16, device="cuda"),
        torch.nn.ReLU(),
        dq.Linear(512, 256, bias=False, params_dtype=torch.bfloat16, device="cuda"),
    )


@pytest.mark.parametrize("recipe", ["delayed", "current"])
def test_block_compiled_around_its_activation_checkpoint_matches_eager_bit_for_bit(recipe):
    """torchtitan's order on CUDA (inductor, fullgraph): checkpoint_wrapper with
    `checkpoint_fn=dq.activation_checkpoint`, then compile; the casts are saved, not recomputed."""
    eager = _mlp_stack()
    wrapped = copy.deepcopy(eager)
    for m in (eager, wrapped):
        dq.apply_recipe(m, dq.recipe_from_dict(recipe))
    compiled = torch.compile(
        checkpoint_wrapper(wrapped, checkpoint_fn=dq.activation_checkpoint), fullgraph=True
    )
    for step in range(STEPS):
        x_e, x_c = _input(step), _input(step)
        assert torch.equal(_step(eager, x_e), _step(compiled, x_c)), f"step {step}: outputs"
        assert torch.equal(x_e.grad, x_c.grad), f"step {step}: input gradients"
        for (name, p), q in zip(eager.named_parameters(), wrapped.parameters()):
            assert torch.equal(p.grad, q.grad), f"step {step}: {name}.grad"
            p.grad = q.grad = None
    got, want = scaling_buffers(wrapped), scaling_buffers(eager)
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in got)


def test_plain_checkpoint_compiled_around_delayed_scaling_never_runs_silently_on_cuda():
    """Plain torch.utils.checkpoint in that order would recompute the casts in the compiled
    backward with the scales updated since: refused while tracing (the CUDA update's raw writes
    also bump the buffers' versions, so a saved scale could never be read stale)."""
    model = _mlp_stack()
    dq.apply_recipe(model, dq.recipe_from_dict("delayed"))
    compiled = torch.compile(checkpoint_wrapper(model), fullgraph=True)
    with pytest.raises(Exception, match="dist_quant.activation_checkpoint"):
        for step in range(STEPS):
            _step(compiled, _input(step))
