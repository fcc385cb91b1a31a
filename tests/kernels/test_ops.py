"""The op layer (`kernels/_op.py`): every op's fake agrees with its reference, and the one
dispatch path detaches, validates and refuses what it cannot run.

Each op file registers its op next to its kernel; a fake that disagrees with the real kernel on
shape, stride or dtype breaks `torch.compile` of a quantized step only, far from the file that is
wrong. `opcheck` runs every op on CPU tensors (the reference) and its fake on the same arguments,
and checks the schema's declared mutations against what the reference writes. Every op
of the package must have a case here, so an op added without one fails this file.
"""

from __future__ import annotations

import importlib
import pkgutil

import dist_quant.kernels as K
import pytest
import torch
from dist_quant.kernels import reference as ref
from dist_quant.kernels._op import register_op
from dist_quant.kernels.attention_cudnn import fp8_attention_fwd_cudnn

# every file of the package (an op in a new file is found too)
MODULES = [
    importlib.import_module(f"dist_quant.kernels.{m.name}")
    for m in pkgutil.iter_modules(K.__path__)
]
E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2


def _cases() -> dict[str, tuple]:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(5, 33, generator=g) * 40
    x3 = torch.randn(3, 4, 40, generator=g).to(torch.bfloat16)
    scale, slot = torch.tensor([0.5]), torch.tensor([1.0])
    q, e8m0 = ref.mxfp8_cast(x, E4M3)
    q_b, s_b = ref.block_cast(x, E5M2, block_dim=2)
    history, scales = torch.rand(4, 3, generator=g), torch.ones(3)
    # attention: 4 query heads on 2 KV heads, 5 queries, 7 keys (ragged), a padding mask
    a_q = torch.randn(2, 4, 5, 16, generator=g).to(E4M3)
    a_k, a_v = (torch.randn(2, 2, 7, 16, generator=g).to(E4M3) for _ in range(2))
    a_si, a_mask = torch.tensor([0.5]), torch.rand(2, 1, 1, 7, generator=g) > 0.7
    a_out = torch.randn(2, 4, 5, 16, generator=g).to(torch.bfloat16)
    a_do, a_lse = a_out.float().to(E5M2), torch.rand(2, 4, 5, generator=g) + 3.0
    attn_fwd = (a_q, a_k, a_v, a_si, a_si, a_si, torch.tensor([448.0]), torch.zeros(1), E4M3,
                a_mask, True, torch.bfloat16)  # fmt: skip
    attn_bwd = (a_q, a_k, a_v, a_out, a_do, a_si, a_si, a_si, a_si, a_lse, torch.tensor([448.0]),
                E4M3, torch.tensor([4.0]), torch.zeros(1), E5M2, None, False)  # fmt: skip
    return {
        "cast_to_fp8": (x3, scale, E4M3),
        "cast_transpose": (x3, scale, E5M2),
        "delayed_cast": (x, scale, E4M3, slot),
        "delayed_cast_transpose": (x3, scale, E4M3, slot.clone()),
        "amax": (x3,),
        "current_scale": (torch.tensor([3.0, 0.0]), E4M3, 0.0, True),
        "current_scaling_cast": (x, E5M2, 1e-3, False),
        "current_scaling_cast_transpose": (x3, E4M3, 0.0, True),
        "delayed_scaling_update_groups": (
            [history],
            [scales],
            [torch.full((3,), 448.0)],
            [1.0],
            [0],
        ),
        "mxfp8_cast": (x3, E4M3, True),
        "block_cast": (x3, E4M3, 1, True),
        "dequantize": (q, torch.tensor([2.0]), torch.bfloat16),
        "mxfp8_dequantize": (q, e8m0, False, torch.float32),
        "block_dequantize": (q_b, s_b, 2, torch.float16),
        "cast_stats": (x, scale, E4M3),
        "fp8_attention_fwd": attn_fwd,
        "fp8_attention_bwd": attn_bwd,
        "swiglu": (x3,),
        "swiglu_backward": (x3[..., :20].contiguous(), x3),
        "delayed_swiglu_cast": (x3, scale, E4M3, slot.clone(), True),
        "current_swiglu_cast": (x3, E5M2, 0.0, False, False),
        "delayed_swiglu_backward_cast": (x3[..., :20], x3, scale, E5M2, slot.clone(), True),
        "current_swiglu_backward_cast": (x3[..., :20].contiguous(), x3, E5M2, 0.0, False, True),
        "nvfp4_cast": (
            torch.randn(32, 48, generator=g),
            torch.tensor([9.0]),
            True,
            False,
            True,
            True,
            3,
            4,
        ),
    }


