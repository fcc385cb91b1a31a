"""Which rounding cuDNN's FP8 SDPA backward does (issue 35): its dQ/dK/dV beside variants of the
float64 definition (``kernels/reference_attention.py``) on the same FP8 operands and scales.

The definition rounds dS = P * (dP - D) with the exact P. Variants tried, each a guess at where
cuDNN's kernel differs:

    definition    dS from the exact P
    p-rounded     dS from the E4M3-rounded P it already holds for dV (P's codes times s_si)
    d-from-bf16   D = rowsum(dO * O) with O's product rounded through bf16
    d-from-exact-o D = rowsum(dO * O) with the definition's float64 O, before the `o` slot's FP8
                  rounding (a kernel that keeps D from its own unrounded output, or that sums
                  rowsum(P * dP) instead, has this D)

For each gradient it prints the relative Frobenius error of cuDNN's dequantized FP8 result
against each variant rounded to the same FP8 format and scale, and for dq the error per query
row bucketed by the row's largest P (a sharp softmax puts one P near 1), and over the rows of
whole 128-row tiles against the last, partial one's. Two operand sets: the GPU test's (k with std
2: a sharp softmax) and unit-std k; sequence lengths 1031 (the test's GQA case: a ragged last
tile) and 1024.

    python bench/diag_cudnn_attention.py

Reading it: cuDNN's gradients are E5M2 codes and so is the rounded definition they are compared
with, and a small error before that rounding moves a code by one step (a quarter of its value)
wherever the two values straddle a rounding boundary, so the relative Frobenius error of the
rounded tensors overstates it. On the CPU, dq of the sharp operands with a random relative error
per element before the E5M2 rounding: 1e-3 -> 1.2e-2 after it (0.5% of codes one step off),
1e-2 -> 3.8e-2 (4.6%), 2.5e-2 -> 5.9e-2 (11.5%), 1e-1 -> 1.25e-1 (41% one step, 2.4% further).
So the line "codes vs the definition's" says more than the Frobenius errors: codes only ever one
step away mean noise before cuDNN's own rounding (the tensor cores' accumulation), codes further
away a different formula. cuDNN's 5.96e-2 matches about 2.5e-2 of noise; the Triton kernels'
1.1e-2 before rounding comes to 3.2-3.8e-2 after it, near the 3.3e-2 the module test measured
on their path.

Status (2026-12-05): written when no GPU was lent, so not run on one yet. Run on the CPU with
cuDNN's two calls replaced by the definition, it prints zero errors against "definition" and
every code the same, at a ragged length (200). On the CPU its
"definition" variant equals ``reference_attention.attention_bwd`` (float64, to 1e-18 for dq and
dk), and "p-rounded" lies 6.0-6.3e-2 from it unrounded (7.8-9.1e-2 with both rounded to E5M2)
on these operands with k std 2 and with k std 1 alike. cuDNN measured 5.96e-2 on the sharp ones
but 1.1-1.9e-2 on bench_fp8_attention's unit-std operands (other dO too), so which of these
variants, if any, it follows is for this script to show. "d-from-exact-o" lies 3.8e-2 (causal)
and 2.9e-2 (full) from the definition on the sharp operands and 3.1e-2 / 1.3e-2 on unit-std k
(CPU, float64, the definition's O rounded to E4M3 at its amax for the definition's D).
"""

from __future__ import annotations

import argparse
import math
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests", "kernels"))
from attention_cases import E4M3, E5M2, cast  # noqa: E402
from dist_quant.kernels import attention_cudnn  # noqa: E402
from dist_quant.kernels import reference_attention as ref  # noqa: E402


