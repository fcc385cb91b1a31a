"""Block-scaled FP8 GEMM in Triton: ``a @ b.T`` for Float8 block-scaled operands (1x128 / 128x128);
the kernel, its launcher and the CUDA-only op ``block_scaled_gemm`` (``_op.py``; the CPU path is
``dist_quant/gemm.py``'s emulation).

``a`` is ``(M, K)``, ``b`` is ``(N, K)``, both FP8 quantized along K in 128-wide blocks. Each
operand's ``scale_inv`` has one fp32 value per row and K block (``block_dim=1``: ``(rows,
ceil(K/128))``) or per 128-row group and K block (``block_dim=2``: ``(ceil(rows/128),
ceil(K/128))``), the layouts of ``reference.block_cast``.

Each program owns a ``[BM, BN]`` output tile and walks K in steps of exactly 128, aligned to the
quantization tiles, so every step has one scale per row of ``a`` and one per row of ``b``:

    acc += dot(a_q[:, kb], b_q[:, kb].T) * a_scale_inv[:, kb] * b_scale_inv[:, kb].T

The FP8 dot runs on the tensor cores (Hopper wgmma) into a fresh fp32 tile, and the scaled partial
is added to the fp32 accumulator on the ordinary cores: the DeepSeek-V3 recipe of promoting the
tensor cores' partial sums every 128 K elements. Mathematically this is the emulated GEMM
(``dequantize(a) @ dequantize(b).T`` in fp32); the rounding differs in order, and on Hopper in one
more way: the FP8 tensor cores accumulate the 128 products of a step with fewer mantissa bits than
fp32 (DeepSeek-V3 reports about 14), which the promotion confines to one 128-deep step.
``tests/kernels/test_block_gemm.py`` states both error bounds.

Ragged M, N and K are masked (padding reads 0, which contributes 0 to every dot). The bias is added
in fp32 before the one rounding to ``out_dtype``, as on the emulated path.

Under ``TRITON_INTERPRET=1`` the FP8 tiles are decoded to fp32 with ``_fp8_round.fp8_decode`` and
the dot runs in fp32: the interpreter's own FP8 dot decodes E4M3 NaN as 480 and E5M2 subnormals
wrongly (measured on Triton 3.9). The decoded values are exact and their products are exact in
fp32, so this is the same computation with fp32 summation inside a step.
"""

from __future__ import annotations

import torch
from dist_quant.kernels._fp8_round import (
    _INTERPRETED,
    fp8_decode,
    fp8_spec,
    is_gpu,
    out_kind,
    store_out,
    store_view,
)
from dist_quant.kernels._launch import FastLaunch
from dist_quant.kernels._op import register_op
from dist_quant.kernels._triton import tl, triton
from torch import Tensor

K_BLOCK = 128  # the Float8 block-scaling tile width: one scale per operand row per K step

# GPU launch configuration: 128x128 output tiles, 8 warps, 4 pipeline stages (32 KiB of FP8
# operands per stage). bench/bench_block_gemm.py --sweep on H200: 1.55 ms at 8192^3, the fastest
# of 7 (64x128 with 4 warps is 8% faster at 4096^3, 4% slower at 8192^3); see BENCHMARKS.md.
GPU_CONFIG = {"BM": 128, "BN": 128, "GROUP_M": 8, "num_warps": 8, "num_stages": 4}


@triton.jit
def _decoded(tile, MANT_BITS: tl.constexpr, MIN_EXP: tl.constexpr, HAS_INF: tl.constexpr):
    """The interpreter's operand: the FP8 tile decoded exactly to fp32 on its bits."""
    return fp8_decode(tile.to(tl.uint8, bitcast=True), MANT_BITS, MIN_EXP, HAS_INF)


