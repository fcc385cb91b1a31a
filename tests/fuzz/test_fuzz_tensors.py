"""Fuzzing the tensors a training step sees: NaN, +-inf, tiny and huge values, all zeros, empty
batches, and shapes that do not fill MXFP8 blocks or float8 block tiles.

Expected values come from `fuzz_numerics.py` (float64 re-derivations of the numerics contract):
- delayed scaling: a step whose amax is 0, inf or NaN keeps the previous scale (and, with "max",
  a NaN or inf stays in the history, so the scale stays frozen until it rolls out); the test keeps
  its own copy of every slot's history and scale, step by step, and compares them bit for bit;
- current scaling: amax 0, inf or NaN gives scale 1, visible in the outputs (the finite elements of
  a tensor holding a NaN are cast at scale 1, an inf saturates to the format's max);
- MXFP8 / block scaling on ragged shapes: every GEMM of the forward and backward equals the float64
  product of the re-derived operands up to fp32 accumulation error.
"""

from __future__ import annotations

import math

import torch
from fuzz_models import fuzz_budget
from fuzz_numerics import (
    E4M3,
    E5M2,
    FP8_MAX,
    amax,
    block_qdq,
    current_qdq,
    mxfp8_qdq,
    scale_from_amax,
    within_gemm_bound,
)
from hypothesis import given
from hypothesis import strategies as st
from reliability import check_state

import dist_quant as dq

WIDTH, TOKENS = 16, 6
KINDS = ["normal", "tiny", "huge", "nan", "inf", "-inf", "zeros", "empty"]