def _round(x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    limit = torch.finfo(dtype).max
    return (x.float() * scale.float()).clamp(-limit, limit).to(dtype).double() / scale.double()


def _grads(
    ops: dict,
    out: torch.Tensor,
    exact_out: torch.Tensor,
    lse: torch.Tensor,
    variant: str,
    causal: bool,
):
    """dq, dk, dv (float64, on the GPU) of the definition's backward with ``variant``'s dS."""
    h, hkv, d = ops["q"].shape[1], ops["k"].shape[1], ops["q"].shape[3]
    deq = lambda x, si: x.double() * si.double()  # noqa: E731
    rep = lambda x: x.repeat_interleave(h // x.shape[1], dim=1)  # noqa: E731
    qd, kd = deq(ops["q"], ops["q_scale_inv"]), rep(deq(ops["k"], ops["k_scale_inv"]))
    vd = rep(deq(ops["v"], ops["v_scale_inv"]))
    t = (qd @ kd.transpose(-2, -1)) * (ref.LOG2E / math.sqrt(d))
    if causal:
        sq, sk = t.shape[-2:]
        t = t.masked_fill(torch.ones(sq, sk, dtype=torch.bool, device=t.device).triu(1), -math.inf)
    p = torch.exp2(t - lse.double().unsqueeze(-1))
    s_scale = ops["s_scale"]
    pq = _round(p, s_scale, E4M3)
    dod = deq(ops["do"], ops["do_scale_inv"])
    dv = pq.transpose(-2, -1) @ dod
    dp = dod @ vd.transpose(-2, -1)
    prod = dod * (exact_out if variant == "d-from-exact-o" else out)
    if variant == "d-from-bf16":
        prod = prod.to(torch.bfloat16).double()
    delta = prod.sum(-1, keepdim=True)
    ds = (pq if variant == "p-rounded" else p) * (dp - delta)
    dsq = _round(ds, ops["dp_scale"], E5M2) / math.sqrt(d)
    dq = dsq @ kd
    dk = dsq.transpose(-2, -1) @ qd
    b = dk.shape[0]
    group = lambda x: x.reshape(b, hkv, h // hkv, *x.shape[2:]).sum(2)  # noqa: E731
    return dq, group(dk), group(dv), p.amax(-1)


def _operands(b, h, hkv, s, d, k_std, seed):
    g = torch.Generator().manual_seed(seed)
    rnd = lambda *shape, std=1.0: (torch.randn(*shape, generator=g) * std).cuda()  # noqa: E731
    q, q_si = cast(rnd(b, h, s, d), E4M3)
    k, k_si = cast(rnd(b, hkv, s, d, std=k_std), E4M3)
    v, v_si = cast(rnd(b, hkv, s, d), E4M3)
    do, do_si = cast(rnd(b, h, s, d, std=1e-3), E5M2)
    return {
        "q": q, "k": k, "v": v, "do": do, "q_scale_inv": q_si, "k_scale_inv": k_si,
        "v_scale_inv": v_si, "do_scale_inv": do_si, "s_scale": torch.tensor([448.0]).cuda(),
        "dp_scale": torch.tensor([2.0**20]).cuda(),
    }  # fmt: skip


def rel(a, e):
    return ((a - e).norm() / e.norm()).item()


def run(k_std: float, causal: bool, shape: tuple) -> None:
    ops = _operands(*shape, k_std=k_std, seed=3)
    fwd = ("q", "k", "v", "q_scale_inv", "k_scale_inv", "v_scale_inv", "s_scale")
    exact_out = ref.attention_fwd(*(ops[k] for k in fwd), E4M3, None, causal).out
    # the test's scale: O's amax on the E4M3 maximum (a fixed guess saturates a sharp softmax's O)
    o_scale = torch.tensor([448.0 / float(exact_out.abs().max())]).cuda()
    zeros = lambda: torch.zeros(1, device="cuda")  # noqa: E731
    out8, lse = attention_cudnn.attention_fwd_cudnn(
        *(ops[k] for k in fwd), zeros(), o_scale, zeros(), E4M3, causal
    )
    o_si = torch.reciprocal(o_scale)
    out = out8.double() * o_si.double()
    variants = ("definition", "p-rounded", "d-from-bf16", "d-from-exact-o")
    refs = {v: _grads(ops, out, exact_out, lse, v, causal) for v in variants}
    amax = max(g.abs().max() for g in refs["definition"][:3])
    grad_scale = torch.tensor([57344.0 / float(amax)]).cuda()
    si = ("q_scale_inv", "k_scale_inv", "v_scale_inv", "do_scale_inv")
    grads8 = attention_cudnn.attention_bwd_cudnn(
        ops["q"], ops["k"], ops["v"], out8, o_si, ops["do"], *(ops[k] for k in si), lse,
        ops["s_scale"], ops["dp_scale"], zeros(), grad_scale, zeros(), E5M2, causal,
    )  # fmt: skip
    got = [g.double() / grad_scale.double() for g in grads8]
    print(f"\nk std {k_std}, {'causal' if causal else 'full'}, shape {shape}")
    for v in variants:
        errs = [rel(a, _round(e, grad_scale, E5M2)) for a, e in zip(got, refs[v][:3])]
        raw = [rel(a, e) for a, e in zip(got, refs[v][:3])]
        print(
            f"  {v:14s} rounded: dq {errs[0]:.2e} dk {errs[1]:.2e} dv {errs[2]:.2e}"
            f"   unrounded: dq {raw[0]:.2e} dk {raw[1]:.2e} dv {raw[2]:.2e}"
        )
    pmax = refs["definition"][3]  # (b, h, sq)
    for v in variants:
        e = _round(refs[v][0], grad_scale, E5M2)
        row = (got[0] - e).norm(dim=-1) / e.norm(dim=-1).clamp_min(1e-30)
        cells = []
        for lo, hi in ((0, 0.25), (0.25, 0.5), (0.5, 0.9), (0.9, 1.01)):
            sel = (pmax >= lo) & (pmax < hi)
            if sel.any():
                cells.append(f"P_max in [{lo},{hi}): {row[sel].median():.2e} (n={int(sel.sum())})")
        print(f"  dq per-row median vs {v}: " + "; ".join(cells))
    _by_tile(got, refs["definition"], grad_scale)
    cells = []
    for name, a, e in zip(("dq", "dk", "dv"), got, refs["definition"][:3]):
        same, adjacent, far = _code_steps(a * grad_scale.double(), e * grad_scale.double())
        cells.append(f"{name} {same:.2%} / {adjacent:.2%} / {far:.3%}")
    print("  codes vs the definition's, same / one step / further: " + "; ".join(cells))


def _code_steps(got: torch.Tensor, exact: torch.Tensor) -> tuple[float, float, float]:
    """Fractions of E5M2 codes (``got``, scaled) equal to ``exact``'s rounding, one code step
    from it, and further. A result whose error before its own E5M2 rounding is small differs
    from the definition's rounding by single steps where the two straddle a rounding boundary,
    which the relative Frobenius error weighs at a quarter of the value each."""
    limit = torch.finfo(E5M2).max
    codes = lambda x: x.float().clamp(-limit, limit).to(E5M2).view(torch.uint8)  # noqa: E731
    g, e = codes(got).to(torch.int16), codes(exact).to(torch.int16)
    # E5M2 bytes: sign bit, then a magnitude whose integer order is the value order
    signed = lambda c: torch.where(c >= 128, -(c - 128), c)  # noqa: E731
    steps = (signed(g) - signed(e)).abs()
    n = steps.numel()
    return (
        (steps == 0).sum().item() / n,
        (steps == 1).sum().item() / n,
        (steps > 1).sum().item() / n,
    )


def _by_tile(got: list, definition: tuple, grad_scale: torch.Tensor, tile: int = 128) -> None:
    """dq's error over the query rows of whole 128-row tiles and over the last, partial tile's;
    dk's and dv's the same over keys (a kernel's ragged-tile handling shows as a gap)."""
    seq = got[0].shape[2]
    whole = seq - seq % tile
    if whole in (0, seq):
        return
    cells = []
    for name, a, e in zip(("dq", "dk", "dv"), got, definition[:3]):
        e = _round(e, grad_scale, E5M2)
        head, tail = rel(a[:, :, :whole], e[:, :, :whole]), rel(a[:, :, whole:], e[:, :, whole:])
        cells.append(f"{name} {head:.2e} / {tail:.2e}")
    print(
        f"  vs definition, rows in whole {tile}-tiles / in the last {seq - whole}: "
        + "; ".join(cells)
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--seqs",
        default="1031,1024",
        help="sequence lengths, comma-separated (1031: a ragged tile)",
    )
    args = parser.parse_args()
    attention_cudnn.BACKEND = "cudnn"
    print(f"cuDNN {attention_cudnn.cudnn.backend_version()}, {torch.cuda.get_device_name()}")
    for seq in (int(s) for s in args.seqs.split(",")):
        for k_std in (2.0, 1.0):
            for causal in (True, False):
                run(k_std, causal, (1, 8, 2, seq, 128))


if __name__ == "__main__":
    main()
