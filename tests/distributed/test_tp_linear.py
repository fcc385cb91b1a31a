"""Tensor-parallel `Linear` (column, row; with and without sequence parallelism) against a
single-rank reference, on 2 and 4 ranks (gloo on CPU).

What it catches: a wrong shard (weights, inputs, gradients), a missing or doubled reduction (row
output, column input gradient, row bias), a quantizer that casts its shard with a local scale instead
of the whole tensor's, a quantized all-gather that loses or reorders bytes, and a scale that does
not move on every rank when one rank's shard holds an outlier.

Exactness: every FP8 cast on every rank (input, weight, grad_output: bytes and scale_inv) must equal
the reference's cast of the same tensor, restricted to the rank's shard, bit for bit, in every step
(delayed scaling: step 2 casts with scales from the reduced step-1 history).

Tolerance of outputs and gradients: the operands are bit-identical, so the only difference is the
order of fp32 additions: TP sums partial GEMM results over ranks (row output, column input grad)
where the reference sums inside one GEMM. Reassociating a sum of K fp32 terms changes it by at most
about K * 2**-24 of the sum of |terms|; with K <= 64 and the random data here that is below 1e-5 of
the tensor's largest value, so outputs and gradients are held to 1e-5 (normwise), a thousand times
tighter than the 1e-2 target.
"""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.distributed as dist
from harness import run_ranks
from tp_check import RECIPES, Recorder, assert_close, check_exact, label_quantizers, run_step

import dist_quant as dq
from dist_quant.checkpoint import load_full_state_dict_into_shards
from dist_quant.parallel import allreduce_sequence_parallel_grads

pytestmark = pytest.mark.distributed

SEQ, BATCH, IN, OUT = 8, 2, 32, 16
RTOL = 1e-5


# shard dim of each cast's 2D view on a TP rank, per layout: input (tokens, in), weight
# (out, in), grad_output (tokens, out); None = the rank holds the whole tensor
SPECS = {
    ("column", False): {"input": None, "weight": 0, "grad_output": 1},
    ("column", True): {"input": 0, "weight": 0, "grad_output": 1},
    ("row", False): {"input": 1, "weight": 1, "grad_output": None},
    ("row", True): {"input": 1, "weight": 1, "grad_output": 0},
}
SLOTS = {"input": ("fwd", 0), "weight": ("fwd", 1), "grad_output": ("bwd", 0)}


