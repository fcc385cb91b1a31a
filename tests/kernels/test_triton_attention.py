"""The FP8 flash-attention kernels (``kernels/attention.py``) in Triton's interpreter against the
float64 reference on the same FP8 operands: 16 x 16 tiles, so every shape below has ragged tiles,
several key tiles per row and (causal) diagonal tiles; fp32 output (the interpreter's bf16 cast
truncates). The GPU twin is ``test_triton_gpu_attention.py``."""

import pytest
import torch
from attention_cases import check_forward_and_backward, check_layouts, in_sbhd_storage, operands

CASES = {
    # b, h, hkv, sq, sk, d
    "mha": (1, 2, 2, 37, 37, 16),
    "gqa": (2, 4, 2, 33, 33, 32),
    "cross_lengths": (1, 2, 1, 21, 45, 16),
}


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
@pytest.mark.parametrize("case", list(CASES))
def test_kernels_match_the_float64_reference(case, causal):
    ops = operands(*CASES[case], device="cpu", seed=len(case), causal=causal)
    check_forward_and_backward(ops, torch.float32)


def test_padding_mask_and_fully_masked_rows_match_the_reference():
    """Sequence 1 has a third of its keys padded; sequence 0 sees only keys 25.., which causal
    masking hides from all its 19 queries: every row of it is fully masked (zero output,
    infinite lse, zero gradients)."""
    ops = operands(2, 2, 1, 19, 30, 16, device="cpu", seed=7, pad=True, causal=False)
    ops["pad_mask"][0, ..., :] = True
    ops["pad_mask"][0, ..., 25:] = False
    ops["causal"] = True
    check_forward_and_backward(ops, torch.float32)


def test_e4m3_gradients_match_the_reference():
    """Format.E4M3 recipes keep the backward in E4M3: dO and dS in E4M3, every GEMM E4M3 x E4M3."""
    ops = operands(1, 4, 2, 29, 29, 32, device="cpu", seed=11, causal=True)
    limit = torch.finfo(torch.float8_e4m3fn).max
    do = ops["do"].float() * ops["do_scale_inv"]
    scale = limit / do.abs().amax()
    ops["do"] = (do * scale).clamp(-limit, limit).to(torch.float8_e4m3fn)
    ops["do_scale_inv"] = (1.0 / scale).reshape(1)
    ops["dp_dtype"], ops["dp_scale"] = torch.float8_e4m3fn, torch.tensor([2.0**12])
    check_forward_and_backward(ops, torch.float32)


@pytest.mark.parametrize("fused", [False, True], ids=["sbhd", "fused_qkv"])
def test_operands_in_sbhd_storage_are_read_in_place_and_match_the_reference(fused):
    """q, k, v and dO as (b, h, s, d) views of (s, b, h, d) storage (and q, k, v split from one
    fused buffer): the same tolerance against the reference, outputs in the operands' order."""
    ops = in_sbhd_storage(operands(*CASES["gqa"], device="cpu", seed=3, causal=True), fused=fused)
    check_forward_and_backward(ops, torch.float32)
    check_layouts(ops, torch.float32)
