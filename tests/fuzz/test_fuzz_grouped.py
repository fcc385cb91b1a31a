"""Fuzzing `GroupedLinear` splits: empty experts and split sizes that are not multiples of the row
alignment the quantizers need (MXFP8 32, float8 block 128), under every built-in FP8 recipe.

The module pads each split to the alignment and claims the padding is exact (module docstring:
zero rows change no amax, no block, no wgrad sum, no real output row). The reference is what that
claim means: one plain `Linear` per expert, same weights, same recipe, run on that expert's rows
alone (no padding, its own quantizers). Over two steps (so delayed scaling runs on scales that the
first step's amaxes produced) outputs and input gradients must equal bit for bit, and so must
the delayed-scaling state of every expert that had rows; weight and bias gradients, sums over
rows that the padding lengthens with zeros, may differ by fp32 accumulation order only. An empty expert quantizes nothing (its weight amax stays 0, unlike a Linear called with zero
rows), so only its gradients are compared: exact zeros.
"""

from __future__ import annotations

import torch
from fuzz_models import fuzz_budget
from hypothesis import given
from hypothesis import strategies as st
from reliability import check_state

import dist_quant as dq

IN, OUT = 24, 20
RECIPES = {
    "current": dq.Float8CurrentScaling(),
    "delayed": dq.DelayedScaling(amax_history_len=2),
    "mxfp8": dq.MXFP8BlockScaling(),
    "block": dq.Float8BlockScaling(),
}
split_size = st.one_of(st.sampled_from([0, 1, 31, 33, 127, 129]), st.integers(0, 40))


def experts_and_references(n: int, seed: int, recipe) -> tuple[dq.GroupedLinear, list[dq.Linear]]:
    torch.manual_seed(seed)
    grouped = dq.GroupedLinear(n, IN, OUT, name="experts")
    refs = []
    for i in range(n):
        ref = dq.Linear(IN, OUT, name=f"expert{i}")
        with torch.no_grad():
            ref.weight.copy_(getattr(grouped, f"weight{i}"))
            ref.bias.copy_(getattr(grouped, f"bias{i}"))
        refs.append(ref)
    for m in (grouped, *refs):
        dq.apply_recipe(m, recipe)
    return grouped, refs


def step(grouped, refs, splits, seed):
    """One forward and backward of the grouped module and of the per-expert references."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(sum(splits), IN, generator=g) * 4
    dy = torch.randn(sum(splits), OUT, generator=g)
    xg = x.clone().requires_grad_(True)
    xr = x.clone().requires_grad_(True)
    for m in (grouped, *refs):
        m.zero_grad(set_to_none=True)
    with dq.autocast():
        y = grouped(xg, splits)
        y_ref = torch.cat([ref(part) for ref, part in zip(refs, xr.split(splits))])
    y.backward(dy)
    y_ref.backward(dy)
    return (
        (y.detach(), xg.grad),
        (y_ref.detach(), xr.grad),
        list(zip(x.split(splits), dy.split(splits))),
    )


def sums_agree(a: torch.Tensor, b: torch.Tensor, left: torch.Tensor, right: torch.Tensor) -> bool:
    """`a` and `b` are one fp32 sum over rows (`left @ right`) accumulated over different row
    counts (the padded split adds zero rows): equal up to twice the accumulation bound, taken
    with FP8-rounded magnitudes (a product of two FP8 roundings is within 1.6x the original). A wrongly quantized row moves a sum
    by ~2**-4 of that row's term, far outside the bound for these row counts (<= 129)."""
    rows = left.shape[1]
    bound = 2 * (rows + 2) * 2.0**-24 * 1.6 * (left.double().abs() @ right.double().abs())
    return bool(((a.double() - b.double()).abs() <= bound.reshape(a.shape)).all())


def delayed_columns(grouped: dq.GroupedLinear, i: int, n: int) -> list[torch.Tensor]:
    """Expert i's slots of the grouped state: forward input i, weight n+i, output 2n+i;
    backward grad_output i, grad_input n+i; as (history, scale) pairs in Linear's slot order."""
    rt = grouped.quant_binding.runtime
    out = []
    for state, cols in ((rt.fwd_state, (i, n + i, 2 * n + i)), (rt.bwd_state, (i, n + i))):
        out += [state.amax_history[:, list(cols)], state.scale[list(cols)]]
    return out


def linear_delayed(ref: dq.Linear) -> list[torch.Tensor]:
    rt = ref.quant_binding.runtime
    return [
        rt.fwd_state.amax_history,
        rt.fwd_state.scale,
        rt.bwd_state.amax_history,
        rt.bwd_state.scale,
    ]


@given(
    splits=st.lists(split_size, min_size=1, max_size=4),
    recipe_name=st.sampled_from(sorted(RECIPES)),
    seed=st.integers(0, 99),
)
@fuzz_budget(10)
def test_empty_and_unaligned_splits_equal_one_linear_per_expert_bit_for_bit(
    splits, recipe_name, seed
):
    n = len(splits)
    grouped, refs = experts_and_references(n, seed, RECIPES[recipe_name])
    for s in range(2):
        (y, dx), (y_ref, dx_ref), inputs = step(grouped, refs, splits, 100 * seed + s)
        assert torch.equal(y, y_ref) and torch.equal(dx, dx_ref), (recipe_name, splits, s)
        for i, ref in enumerate(refs):
            dw, db = getattr(grouped, f"weight{i}").grad, getattr(grouped, f"bias{i}").grad
            x_i, dy_i = inputs[i]
            assert sums_agree(dw, ref.weight.grad, dy_i.T, x_i), f"expert {i} weight grad"
            assert sums_agree(db, ref.bias.grad, dy_i.T, torch.ones(len(dy_i), 1)), i
            if splits[i] == 0:
                assert not dw.any() and not db.any(), f"empty expert {i} got a gradient"
            elif recipe_name == "delayed":
                same = all(
                    torch.equal(a, b)
                    for a, b in zip(delayed_columns(grouped, i, n), linear_delayed(ref))
                )
                check_state(same, f"expert {i} of splits {splits}, step {s}: delayed state")