def data(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    x = torch.randn(SEQ, BATCH, IN, generator=g)
    dy = torch.randn(SEQ, BATCH, OUT, generator=g) * 1e-2
    return x, dy


def local_views(mode: str, sp: bool, x: torch.Tensor, dy: torch.Tensor, rank: int, size: int):
    """This rank's input and output gradient under the layout (SP shards dim 0, the sequence)."""
    if mode == "column":
        x_loc = x.chunk(size, 0)[rank] if sp else x
        return x_loc, dy.chunk(size, -1)[rank]
    x_loc = x.chunk(size, -1)[rank]
    return x_loc, (dy.chunk(size, 0)[rank] if sp else dy)


def expected_output(mode: str, sp: bool, y: torch.Tensor, rank: int, size: int) -> torch.Tensor:
    if mode == "column":
        return y.chunk(size, -1)[rank]
    return y.chunk(size, 0)[rank] if sp else y


def expected_dx(mode: str, sp: bool, dx: torch.Tensor, rank: int, size: int) -> torch.Tensor:
    if mode == "column":
        return dx.chunk(size, 0)[rank] if sp else dx
    return dx.chunk(size, -1)[rank]


def compare_layout(rec: Recorder, mode: str, sp: bool, recipe_name: str, rank: int, size: int):
    group = dist.group.WORLD
    torch.manual_seed(0)
    ref = dq.Linear(IN, OUT, name="lin")
    tp = dq.Linear(IN, OUT, name="lin", tp_group=group, parallel_mode=mode, sequence_parallel=sp)
    load_full_state_dict_into_shards(tp, ref.state_dict(), group)
    for m in (ref, tp):
        dq.apply_recipe(m, RECIPES[recipe_name]())
        label_quantizers(m)
    where = f"{mode}{'+SP' if sp else ''} {recipe_name} TP={size}"
    specs = {("lin", *SLOTS[k]): d for k, d in SPECS[(mode, sp)].items()}
    compared = 0
    for step in range(2):
        x, dy = data(step)
        y_ref, dx_ref = run_step(ref, x, dy, None)
        ref_casts = rec.take()
        x_loc, dy_loc = local_views(mode, sp, x, dy, rank, size)
        y_tp, dx_tp = run_step(tp, x_loc, dy_loc, group)
        tp_casts = rec.take()
        compared += check_exact(ref_casts, tp_casts, specs, rank, size, f"{where} step {step}")
        assert_close(y_tp, expected_output(mode, sp, y_ref, rank, size), RTOL, f"{where} y")
        assert_close(dx_tp, expected_dx(mode, sp, dx_ref, rank, size), RTOL, f"{where} dx")
        w_dim = 0 if mode == "column" else 1
        assert_close(tp.weight.grad, ref.weight.grad.chunk(size, w_dim)[rank], RTOL, f"{where} dW")
        if mode == "row" and sp:
            allreduce_sequence_parallel_grads(tp, group)  # each rank summed only its own rows
        db_ref = ref.bias.grad.chunk(size, 0)[rank] if mode == "column" else ref.bias.grad
        assert_close(tp.bias.grad, db_ref, RTOL, f"{where} db")
    return compared


def _all_layouts(rank: int, world: int, recipes: list[str], layouts: list) -> int:
    rec = Recorder()
    compared = 0
    for mode, sp in layouts:
        for recipe_name in recipes:
            compared += compare_layout(rec, mode, sp, recipe_name, rank, world)
    return compared


def test_tp2_linear_column_and_row_with_and_without_sp_bit_identical_to_single_rank():
    layouts = list(SPECS)
    counts = run_ranks(_all_layouts, 2, list(RECIPES), layouts)
    # 4 layouts x 3 recipes x 2 steps x 3 casts
    assert counts == [4 * 3 * 2 * 3] * 2


def test_tp4_linear_bit_identical_to_single_rank():
    layouts = list(SPECS)
    counts = run_ranks(_all_layouts, 4, ["delayed", "current"], layouts)
    assert counts == [4 * 2 * 2 * 3] * 4


def _outlier(rank: int, world: int) -> dict:
    """A 1e4 outlier in the last rank's shard: every rank must cast with the scale it implies."""
    group = dist.group.WORLD
    out = {}
    for mode, sp in (("column", True), ("row", False)):
        for recipe_name in ("current", "delayed"):
            torch.manual_seed(0)
            lin = dq.Linear(
                IN, OUT, name="lin", tp_group=group, parallel_mode=mode, sequence_parallel=sp
            )
            rec = Recorder()
            dq.apply_recipe(lin, RECIPES[recipe_name]())
            label_quantizers(lin)
            x, dy = data(0)
            if mode == "column":  # sequence position in the last rank's shard
                x[SEQ - 1, 0, 3] = 1e4
            else:  # input feature in the last rank's shard
                x[2, 1, IN - 1] = 1e4
            x_loc, dy_loc = local_views(mode, sp, x, dy, rank, world)
            run_step(lin, x_loc, dy_loc, group)
            casts = rec.take()
            key = f"{mode}{'+SP' if sp else ''} {recipe_name}"
            if recipe_name == "current":
                out[key] = casts[("lin", "fwd", 0)][0]["scale_inv"].item()
            else:  # the reduced history drives the next step's scale
                out[key] = lin.quant_binding.runtime.fwd_state.scale[0].item()
    return out


def test_outlier_on_one_nonzero_rank_moves_every_ranks_scale():
    for world in (2, 4):
        results = run_ranks(_outlier, world)
        for key in results[0]:
            if key.endswith("current"):
                want = (1.0 / torch.tensor(448.0 / 1e4, dtype=torch.float32)).item()
            else:
                want = torch.tensor(448.0 / 1e4, dtype=torch.float32).item()
            assert [r[key] for r in results] == [want] * world, (world, key, results)


def _unreduced_delayed_gather(rank: int, world: int) -> dict:
    """Delayed scaling without an amax-reduction group: scales drift apart; the sequence-parallel
    all-gather must refuse on every rank instead of mixing bytes cast with different scales."""
    group = dist.group.WORLD
    torch.manual_seed(0)
    lin = dq.Linear(
        IN, OUT, name="sp_lin", tp_group=group, parallel_mode="column", sequence_parallel=True
    )
    dq.apply_recipe(lin, RECIPES["delayed"]())
    x, dy = data(0)
    x = x * (1 + rank)  # each rank's shard has another amax
    x_loc, dy_loc = local_views("column", True, x, dy, rank, world)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        run_step(lin, x_loc, dy_loc, None)  # step 1: every scale is still 1
    try:
        run_step(lin, x_loc, dy_loc, None)
    except ValueError as e:
        return {
            "error": str(e),
            "warned": any("amax_reduction_group" in str(w.message) for w in caught),
        }
    return {"error": None}


def test_sp_gather_refuses_shards_cast_with_different_scales():
    for out in run_ranks(_unreduced_delayed_gather, 2):
        assert out["error"] is not None and "'sp_lin' input" in out["error"]
        assert "different scales" in out["error"] and out["warned"]
