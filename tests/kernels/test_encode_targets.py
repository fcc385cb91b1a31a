"""Which FP8 conversion the GPU kernels compile to, per architecture (no GPU needed).

CI runs the kernels under the interpreter, which never compiles the GPU branch of ``fp8_encode``.
These tests compile the cast, block and MXFP8 kernels for Hopper (sm90) and Ampere (sm80) in a
process without ``TRITON_INTERPRET`` and read the PTX: on sm90 the rounding is the hardware's
round-to-nearest-even conversion (``HW_ROUND``, what ``hw_rounding`` picks there); on sm80, where
Triton has no E4M3 type and converts E5M2 by rounding toward zero, no FP8 conversion instruction
may appear (the byte is packed with integer ops) and every kernel must still compile.
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from dist_quant.kernels._fp8_round import hw_rounding
from target_rows import compiled_rows

SCRIPT = Path(__file__).with_name("compile_targets.py")
KERNELS = 3 * 2  # cast+transpose, block, MXFP8 rowwise x E4M3, E5M2


@pytest.fixture(scope="module")
def compiled() -> list[dict]:
    return compiled_rows(SCRIPT, timeout_s=300)


def _rows(compiled: list[dict], sm: int) -> list[dict]:
    rows = [r for r in compiled if r["sm"] == sm]
    assert len(rows) == KERNELS, rows
    return rows


def test_hopper_kernels_round_with_the_hardware_conversion(compiled: list[dict]) -> None:
    for row in _rows(compiled, 90):
        assert "error" not in row, row
        fmt = "e4m3" if "e4m3" in row["fp8"] else "e5m2"
        assert row["fp8_cvt"] == [f"cvt.rn.satfinite.{fmt}x2.f32"], row


def test_ampere_kernels_compile_and_pack_the_byte_themselves(compiled: list[dict]) -> None:
    for row in _rows(compiled, 80):
        assert "error" not in row, row
        assert row["fp8_cvt"] == [], row


def test_launchers_pick_hardware_rounding_only_on_gpus_with_native_fp8(monkeypatch) -> None:
    # device indices no machine has, so the per-device cache keeps nothing a real GPU would use
    capability = {97: (8, 0), 98: (8, 9), 99: (9, 0)}
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda d: capability[d.index])
    for index, expected in ((97, False), (98, True), (99, True)):
        assert hw_rounding(SimpleNamespace(device=torch.device("cuda", index))) is expected
    assert hw_rounding(torch.zeros(1)) is False  # CPU tensors: the interpreter packs
