"""Registers and stack per thread of the fused SwiGLU cast kernels at each tile of the sweep,
compiled for the H200 (sm_90) without a GPU: Triton compiles the cubin on any machine and its
bundled ``cuobjdump`` reads the resource usage. Run without ``TRITON_INTERPRET``.

An SM holds 64K registers: a kernel at R registers per thread keeps at most 65536 / (R * 32)
warps resident, and a memory-bound kernel needs many to cover its loads. This is why cast.py's
128x128 / 8-warp tile made the fused forward slower than unfused (255 registers and a stack
spill: one program of 8 warps per SM).

    python bench/swiglu_cast_registers.py
"""

from __future__ import annotations

import os
import re
import subprocess
import tempfile

import torch
import triton
from bench_swiglu_cast import SWEEP_BWD_TILES, SWEEP_FWD_TILES
from dist_quant.kernels._fp8_round import _known_specs
from dist_quant.kernels.swiglu_backward_cast import _swiglu_backward_cast_kernel
from dist_quant.kernels.swiglu_cast import _swiglu_cast_kernel
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

POINTERS = {"dy_ptr": "*bf16", "h_ptr": "*bf16", "q_ptr": "*u8", "qt_ptr": "*u8",
            "scale_ptr": "*fp32", "amax_acc_ptr": "*i32", "scale_inv_ptr": "*fp32"}  # fmt: skip


def usage(kernel: object, bm: int, bn: int, warps: int) -> str:
    """``REG:.. STACK:..`` of ``kernel`` (bf16 in, E4M3 out, transpose, hardware rounding)."""
    spec = _known_specs()[torch.float8_e4m3fn]
    consts = {"BM": bm, "BN": bn, "MAX_BITS": spec.max_bits, "MANT_BITS": spec.mant_bits,
              "MIN_EXP": spec.min_exp, "TRANSPOSE": True, "HW_ROUND": True, "BITS": False}  # fmt: skip
    names = kernel.arg_names
    signature = {n: "constexpr" if n in consts else POINTERS.get(n, "i32") for n in names}
    source = ASTSource(
        fn=kernel, signature=signature, constexprs={(names.index(n),): v for n, v in consts.items()}
    )
    compiled = triton.compile(
        source, target=GPUTarget("cuda", 90, 32), options={"num_warps": warps}
    )
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(compiled.asm["cubin"])
        f.flush()
        tool = os.path.join(os.path.dirname(triton.__file__), "backends/nvidia/bin/cuobjdump")
        out = subprocess.run([tool, "-res-usage", f.name], capture_output=True, text=True).stdout
    m = re.search(r"REG:(\d+) STACK:(\d+)", out)
    return f"REG {m.group(1):>3} STACK {m.group(2):>4}" if m else out.strip()[-200:]


def main() -> None:
    for name, kernel, tiles in (("fwd", _swiglu_cast_kernel, SWEEP_FWD_TILES),
                                ("bwd", _swiglu_backward_cast_kernel, SWEEP_BWD_TILES)):  # fmt: skip
        for bm, bn, warps in tiles:
            per_thread = bm * bn // (32 * warps)
            print(f"{name} BM {bm:>3} BN {bn:>3} warps {warps:>2} ({per_thread:>2} elements per "
                  f"thread): {usage(kernel, bm, bn, warps)}", flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
