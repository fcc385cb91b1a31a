"""The FP8 flash-attention kernels compiled for a CUDA device, at the GPU's tile sizes, against the
float64 reference on the same FP8 operands (run on the CPU): head dims 64 and 128, causal and not,
grouped-query attention, sequence lengths that are no multiple of any tile, bf16 output. The
contract's bounds on operands whose logits the tensor cores sum exactly; random operands within
the coarser tolerance that Hopper's FP8 accumulation leaves (attention_cases.py says why)."""

import pytest
import torch
from attention_cases import (
    check_forward_and_backward,
    check_layouts,
    check_within_hardware_tolerance,
    in_sbhd_storage,
    operands,
)

pytestmark = pytest.mark.gpu

CASES = {
    # b, h, hkv, sq, sk, d
    "mha_d64": (2, 4, 4, 1000, 1000, 64),
    "gqa_d128": (1, 8, 2, 1031, 1031, 128),
    "gqa_d64_odd": (2, 6, 2, 257, 257, 64),
    "cross_d128": (1, 4, 1, 300, 777, 128),
}


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
@pytest.mark.parametrize("case", list(CASES))
def test_kernels_match_the_float64_reference_on_gpu(case, causal):
    ops = operands(*CASES[case], device="cuda", seed=len(case), causal=causal, exact=True)
    check_forward_and_backward(ops, torch.bfloat16)


@pytest.mark.parametrize("case", ["mha_d64", "gqa_d128"])
def test_kernels_on_random_operands_stay_within_the_hardware_tolerance(case):
    ops = operands(*CASES[case], device="cuda", seed=len(case), causal=True)
    check_within_hardware_tolerance(ops, torch.bfloat16)


def test_padding_mask_matches_the_reference_on_gpu():
    ops = operands(
        2, 4, 2, 513, 513, 128, device="cuda", seed=3, pad=True, causal=False, exact=True
    )
    check_forward_and_backward(ops, torch.bfloat16)


@pytest.mark.parametrize("fused", [False, True], ids=["sbhd", "fused_qkv"])
@pytest.mark.parametrize("case", ["gqa_d128", "gqa_d64_odd"])
def test_operands_in_sbhd_storage_are_read_in_place_on_gpu(case, fused):
    """The descriptors read (s, b, h, d) storage (and a fused QKV buffer's column blocks) in
    place: the reference's bounds, the outputs in the operands' storage order."""
    ops = operands(*CASES[case], device="cuda", seed=5, causal=True, exact=True)
    ops = in_sbhd_storage(ops, fused=fused)
    check_forward_and_backward(ops, torch.bfloat16)
    check_layouts(ops, torch.bfloat16)