@triton.jit
def _block_scaled_gemm_kernel(
    a_ptr,  # fp8 (M, K)
    b_ptr,  # fp8 (N, K)
    as_ptr,  # fp32 (M or ceil(M/128), ceil(K/128))
    bs_ptr,  # fp32 (N or ceil(N/128), ceil(K/128))
    bias_ptr,  # (N,) any float dtype, or a dummy when HAS_BIAS is false
    out_ptr,  # (M, N): fp32, fp16, or bf16 viewed as int16
    M,
    N,
    K,
    stride_am,
    stride_ak,
    stride_bn,
    stride_bk,
    stride_asr,
    stride_ask,
    stride_bsr,
    stride_bsk,
    stride_om,
    stride_on,
    A_ROWS_PER_SCALE: tl.constexpr,  # 1 (1x128 tiles) or 128 (128x128 tiles)
    B_ROWS_PER_SCALE: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    OUT_KIND: tl.constexpr,  # 0 fp32, 1 bf16 bits, 2 fp16
    A_MANT: tl.constexpr,
    A_MIN_EXP: tl.constexpr,
    A_HAS_INF: tl.constexpr,
    B_MANT: tl.constexpr,
    B_MIN_EXP: tl.constexpr,
    B_HAS_INF: tl.constexpr,
    BM: tl.constexpr,
    BN: tl.constexpr,
    BK: tl.constexpr,
    GROUP_M: tl.constexpr,
):
    # Grouped order: GROUP_M row tiles share each column tile's b while it is in L2.
    pid = tl.program_id(0)
    n_tiles_m = tl.cdiv(M, BM)
    n_tiles_n = tl.cdiv(N, BN)
    per_group = GROUP_M * n_tiles_n
    first_m = (pid // per_group) * GROUP_M
    group_rows = tl.minimum(n_tiles_m - first_m, GROUP_M)
    pid_m = first_m + (pid % per_group) % group_rows
    pid_n = (pid % per_group) // group_rows

    rm = pid_m * BM + tl.arange(0, BM)
    rn = pid_n * BN + tl.arange(0, BN)
    rk = tl.arange(0, BK)
    m_ok = rm < M
    n_ok = rn < N
    a_rows = a_ptr + rm.to(tl.int64)[:, None] * stride_am
    b_rows = b_ptr + rn.to(tl.int64)[:, None] * stride_bn
    # A tile inside one 128-row scale group (128x128 operand, BM or BN <= 128) reads one scale per
    # K block instead of a row vector, so the promotion below is one FMA per element.
    A_ONE_SCALE: tl.constexpr = A_ROWS_PER_SCALE >= BM
    B_ONE_SCALE: tl.constexpr = B_ROWS_PER_SCALE >= BN
    if A_ONE_SCALE:
        as_rows = as_ptr + ((pid_m * BM) // A_ROWS_PER_SCALE).to(tl.int64) * stride_asr
    else:
        as_rows = as_ptr + (rm // A_ROWS_PER_SCALE).to(tl.int64) * stride_asr
    if B_ONE_SCALE:
        bs_rows = bs_ptr + ((pid_n * BN) // B_ROWS_PER_SCALE).to(tl.int64) * stride_bsr
    else:
        bs_rows = bs_ptr + (rn // B_ROWS_PER_SCALE).to(tl.int64) * stride_bsr

    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for kb in range(0, tl.cdiv(K, BK)):
        k = kb * BK + rk
        k_ok = k < K
        a = tl.load(a_rows + k[None, :] * stride_ak, mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        b = tl.load(b_rows + k[None, :] * stride_bk, mask=n_ok[:, None] & k_ok[None, :], other=0.0)
        if _INTERPRETED:
            a = _decoded(a, A_MANT, A_MIN_EXP, A_HAS_INF)
            b = _decoded(b, B_MANT, B_MIN_EXP, B_HAS_INF)
        partial = tl.dot(a, tl.trans(b))  # [BM, BN] fp32, a fresh accumulator per K block
        if A_ONE_SCALE:
            a_s = tl.load(as_rows + kb * stride_ask)
        else:
            a_s = tl.load(as_rows + kb * stride_ask, mask=m_ok, other=0.0)[:, None]
        if B_ONE_SCALE:
            b_s = tl.load(bs_rows + kb * stride_bsk)
        else:
            b_s = tl.load(bs_rows + kb * stride_bsk, mask=n_ok, other=0.0)[None, :]
        acc += partial * (a_s * b_s)  # [BM, 1], [1, BN] or [BM, BN] scale

    if HAS_BIAS:
        acc += tl.load(bias_ptr + rn, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    out = out_ptr + rm.to(tl.int64)[:, None] * stride_om + rn[None, :] * stride_on
    store_out(out, acc, m_ok[:, None] & n_ok[None, :], OUT_KIND)


def _check_operand(
    name: str, data: torch.Tensor, scale_inv: torch.Tensor, block_dim: int, what: str
) -> None:
    fp8_spec(data.dtype, f"{what}: {name}_data")
    if data.dim() != 2:
        raise ValueError(f"{what}: {name}_data must be 2D (rows, K), got shape {tuple(data.shape)}")
    if block_dim not in (1, 2):
        raise ValueError(
            f"{what}: {name}_block_dim must be 1 (1x128) or 2 (128x128), got {block_dim!r}"
        )
    rows, k = data.shape
    n_kb = triton.cdiv(k, K_BLOCK)
    expected = (rows if block_dim == 1 else triton.cdiv(rows, K_BLOCK), n_kb)
    if scale_inv.dtype != torch.float32 or tuple(scale_inv.shape) != expected:
        raise ValueError(
            f"{what}: {name}_scale_inv must be fp32 of shape {expected} for {name}_data "
            f"{tuple(data.shape)} with block_dim={block_dim}, got {scale_inv.dtype} of shape "
            f"{tuple(scale_inv.shape)}"
        )
    if scale_inv.device != data.device:
        raise ValueError(
            f"{what}: {name}_scale_inv is on {scale_inv.device}, {name}_data on {data.device}"
        )


_launch_gemm = FastLaunch(_block_scaled_gemm_kernel)


def block_scaled_gemm_triton(
    a_data: torch.Tensor,
    a_scale_inv: torch.Tensor,
    a_block_dim: int,
    b_data: torch.Tensor,
    b_scale_inv: torch.Tensor,
    b_block_dim: int,
    *,
    out_dtype: torch.dtype,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """``a @ b.T (+ bias)``: ``(M, N)`` in ``out_dtype`` (fp32, bf16 or fp16), fp32 accumulation.

    ``a_data`` ``(M, K)`` and ``b_data`` ``(N, K)`` are FP8 (E4M3 or E5M2, mixed allowed), block
    scaled along K with ``*_block_dim`` 1 (1x128 tiles) or 2 (128x128 tiles).
    """
    what = "kernels.block_gemm.block_scaled_gemm"
    _check_operand("a", a_data, a_scale_inv, a_block_dim, what)
    _check_operand("b", b_data, b_scale_inv, b_block_dim, what)
    (m, k), (n, k_b) = a_data.shape, b_data.shape
    if k != k_b:
        raise ValueError(
            f"{what}: computes a @ b.T and needs a (M, K) and b (N, K); got a {tuple(a_data.shape)}"
            f" and b {tuple(b_data.shape)}"
        )
    if b_data.device != a_data.device:
        raise ValueError(f"{what}: a_data is on {a_data.device}, b_data on {b_data.device}")
    kind = out_kind(out_dtype, what, "out_dtype")
    if bias is not None and (
        bias.shape != (n,) or not bias.dtype.is_floating_point or bias.device != a_data.device
    ):
        raise ValueError(
            f"{what}: bias must be a floating-point ({n},) tensor on {a_data.device}, got "
            f"{bias.dtype} of shape {tuple(bias.shape)} on {bias.device}"
        )
    out = torch.empty((m, n), dtype=out_dtype, device=a_data.device)
    if out.numel() == 0:
        return out
    if is_gpu(a_data):
        cfg = GPU_CONFIG
    else:  # interpreter: few, large programs (each op costs Python time, not FLOPs); BM up to
        # 256 and BN up to 64 run both scale paths (row vector and one per tile) on the CPU
        bm = min(max(triton.next_power_of_2(m), 16), 256)
        bn = min(max(triton.next_power_of_2(n), 16), 64)
        cfg = {"BM": bm, "BN": bn, "GROUP_M": 8, "num_warps": 1, "num_stages": 1}
    a_spec, b_spec = fp8_spec(a_data.dtype, what), fp8_spec(b_data.dtype, what)
    grid = (triton.cdiv(m, cfg["BM"]) * triton.cdiv(n, cfg["BN"]),)
    consts = {
        "A_ROWS_PER_SCALE": 1 if a_block_dim == 1 else K_BLOCK,
        "B_ROWS_PER_SCALE": 1 if b_block_dim == 1 else K_BLOCK,
        "HAS_BIAS": bias is not None, "OUT_KIND": kind,
        "A_MANT": a_spec.mant_bits, "A_MIN_EXP": a_spec.min_exp, "A_HAS_INF": a_spec.has_inf,
        "B_MANT": b_spec.mant_bits, "B_MIN_EXP": b_spec.min_exp, "B_HAS_INF": b_spec.has_inf,
        "BK": K_BLOCK,
    }  # fmt: skip
    _launch_gemm.launch(
        grid,
        (
            a_data, b_data, a_scale_inv, b_scale_inv, out if bias is None else bias, store_view(out),
            m, n, k, *a_data.stride(), *b_data.stride(), *a_scale_inv.stride(),
            *b_scale_inv.stride(), *out.stride(),
        ),
        {**consts, **cfg},
        interpreted=not is_gpu(a_data),
    )  # fmt: skip
    return out


# ---- the op: fake, registration (CUDA only) ------------------------------------------------------
def _block_scaled_gemm_cuda(
    a_data: Tensor,
    a_scale_inv: Tensor,
    a_block_dim: int,
    b_data: Tensor,
    b_scale_inv: Tensor,
    b_block_dim: int,
    out_dtype: torch.dtype,
    bias: Tensor | None,
) -> Tensor:
    return block_scaled_gemm_triton(
        a_data, a_scale_inv, a_block_dim, b_data, b_scale_inv, b_block_dim,
        out_dtype=out_dtype, bias=bias,
    )  # fmt: skip


def _block_scaled_gemm_fake(
    a_data: Tensor,
    a_scale_inv: Tensor,
    a_block_dim: int,
    b_data: Tensor,
    b_scale_inv: Tensor,
    b_block_dim: int,
    out_dtype: torch.dtype,
    bias: Tensor | None,
) -> Tensor:
    return a_data.new_empty((a_data.shape[0], b_data.shape[0]), dtype=out_dtype)


_block_scaled_gemm = register_op(
    "block_scaled_gemm", (), None, _block_scaled_gemm_cuda, _block_scaled_gemm_fake
)


def block_scaled_gemm(
    a_data: Tensor,
    a_scale_inv: Tensor,
    a_block_dim: int,
    b_data: Tensor,
    b_scale_inv: Tensor,
    b_block_dim: int,
    *,
    out_dtype: torch.dtype,
    bias: Tensor | None = None,
) -> Tensor:
    """``block_scaled_gemm_triton`` as the ``dist_quant::block_scaled_gemm`` op (CUDA only)."""
    return _block_scaled_gemm(
        a_data, a_scale_inv, a_block_dim, b_data, b_scale_inv, b_block_dim, out_dtype,
        None if bias is None else bias.detach(),
    )  # fmt: skip