def special(kind: str, tokens: int, seed: int) -> torch.Tensor:
    """(tokens, WIDTH) fp32 values of one kind; one bad element for nan / inf / -inf."""
    g = torch.Generator().manual_seed(seed)
    if kind == "empty":
        return torch.zeros(0, WIDTH)
    t = torch.randn(tokens, WIDTH, generator=g)
    where = (seed % tokens, (seed // tokens) % WIDTH)
    if kind == "tiny":
        t *= 1e-39  # subnormal amax: fp8_max / amax overflows to inf -> FLT_MAX
    elif kind == "huge":
        t *= 1e36  # large, yet no GEMM of 16 terms overflows fp32
    elif kind == "zeros":
        t.zero_()
    elif kind in ("nan", "inf", "-inf"):
        t[where] = {"nan": math.nan, "inf": math.inf, "-inf": -math.inf}[kind]
    return t


def linear(seed: int) -> dq.Linear:
    torch.manual_seed(seed)
    return dq.Linear(WIDTH, WIDTH, name="fc")


def run_step(fc: dq.Linear, x: torch.Tensor, dy: torch.Tensor):
    x = x.clone().requires_grad_(True)
    fc.zero_grad(set_to_none=True)
    with dq.autocast():
        y = fc(x)
    y.backward(dy)
    return y.detach(), x.grad, fc.weight.grad, fc.bias.grad


class DelayedMirror:
    """The test's own delayed-scaling state for one direction: history (L, n) and scale (n,)."""

    def __init__(self, length: int, n: int, fp8_max: float, margin: int, algo: str) -> None:
        self.history = torch.zeros(length, n, dtype=torch.float64)
        self.scale = [1.0] * n
        self.fp8_max, self.margin, self.algo = fp8_max, margin, algo

    def step(self, amaxes: list[float]) -> None:
        self.history[0] = torch.tensor(amaxes, dtype=torch.float64)
        for i in range(len(self.scale)):
            column = self.history[:, i]
            if self.algo == "most_recent":
                a = float(column[0])
            else:
                a = math.nan if bool(column.isnan().any()) else float(column.max())
            s = scale_from_amax(a, self.fp8_max, margin=self.margin)
            if s is not None:
                self.scale[i] = s
        self.history = self.history.roll(-1, 0)
        self.history[0] = 0.0

    def matches(self, state) -> bool:
        hist = torch.allclose(state.amax_history.double(), self.history, 0, 0, equal_nan=True)
        scale = torch.equal(state.scale.double(), torch.tensor(self.scale, dtype=torch.float64))
        return hist and scale


step_kinds = st.tuples(st.sampled_from(KINDS), st.sampled_from(KINDS))


@given(
    steps=st.lists(step_kinds, min_size=2, max_size=4),
    length=st.integers(1, 3),
    margin=st.integers(0, 3),
    algo=st.sampled_from(["max", "most_recent"]),
)
@fuzz_budget(12)
def test_delayed_scales_keep_the_previous_value_on_zero_inf_nan_and_empty_steps(
    steps, length, margin, algo
):
    fc = linear(0)
    recipe = dq.DelayedScaling(margin=margin, amax_history_len=length, amax_compute_algo=algo)
    dq.apply_recipe(fc, recipe)
    fwd = DelayedMirror(length, 3, FP8_MAX[E4M3], margin, algo)  # input, weight, output
    bwd = DelayedMirror(length, 2, FP8_MAX[E5M2], margin, algo)  # grad_output, grad_input
    for i, (x_kind, dy_kind) in enumerate(steps):
        tokens = 0 if "empty" in (x_kind, dy_kind) else TOKENS
        x = special(x_kind if tokens else "empty", tokens, 11 * i + 1)
        dy = special(dy_kind if tokens else "empty", tokens, 11 * i + 2)
        y, dx, dw, _ = run_step(fc, x, dy)
        # output / grad_input slots quantize nothing without fp8_output / fp8_grad_input
        fwd.step([amax(x), amax(fc.weight), 0.0])
        bwd.step([amax(dy), 0.0])
        rt = fc.quant_binding.runtime
        check_state(fwd.matches(rt.fwd_state), f"step {i} ({x_kind}): forward scale/history")
        check_state(bwd.matches(rt.bwd_state), f"step {i} ({dy_kind}): backward scale/history")
        assert y.shape == dx.shape == (tokens, WIDTH) and dw.shape == (WIDTH, WIDTH)


@given(x_kind=st.sampled_from(KINDS), dy_kind=st.sampled_from(KINDS), seed=st.integers(0, 99))
@fuzz_budget(16)
def test_current_scaling_uses_scale_one_for_zero_inf_nan_tensors(x_kind, dy_kind, seed):
    fc = linear(seed)
    dq.apply_recipe(fc, dq.Float8CurrentScaling())
    tokens = 0 if "empty" in (x_kind, dy_kind) else TOKENS
    x = special(x_kind if tokens else "empty", tokens, seed)
    dy = special(dy_kind if tokens else "empty", tokens, seed + 1)
    y, dx, dw, db = run_step(fc, x, dy)
    w = fc.weight.detach()
    x_q, w_q, dy_q = current_qdq(x, E4M3), current_qdq(w, E4M3), current_qdq(dy, E5M2)
    for got, a, b, bias in ((y, x_q, w_q, fc.bias.detach()), (dx, dy_q, w_q.T, None)):
        bad = a.isnan().any(1)  # a NaN element poisons its output row, nothing else
        assert torch.equal(got.isnan().all(1), bad) and not got[~bad].isnan().any()
        assert within_gemm_bound(got[~bad], a[~bad], b, bias), (x_kind, dy_kind)
    if not (x_q.isnan().any() or dy_q.isnan().any()):
        assert within_gemm_bound(dw, dy_q.T, x_q.T)
        assert torch.equal(db, dy.sum(0))
    if tokens == 0:
        assert torch.equal(dw, torch.zeros_like(dw)) and torch.equal(db, torch.zeros_like(db))


def wide_range(*shape: int) -> torch.Tensor:
    """Values spread over 2**-6 .. 2**6 times randn: blocks along rows and along columns then
    get different scales, so quantizing along the wrong dimension shows in the GEMMs (with plain
    randn most blocks share one power-of-two scale and the mistake would go unseen)."""
    return torch.randn(*shape) * torch.exp2(torch.randint(-6, 7, shape).float())


def ragged_operands(recipe_name: str, x: torch.Tensor, w: torch.Tensor, dy: torch.Tensor):
    """Re-derived (x, w, dy) for fprop, (dy, w^T) for dgrad and (dy^T, x^T) for wgrad."""
    if recipe_name == "mxfp8":
        rows = mxfp8_qdq  # blocks along the last dim; columnwise copies are blocked along dim 0
        x_r, w_r, dy_r = rows(x), rows(w), rows(dy)
        w_c, dy_c, x_c = rows(w.T), rows(dy.T), rows(x.T)
    else:
        x_r, dy_r = block_qdq(x, 1), block_qdq(dy, 1)
        w_r = block_qdq(w, 128)
        w_c = w_r.T  # a 128x128 grid transposes exactly
        dy_c, x_c = block_qdq(dy.T, 1), block_qdq(x.T, 1)
    return (x_r, w_r), (dy_r, w_c), (dy_c, x_c)


@given(
    recipe_name=st.sampled_from(["mxfp8", "block"]),
    tokens=st.one_of(st.integers(0, 40), st.sampled_from([31, 33, 129])),
    in_features=st.one_of(st.integers(1, 150), st.sampled_from([31, 33, 127, 129, 257])),
    out_features=st.integers(1, 140),
    seed=st.integers(0, 99),
)
@fuzz_budget(10)
def test_ragged_mxfp8_and_block_shapes_quantize_every_gemm_operand_blockwise(
    recipe_name, tokens, in_features, out_features, seed
):
    torch.manual_seed(seed)
    fc = dq.Linear(in_features, out_features, name="ragged")
    recipe = dq.MXFP8BlockScaling() if recipe_name == "mxfp8" else dq.Float8BlockScaling()
    dq.apply_recipe(fc, recipe)
    with torch.no_grad():
        fc.weight.copy_(wide_range(out_features, in_features))
    x, dy = wide_range(tokens, in_features), wide_range(tokens, out_features)
    y, dx, dw, db = run_step(fc, x, dy)
    w = fc.weight.detach()
    fprop, dgrad, wgrad = ragged_operands(recipe_name, x, w, dy)
    assert within_gemm_bound(y, *fprop, fc.bias.detach()), "fprop"
    assert within_gemm_bound(dx, *dgrad), "dgrad"
    assert within_gemm_bound(dw, *wgrad), "wgrad"
    assert torch.equal(db, dy.sum(0))