def _kernel_ops() -> dict:
    """Every op the package's files registered (``register_op`` gives its function ``.op``)."""
    ops = [v for m in MODULES for v in vars(m).values() if callable(getattr(v, "op", None))]
    return {f.op._qualname.removeprefix("dist_quant::"): f for f in ops}


# no CPU kernel: gemm.py emulates block_scaled_gemm; cuDNN's FP8 attention runs only where
# `attention_cudnn.cudnn_runs` says (tests/kernels/test_cudnn_attention_gpu.py). Their fakes are
# traced on the GPU.
CUDA_ONLY = ["block_scaled_gemm", "fp8_attention_fwd_cudnn", "fp8_attention_bwd_cudnn"]


def test_every_op_of_the_package_has_a_case_here() -> None:
    assert sorted(_kernel_ops()) == sorted([*_cases(), *CUDA_ONLY])


@pytest.mark.parametrize("name", sorted(_cases()))
def test_op_schema_and_fake_agree_with_the_reference_on_cpu(name: str) -> None:
    op, args = _kernel_ops()[name], _cases()[name]
    # the schema check compares inputs before and after with arithmetic torch lacks for FP8
    fp8_input = any(isinstance(a, torch.Tensor) and a.dtype in (E4M3, E5M2) for a in args)
    checks = ("test_faketensor",) if fp8_input else ("test_schema", "test_faketensor")
    torch.library.opcheck(op.op, args, test_utils=checks)


def test_eager_reference_calls_return_no_autograd_history() -> None:
    x = torch.randn(4, 64, requires_grad=True)
    scale = torch.tensor([2.0])
    outs = [
        K.amax(x),
        K.cast_to_fp8(x, scale, E4M3),
        *K.cast_transpose(x, 2.0, E4M3),
        *K.delayed_cast(x, scale, E4M3, torch.zeros(1), transpose=True)[::2],
        *K.current_scaling_cast(x, E4M3, transpose=True),
        *K.mxfp8_cast(x, E4M3),
        *K.block_cast(x, E4M3, block_dim=1),
    ]
    assert [t.requires_grad for t in outs] == [False] * len(outs)
    assert K.amax(x).item() == x.detach().abs().max().item()


def test_a_python_float_scale_casts_as_its_fp32_value() -> None:
    x = torch.randn(7, 9) * 100
    got = K.cast_to_fp8(x, 0.3, E4M3)
    assert torch.equal(got.view(torch.uint8), ref.cast_to_fp8(x, 0.3, E4M3).view(torch.uint8))
    deq = K.dequantize(got, 0.3, torch.float32)
    assert torch.equal(deq, ref.dequantize(got, torch.tensor(0.3), torch.float32))


def test_a_malformed_update_group_is_refused_naming_the_group() -> None:
    with pytest.raises(ValueError, match="group 0: expected \\(amax_history, scale"):
        K.delayed_scaling_update_groups([(448.0, torch.ones(3), 448.0, 0, "max")])
    h = torch.zeros(2, 3)
    with pytest.raises(ValueError, match="group 1: .* algo 'max' or 'most_recent'"):
        K.delayed_scaling_update_groups([(h, torch.ones(3), 448.0, 0, "max"), (h, h, 1, 0, "x")])
    assert torch.equal(h, torch.zeros(2, 3))  # nothing ran


def test_register_op_refuses_a_pack_without_an_eager_entry_returning_it() -> None:
    def f(x: torch.Tensor) -> torch.Tensor:
        return x.clone()

    with pytest.raises(ValueError, match="'never_registered'\\): pack needs an eager_cuda"):
        register_op("never_registered", (), f, f, f, pack=tuple)


def test_an_op_without_a_cpu_kernel_refuses_cpu_tensors_naming_the_op() -> None:
    q, s = ref.block_cast(torch.randn(4, 128), E4M3, block_dim=1)
    with pytest.raises(RuntimeError, match="block_scaled_gemm.*no kernel for cpu tensors"):
        K.block_scaled_gemm(q, s, 1, q, s, 1, out_dtype=torch.float32)
    x = torch.zeros(1, 2, 16, 128).to(E4M3)
    one = torch.ones(1)
    with pytest.raises(RuntimeError, match="fp8_attention_fwd_cudnn.*no kernel for cpu tensors"):
        fp8_attention_fwd_cudnn(x, x, x, one, one, one, one, one, one, one, E4M3, True)
