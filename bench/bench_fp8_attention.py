"""FP8 attention (the Triton flash kernels) vs torch's BF16 SDPA, forward + backward, one GPU.

Default shape: batch 1, seq 8192, head dim 128, 32 query / 8 KV heads, causal (Llama-3-8B's
attention). Three rows, each timed back to back (median of CUDA events, no sync in between):

- `bf16 sdpa`: `F.scaled_dot_product_attention(..., is_causal=True, enable_gqa=True)` fwd+bwd;
- `fp8 kernels`: the forward and backward launchers on ready FP8 operands (attention alone);
- `cudnn ops`: cuDNN's fused FP8 SDPA (``kernels/attention_cudnn.py``) on the same operands,
  writing its output and gradients in FP8 (where cuDNN runs: the `cudnn` extra, Hopper, d 128);
- `fp8 module cudnn`, `fp8 module triton`: `DotProductAttention` under
  `DelayedScaling(fp8_dpa=True)` fwd+bwd from bf16 inputs, casts and the `o`/`dqkv` slots
  included (what a layer pays), on cuDNN (where it runs) and on the Triton kernels.

It prints ms, the ratio over BF16 SDPA (target >= 1.3x for the kernels) and the host time to
issue one step (wall time of the Python calls, measured separately with the GPU kept busy).

    python bench/bench_fp8_attention.py [--seq 8192] [--heads 32] [--kv-heads 8] [--dim 128]
        [--batch 1] [--no-causal] [--rows "bf16 sdpa,cudnn ops,fp8 module cudnn"] [--sweep]
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F
from bench_linear import cuda_median_ms, cuda_profile
from dist_quant.kernels import attention as attn_kernels
from dist_quant.kernels import attention_cudnn
from dist_quant.kernels.attention import attention_bwd_triton, attention_fwd_triton
from dist_quant.kernels.attention_cudnn import (
    cudnn_runs,
    fp8_attention_bwd_cudnn,
    fp8_attention_fwd_cudnn,
)

import dist_quant as dq

# --sweep: (BM, BN, warps, stages) tried per kernel at the run's head dim
SWEEP = {
    "GPU_FWD": [(128, 64, 8, 3), (128, 128, 8, 3), (128, 64, 8, 4), (64, 64, 4, 3),
                (128, 128, 8, 4), (128, 64, 4, 3), (128, 128, 4, 3), (64, 128, 4, 3)],
    "GPU_BWD_DV": [(64, 128, 8, 3), (64, 128, 8, 2), (128, 128, 8, 2), (64, 64, 4, 3),
                   (128, 64, 8, 2), (32, 128, 8, 2)],
    "GPU_BWD_DK": [(64, 128, 8, 3), (64, 128, 8, 2), (128, 128, 8, 2), (64, 64, 4, 3),
                   (128, 64, 8, 2), (32, 128, 8, 2)],
    "GPU_BWD_DQ": [(64, 64, 8, 3), (128, 32, 8, 2), (64, 32, 4, 3), (128, 64, 8, 2),
                   (128, 128, 8, 2), (64, 128, 8, 2), (128, 64, 4, 3), (128, 32, 4, 3),
                   (64, 64, 4, 3)],
}  # fmt: skip


def host_ms(fn, iters: int = 20) -> float:
    """Median wall time of issuing one call, the GPU kept busy so no call waits on it."""
    times = []
    for _ in range(iters):
        torch.cuda._sleep(50_000_000)  # tens of ms of GPU work queued ahead
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
        torch.cuda.synchronize()
    return sorted(times)[len(times) // 2]


def fp8(x: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    limit = torch.finfo(dtype).max
    scale = (limit / x.abs().amax().float()).reshape(1)
    return (x.float() * scale).clamp(-limit, limit).to(dtype).contiguous(), 1.0 / scale


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def check(dpa, q, k, v, do, causal: bool, recipe) -> None:
    """One step of the module against BF16 SDPA: FP8 rounding noise, ~1e-2 to 5e-2; anything
    near 1 is a broken kernel."""
    leaves = [t.detach().clone().requires_grad_(True) for t in (q, k, v)]
    F.scaled_dot_product_attention(*leaves, is_causal=causal, enable_gqa=True).backward(do)
    ref = [F.scaled_dot_product_attention(*leaves, is_causal=causal, enable_gqa=True).detach()]
    ref += [t.grad for t in leaves]
    b, h, s, d = q.shape
    qm, km, vm = (t.detach().transpose(1, 2).contiguous().requires_grad_(True) for t in (q, k, v))
    with dq.autocast(recipe=recipe):
        out = dpa(qm, km, vm)
    out.backward(do.transpose(1, 2).reshape(b, s, h * d))
    got = [out.reshape(b, s, h, d).transpose(1, 2)] + [t.grad.transpose(1, 2) for t in (qm, km, vm)]
    errs = "  ".join(f"{n} {rel(a, r):.2e}" for n, a, r in zip(("out", "dq", "dk", "dv"), got, ref))
    print(f"fp8 module ({type(recipe).__name__}) vs bf16 sdpa, relative error: {errs}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seq", type=int, default=8192)
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--dim", type=int, default=128)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--no-causal", action="store_true")
    ap.add_argument(
        "--rows", default="bf16 sdpa,fp8 kernels,cudnn ops,fp8 module cudnn,fp8 module triton"
    )
    ap.add_argument("--profile", action="store_true", help="CUDA time per kernel of 5 steps")
    ap.add_argument("--sweep", action="store_true", help="time each tile config of SWEEP first")
    args = ap.parse_args()
    b, h, hkv, s, d = args.batch, args.heads, args.kv_heads, args.seq, args.dim
    causal = not args.no_causal
    torch.manual_seed(0)
    dev = "cuda"
    q = torch.randn(b, h, s, d, device=dev, dtype=torch.bfloat16, requires_grad=True)
    k = torch.randn(b, hkv, s, d, device=dev, dtype=torch.bfloat16, requires_grad=True)
    v = torch.randn(b, hkv, s, d, device=dev, dtype=torch.bfloat16, requires_grad=True)
    do = torch.randn(b, h, s, d, device=dev, dtype=torch.bfloat16)
    flops = 4 * b * h * s * s * d * (0.5 if causal else 1.0) * 3.5  # fwd 2 GEMMs + bwd 5

    def sdpa_step():
        q.grad = k.grad = v.grad = None
        out = F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=True)
        out.backward(do)

    (q8, qs), (k8, ks), (v8, vs) = (fp8(t.detach(), torch.float8_e4m3fn) for t in (q, k, v))
    do8, dos = fp8(do, torch.float8_e5m2)
    e4, e5 = torch.float8_e4m3fn, torch.float8_e5m2
    s_scale, dp_scale = torch.tensor([448.0], device=dev), torch.tensor([2.0**10], device=dev)
    amax = torch.zeros(2, device=dev)

    def kernel_step():
        out, lse = attention_fwd_triton(
            q8, k8, v8, qs, ks, vs, s_scale, amax[:1], e4, None, causal, torch.bfloat16
        )
        attention_bwd_triton(
            q8, k8, v8, out, do8, qs, ks, vs, dos, lse, s_scale, e4, dp_scale, amax[1:], e5,
            None, causal,
        )  # fmt: skip

    dpa = dq.DotProductAttention(
        h, d, num_gqa_groups=hkv, attn_mask_type="causal" if causal else "no_mask",
        qkv_format="bshd", name="attn", device=dev,
    )  # fmt: skip
    recipe = dq.DelayedScaling(fp8_dpa=True)
    qm, km, vm = (t.detach().transpose(1, 2).contiguous().requires_grad_(True) for t in (q, k, v))
    dom = do.transpose(1, 2).reshape(b, s, h * d)

    def module_step():
        qm.grad = km.grad = vm.grad = None
        with dq.autocast(recipe=recipe):
            out = dpa(qm, km, vm)
        out.backward(dom)

    o_scale, g_scale = torch.tensor([64.0], device=dev), torch.tensor([2.0**12], device=dev)
    result_amax = torch.zeros(2, device=dev)

    def cudnn_step():
        out8, lse, _, o_si = fp8_attention_fwd_cudnn(
            q8, k8, v8, qs, ks, vs, s_scale, amax[:1], o_scale, result_amax[:1], e4, causal
        )
        fp8_attention_bwd_cudnn(
            q8, k8, v8, out8, o_si, do8, qs, ks, vs, dos, lse, s_scale, dp_scale, amax[1:],
            g_scale, result_amax[1:], e5, causal,
        )  # fmt: skip

    def module_step_on(backend: str):
        def step():
            preferred, attention_cudnn.BACKEND = attention_cudnn.BACKEND, backend
            try:
                module_step()
            finally:
                attention_cudnn.BACKEND = preferred

        return step

    def fwd_only():
        attention_fwd_triton(
            q8, k8, v8, qs, ks, vs, s_scale, amax[:1], e4, None, causal, torch.bfloat16
        )

    out8, lse8 = attention_fwd_triton(
        q8, k8, v8, qs, ks, vs, s_scale, amax[:1], e4, None, causal, torch.bfloat16
    )

    def bwd_only():
        attention_bwd_triton(
            q8, k8, v8, out8, do8, qs, ks, vs, dos, lse8, s_scale, e4, dp_scale, amax[1:], e5,
            None, causal,
        )  # fmt: skip

    print(f"b={b} s={s} d={d} heads={h}/{hkv} causal={causal}  GPU {torch.cuda.get_device_name()}")
    if args.sweep:
        for table, configs in SWEEP.items():
            chosen = getattr(attn_kernels, table)[d]
            fn = fwd_only if table == "GPU_FWD" else bwd_only
            for cfg in configs:
                getattr(attn_kernels, table)[d] = cfg
                try:
                    ms = cuda_median_ms(fn, iters=10, warmup=2)
                    print(f"sweep {table} {cfg}: {ms:.3f} ms")
                except Exception as e:  # a config that does not compile (registers, smem)
                    print(f"sweep {table} {cfg}: failed {type(e).__name__}: {str(e)[:80]}")
            getattr(attn_kernels, table)[d] = chosen
    print(f"torch {torch.__version__}")
    if args.profile:
        prof = cuda_profile(kernel_step, warmup=1, iters=5)
        print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=12))
    attention_cudnn.BACKEND, preferred = "cudnn", attention_cudnn.BACKEND
    on_cudnn = cudnn_runs(q8, k8, None, e4)
    attention_cudnn.BACKEND = preferred
    print(f"cuDNN's FP8 attention runs here: {on_cudnn}")
    check(dpa, q, k, v, do, causal, dq.Float8CurrentScaling(fp8_dpa=True))
    check(dpa, q, k, v, do, causal, recipe)
    base = None
    rows = {"bf16 sdpa": sdpa_step, "fp8 kernels": kernel_step, "cudnn ops": cudnn_step,
            "fp8 module cudnn": module_step_on("cudnn"),
            "fp8 module triton": module_step_on("triton")}  # fmt: skip
    for name in args.rows.split(","):
        if "cudnn" in name and not on_cudnn:
            print(f"{name:12s} skipped: cuDNN's FP8 attention does not run here")
            continue
        fn = rows[name]
        ms = cuda_median_ms(fn, iters=20, warmup=5)
        base = base or ms
        print(
            f"{name:12s} {ms:8.3f} ms  {flops / ms / 1e9:6.0f} TFLOP/s  x{base / ms:5.2f} vs bf16  "
            f"host {host_ms(fn):6.3f} ms"
        )


if __name__ == "__main__":
    main()
