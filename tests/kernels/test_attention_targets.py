"""The FP8 attention kernels compiled for Hopper (sm90) without a GPU: every GEMM is an FP8
tensor-core instruction (wgmma on e4m3 / e5m2 operands: QK^T E4M3 x E4M3; PV, P^T dO, dO V^T,
dS K, dS^T Q with the E5M2 gradients of HYBRID), in each of the four launches (forward; dV, dK
and dQ) and P and dS are rounded by the hardware's
saturating round-to-nearest-even conversion; their FP8 tiles arrive through tensor descriptors
(the TMA unit's bulk copies: per-element address registers made the pointer kernels spill). The
interpreter runs in CI never compiles them."""

from __future__ import annotations

from pathlib import Path

import pytest
from target_rows import compiled_rows

SCRIPT = Path(__file__).with_name("compile_attention_targets.py")


@pytest.fixture(scope="module")
def compiled() -> dict[tuple[str, int], dict]:
    rows = compiled_rows(SCRIPT, timeout_s=600)
    return {(r["kernel"], r["d"], r["padded"]): r for r in rows}


MMA = "wgmma.mma_async.sync.aligned.m64n{n}k32.f32.{a}.{b}"
EXPECTED_OPERANDS = {
    "fwd": {("e4m3", "e4m3")},  # Q K^T and P V (P E4M3)
    "dv": {("e4m3", "e4m3"), ("e4m3", "e5m2")},  # K Q^T; P^T dO
    "dk": {("e4m3", "e4m3"), ("e4m3", "e5m2"), ("e5m2", "e4m3")},  # K Q^T; V dO^T; dS^T Q
    "dq": {("e4m3", "e4m3"), ("e5m2", "e4m3")},  # Q K^T; dO V^T, dS K
}
CVT = {"fwd": {"e4m3"}, "dv": {"e4m3"}, "dk": {"e5m2"}, "dq": {"e5m2"}}


@pytest.mark.parametrize("d,padded", [(64, False), (128, False), (128, True)])
@pytest.mark.parametrize("kernel", list(EXPECTED_OPERANDS))
def test_every_gemm_is_an_fp8_tensor_core_instruction(compiled, kernel, d, padded):
    row = compiled[(kernel, d, padded)]
    assert "error" not in row, row
    operands = {tuple(op.split(".")[-2:]) for op in row["mma"]}
    assert row["mma"] and all(op.startswith("wgmma.mma_async") for op in row["mma"]), row
    assert operands == EXPECTED_OPERANDS[kernel], row
    assert {op.split(".")[-2][:4] for op in row["fp8_cvt"]} == CVT[kernel], row
    assert all(op.startswith("cvt.rn.satfinite.") for op in row["fp8_cvt"]), row


@pytest.mark.parametrize("d,padded", [(64, False), (128, False), (128, True)])
@pytest.mark.parametrize("kernel", list(EXPECTED_OPERANDS))
def test_fp8_tiles_are_loaded_by_the_tensor_memory_accelerator(compiled, kernel, d, padded):
    row = compiled[(kernel, d, padded)]
    assert "error" not in row, row
    assert row["tma_loads"] and all(".global." in op for op in row["tma_loads"]), row
