"""Compile the FP8-encoding kernels for GPU targets without a GPU and print their conversions.

Run as a script in a process without ``TRITON_INTERPRET`` (the test suite sets it, and the
interpreter does not compile): for each (architecture, kernel, format) it prints one JSON line with
the PTX conversion instructions that produce FP8 bytes, or the compiler's error. Triton compiles
to PTX for any target on any machine; nothing is launched.
"""

from __future__ import annotations

import json
import sys

import torch
from dist_quant.kernels._fp8_round import _known_specs
from dist_quant.kernels.block import _block_cast_kernel
from dist_quant.kernels.cast import _cast_transpose_kernel
from dist_quant.kernels.mxfp8 import _mxfp8_rowwise_kernel
from triton import compile as triton_compile
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

POINTERS = {
    "x_ptr": "*bf16", "q_ptr": "*u8", "qt_ptr": "*u8", "e_ptr": "*u8", "s_ptr": "*fp32",
    "scale_ptr": "*fp32", "amax_acc_ptr": "*i32", "partials_ptr": "*i32", "amax_out_ptr": "*fp32",
    "scale_out_ptr": "*fp32", "scale_inv_out_ptr": "*fp32", "eps": "fp32",
}  # fmt: skip


def _constants(kernel: object, fp8_dtype: torch.dtype, hw_round: bool) -> dict:
    spec = _known_specs()[fp8_dtype]
    fmt = {"MAX_BITS": spec.max_bits, "MANT_BITS": spec.mant_bits, "MIN_EXP": spec.min_exp,
           "FP8_MAX": spec.max, "HW_ROUND": hw_round}  # fmt: skip
    if kernel is _cast_transpose_kernel:
        return {**fmt, "BM": 64, "BN": 64, "WITH_AMAX": True, "POW2": False, "P_BLOCK": 0,
                "REVERSE": False, "WRITE_INV": True}  # fmt: skip
    if kernel is _block_cast_kernel:
        return {**fmt, "BM": 16, "NB": 2, "SQUARE": False, "POW2": True}
    return {**fmt, "BM": 32, "NB": 4, "E0_MAX_BITS": 1}


def conversions(kernel: object, fp8_dtype: torch.dtype, capability: int, hw_round: bool) -> dict:
    consts = _constants(kernel, fp8_dtype, hw_round)
    names = kernel.arg_names
    signature = {n: "constexpr" if n in consts else POINTERS.get(n, "i32") for n in names}
    source = ASTSource(
        fn=kernel,
        signature=signature,
        constexprs={(names.index(n),): v for n, v in consts.items()},
    )
    row = {"kernel": kernel.__name__, "fp8": str(fp8_dtype), "sm": capability, "hw": hw_round}
    try:
        ptx = triton_compile(source, target=GPUTarget("cuda", capability, 32)).asm["ptx"]
    except Exception as e:  # the compiler's own error is the finding
        return {**row, "error": f"{type(e).__name__}: {str(e).splitlines()[-1][:200]}"}
    ops = {line.split()[0] for line in ptx.splitlines() if line.strip().startswith("cvt")}
    return {**row, "fp8_cvt": sorted(op for op in ops if "e4m3" in op or "e5m2" in op)}


def main() -> None:
    for capability, hw_round in ((90, True), (80, False)):
        for kernel in (_cast_transpose_kernel, _block_cast_kernel, _mxfp8_rowwise_kernel):
            for fp8_dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
                print(json.dumps(conversions(kernel, fp8_dtype, capability, hw_round)))
    sys.stdout.flush()


if __name__ == "__main__":
    main()
