"""Compile the FP8 attention kernels for Hopper (sm90) without a GPU and print their MMA, FP8
conversion and bulk tensor copy (TMA) instructions, one JSON line per (kernel, head dim, mask), at the tiles the launchers use: causal at both head dims, and a
padding mask at head dim 128.

Run as a script in a process without ``TRITON_INTERPRET`` (see compile_targets.py); nothing is
launched.
"""

from __future__ import annotations

import json
import sys

import torch
from dist_quant.kernels import attention as A
from dist_quant.kernels._fp8_round import _known_specs
from triton import compile as triton_compile
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

POINTERS = {
    "out_ptr": "*bf16", "s_amax_ptr": "*i32", "dp_amax_ptr": "*i32", "mask_ptr": "*u8",
}  # fmt: skip
# tensor descriptors: name -> (element type, block shape from (BM, BN, D)), as the launchers build them
DESCRIPTORS = {
    "q_desc": ("fp8e4nv", lambda bm, bn, d: (1, 1, bm, d)),
    "qt_desc": ("fp8e4nv", lambda bm, bn, d: (1, d, bm)),
    "k_desc": ("fp8e4nv", lambda bm, bn, d: (1, 1, bn, d)),
    "kt_desc": ("fp8e4nv", lambda bm, bn, d: (1, d, bn)),
    "v_desc": ("fp8e4nv", lambda bm, bn, d: (1, 1, bn, d)),
    "vt_desc": ("fp8e4nv", lambda bm, bn, d: (1, d, bn)),
    "do_desc": ("fp8e5", lambda bm, bn, d: (1, 1, bm, d)),
    "dot_desc": ("fp8e5", lambda bm, bn, d: (1, d, bm)),
}
KERNELS = {  # name -> (kernel, tiles, the launch's own constexprs)
    "fwd": (A._fwd_kernel, A.GPU_FWD, {}),
    "dv": (A._bwd_dkdv_kernel, A.GPU_BWD_DV, {"DV": True}),
    "dk": (A._bwd_dkdv_kernel, A.GPU_BWD_DK, {"DV": False}),
    "dq": (A._bwd_dq_kernel, A.GPU_BWD_DQ, {}),
}


def _format(prefix: str, fp8_dtype: torch.dtype) -> dict:
    spec = _known_specs()[fp8_dtype]
    return {f"{prefix}_MAX_BITS": spec.max_bits, f"{prefix}_MANT": spec.mant_bits,
            f"{prefix}_MIN_EXP": spec.min_exp}  # fmt: skip


def _instruction(line: str) -> str:
    """A PTX line's opcode, past its predicate guard (``@%p3 cp.async.bulk.tensor...``)."""
    words = line.split()
    return words[1] if words[0].startswith("@") and len(words) > 1 else words[0]


def instructions(name: str, d: int, padded: bool) -> dict:
    kernel, table, own = KERNELS[name]
    bm, bn, warps, stages = table[d]
    consts = {"GROUP": 4, "D": d, "BM": bm, "BN": bn, "CAUSAL": not padded, "HAS_MASK": padded,
              "HW": True, **own}  # fmt: skip
    consts.update(_format("S", torch.float8_e4m3fn) if name != "dq" else {})
    consts.update(_format("DP", torch.float8_e5m2) if name != "fwd" else {})
    names = kernel.arg_names
    signature = {}
    for n in names:
        if n in consts:
            signature[n] = "constexpr"
        elif n in POINTERS:
            signature[n] = POINTERS[n]
        elif n in DESCRIPTORS:
            dtype, block = DESCRIPTORS[n]
            signature[n] = f"tensordesc<{dtype}[{','.join(map(str, block(bm, bn, d)))}]>"
        else:
            signature[n] = (
                "*fp32" if n.endswith("_ptr") else "fp32" if "scale" in n or "log2" in n else "i32"
            )
    source = ASTSource(
        fn=kernel, signature=signature, constexprs={(names.index(n),): v for n, v in consts.items()}
    )
    row = {"kernel": name, "d": d, "padded": padded}
    try:
        compiled = triton_compile(
            source,
            target=GPUTarget("cuda", 90, 32),
            options={"num_warps": warps, "num_stages": stages},
        )
    except Exception as e:  # the compiler's own error is the finding
        return {**row, "error": f"{type(e).__name__}: {str(e).splitlines()[-1][:200]}"}
    ops = {_instruction(line) for line in compiled.asm["ptx"].splitlines() if line.strip()}
    return {
        **row,
        "mma": sorted(op for op in ops if op.startswith(("wgmma.mma_async", "mma."))),
        "fp8_cvt": sorted(
            op for op in ops if op.startswith("cvt") and ("e4m3" in op or "e5m2" in op)
        ),
        "tma_loads": sorted(op for op in ops if op.startswith("cp.async.bulk.tensor")),
    }


def main() -> None:
    for d in A.GPU_HEAD_DIMS:
        for name in KERNELS:
            print(json.dumps(instructions(name, d, padded=False)))
    for name in KERNELS:  # a padding mask instead of causal: the masked tiles' mask loads
        print(json.dumps(instructions(name, 128, padded=True)))
    sys.stdout.flush()


if __name__ == "__main__":
    main()
