"""FP8 attention through cuDNN's fused FP8 SDPA (the ``nvidia-cudnn-frontend`` package, the
``cudnn`` extra), where cuDNN runs it: the faster of the two GPU paths on Hopper.

What cuDNN takes on Hopper decides what this path is (cudnn-frontend's support checks): head dim
128, no padding mask (causal or none), P rounded to E4M3, and its output and gradients written in
FP8 with scales given before the call, with FP8 dQ/dK/dV (a BF16 output is Blackwell's). So it
serves delayed scaling's `o` and `dqkv` slots, whose scales exist before the tensors do: the
forward writes O in the `o` slot's FP8 format and scale and reports its amax, the backward writes
dQ, dK and dV in the `dqkv` slot's and reports theirs. That is the rounding those slots give the
Triton path's high-precision results, done once inside the kernel (no second pass, no BF16
intermediate). Everything else runs the Triton kernels (``attention.py``).

Numerics: the FP8 operands are the same casts; cuDNN's tiles, its online softmax and the point
where it rounds P are its own (it does not round P against an integer row max as the definition
does), so its results are held to the definition by a tolerance, as the Triton kernels' are,
wider for the forward's output (docs/fp8_attention.md).

``DIST_QUANT_FP8_ATTENTION`` (read at import): ``cudnn`` opts in, ``triton`` (the default for
now) keeps every call on the Triton kernels.
"""

from __future__ import annotations

import functools
import math
import os
import threading
from typing import Any, NamedTuple

import torch
from dist_quant.kernels._op import register_op
from dist_quant.kernels.reference_attention import LOG2E
from torch import Tensor

try:
    import cudnn
except ImportError:  # the optional `cudnn` extra is not installed: the Triton kernels run
    cudnn = None

HEAD_DIM = 128
"""The one head dim cuDNN's FP8 backward takes on Hopper."""
MIN_CUDNN = 91400
"""cuDNN 9.14: the first release cudnn-frontend's own FP8 SDPA tests run on."""
BACKENDS = ("cudnn", "triton")
# "triton" until cuDNN's gradients are as close to the definition as the Triton kernels' (on a
# sharp softmax on the H200 its E5M2 dq is 6e-2 from the definition's rounding, about 2.5e-2
# before it against their 1.1e-2; tests/modules/test_attention_gpu.py fails on it under delayed
# scaling at head dim 128): docs/fp8_attention.md
BACKEND = os.environ.get("DIST_QUANT_FP8_ATTENTION", "triton")
"""Which GPU path FP8 attention takes (read at import): "cudnn" where cuDNN takes the call,
"triton" always the Triton kernels."""
if BACKEND not in BACKENDS:
    raise ValueError(f"DIST_QUANT_FP8_ATTENTION={BACKEND!r}: expected one of {BACKENDS}")

_FP8_TYPES = {}
if cudnn is not None:
    _FP8_TYPES = {
        torch.float8_e4m3fn: cudnn.data_type.FP8_E4M3,
        torch.float8_e5m2: cudnn.data_type.FP8_E5M2,
    }


@functools.cache
def _device_runs_it(index: int) -> bool:
    """sm90+ under cuDNN >= 9.14 (asked once per device)."""
    try:
        version = int(cudnn.backend_version())
    except Exception:  # the frontend found no libcudnn it can call
        return False
    return torch.cuda.get_device_capability(index)[0] >= 9 and version >= MIN_CUDNN


def cudnn_runs(q: Tensor, k: Tensor, pad_mask: Tensor | None, s_dtype: torch.dtype) -> bool:
    """Whether cuDNN's FP8 SDPA takes this call (the slots' part, FP8 `o` and `dqkv` of known
    scale and dS in dO's format, is the module's to check: `AttentionSlots.fp8_results`): CUDA on sm90+, the frontend installed over cuDNN >= 9.14,
    head dim 128, no padding mask, P in E4M3, and `BACKEND` "cudnn"."""
    return (
        cudnn is not None
        and BACKEND == "cudnn"
        and q.device.type == "cuda"
        and q.shape[-1] == HEAD_DIM
        and k.shape[-1] == HEAD_DIM
        and pad_mask is None
        and s_dtype == torch.float8_e4m3fn
        and _device_runs_it(_index(q.device))
    )


# ---- handles and graphs -------------------------------------------------------------------------
_local = threading.local()  # one cuDNN handle per thread and device (the backward's thread too)


def _index(device: torch.device) -> int:
    return device.index if device.index is not None else torch.cuda.current_device()


def _handle(device: torch.device) -> Any:
    handles = _local.__dict__.setdefault("handles", {})
    index = _index(device)
    if index not in handles:
        with torch.cuda.device(index):
            handles[index] = cudnn.create_handle()
    handle = handles[index]
    # the stream the caller runs on (a capturing CUDA graph's, too)
    cudnn.set_stream(handle=handle, stream=torch.cuda.current_stream(device).cuda_stream)
    return handle


class _Graph(NamedTuple):
    graph: Any
    ports: dict[str, Any]
    workspace: int


_graphs: dict[tuple, _Graph] = {}


def _layout(t: Tensor) -> tuple:
    return (tuple(t.shape), tuple(t.stride()), t.dtype)


def _port(g: Any, t: Tensor) -> Any:
    dtype = _FP8_TYPES.get(t.dtype, cudnn.data_type.FLOAT)
    return g.tensor(dim=list(t.shape), stride=list(t.stride()), data_type=dtype)


def _scalar_port(g: Any) -> Any:
    return g.tensor(dim=[1, 1, 1, 1], stride=[1, 1, 1, 1], data_type=cudnn.data_type.FLOAT)


def _output(port: Any, t: Tensor) -> None:
    dtype = _FP8_TYPES.get(t.dtype, cudnn.data_type.FLOAT)
    port.set_output(True).set_dim(list(t.shape)).set_stride(list(t.stride())).set_data_type(dtype)


def _mask(causal: bool) -> dict[str, Any]:
    if not causal:
        return {}
    return {"diagonal_alignment": cudnn.diagonal_alignment.TOP_LEFT, "right_bound": 0}


def _built(key: tuple, make: Any, handle: Any) -> _Graph:
    """The graph for ``key``, built (and its plan picked) on first use."""
    if key not in _graphs:
        g = cudnn.pygraph(
            io_data_type=cudnn.data_type.FP8_E4M3,
            intermediate_data_type=cudnn.data_type.FLOAT,
            compute_data_type=cudnn.data_type.FLOAT,
            handle=handle,
        )
        ports = make(g)
        g.validate()
        g.build_operation_graph()
        g.create_execution_plans([cudnn.heur_mode.A, cudnn.heur_mode.FALLBACK])
        g.check_support()
        g.build_plans()
        _graphs[key] = _Graph(g, ports, g.get_workspace_size())
    return _graphs[key]


def _run(graph: _Graph, handle: Any, tensors: dict[str, Tensor], device: torch.device) -> None:
    pack = {graph.ports[name]: t for name, t in tensors.items()}
    workspace = torch.empty(graph.workspace, dtype=torch.uint8, device=device)
    graph.graph.execute(pack, workspace, handle=handle)


def _one(x: Tensor) -> Tensor:
    return x.reshape(1, 1, 1, 1)


# ---- forward and backward -----------------------------------------------------------------------
_FWD_SCALARS = ("descale_q", "descale_k", "descale_v", "descale_s", "scale_s", "scale_o")
_BWD_SCALARS = (
    "descale_q", "descale_k", "descale_v", "descale_o", "descale_dO", "descale_s", "descale_dP",
    "scale_s", "scale_dQ", "scale_dK", "scale_dV", "scale_dP",
)  # fmt: skip


def attention_fwd_cudnn(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    q_scale_inv: Tensor,
    k_scale_inv: Tensor,
    v_scale_inv: Tensor,
    s_scale: Tensor,
    s_amax: Tensor,
    o_scale: Tensor,
    o_amax: Tensor,
    o_dtype: torch.dtype,
    causal: bool,
) -> tuple[Tensor, Tensor]:
    """(out (b, h, sq, d) FP8 in ``o_dtype`` scaled by ``o_scale``, in q's layout; lse (b, h, sq)
    fp32, base 2); ``s_amax`` and ``o_amax`` fold cuDNN's max P and max |out| in place."""
    b, h, sq, d = q.shape
    out = torch.empty_like(q, dtype=o_dtype)
    stats = torch.empty(b, h, sq, 1, dtype=torch.float32, device=q.device)
    amaxes = torch.zeros(2, 1, 1, 1, 1, dtype=torch.float32, device=q.device)
    handle = _handle(q.device)

    def make(g: Any) -> dict[str, Any]:
        ports = {n: _port(g, t) for n, t in (("q", q), ("k", k), ("v", v))}
        ports |= {n: _scalar_port(g) for n in _FWD_SCALARS}
        o, lse, amax_s, amax_o = g.sdpa_fp8(
            **{n: ports[n] for n in ("q", "k", "v", *_FWD_SCALARS)},
            generate_stats=True, attn_scale=1.0 / math.sqrt(d), **_mask(causal),
        )  # fmt: skip
        _output(o, out)
        _output(lse, stats)
        for port, t in ((amax_s, amaxes[0]), (amax_o, amaxes[1])):
            _output(port, t)
        return ports | {"o": o, "stats": lse, "amax_s": amax_s, "amax_o": amax_o}

    key = ("fwd", *map(_layout, (q, k, v, out)), causal, q.device.index)
    graph = _built(key, make, handle)
    scalars = (q_scale_inv, k_scale_inv, v_scale_inv, torch.reciprocal(s_scale), s_scale, o_scale)
    tensors = {"q": q, "k": k, "v": v, "o": out, "stats": stats}
    tensors |= {"amax_s": amaxes[0], "amax_o": amaxes[1]}
    tensors |= {n: _one(t) for n, t in zip(_FWD_SCALARS, scalars)}
    _run(graph, handle, tensors, q.device)
    # cuDNN rounds exp(logit - running row max) <= 1 and reports the normalised softmax's max
    # instead: the max of what it rounds is 1 (every row sees a key: no padding mask here)
    s_amax.copy_(torch.maximum(s_amax, torch.ones_like(s_amax)))
    o_amax.copy_(torch.maximum(o_amax, amaxes[1].reshape(1)))
    return out, stats.view(b, h, sq).mul(LOG2E)


def attention_bwd_cudnn(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    out: Tensor,
    out_scale_inv: Tensor,
    do: Tensor,
    q_scale_inv: Tensor,
    k_scale_inv: Tensor,
    v_scale_inv: Tensor,
    do_scale_inv: Tensor,
    lse: Tensor,
    s_scale: Tensor,
    dp_scale: Tensor,
    dp_amax: Tensor,
    grad_scale: Tensor,
    grad_amax: Tensor,
    grad_dtype: torch.dtype,
    causal: bool,
) -> tuple[Tensor, Tensor, Tensor]:
    """(dq, dk, dv) FP8 in ``grad_dtype`` scaled by ``grad_scale`` (dq in q's layout, dk and dv
    in k's); ``dp_amax`` folds max |dS|, ``grad_amax`` the three gradients' max, in place."""
    b, h, sq, d = q.shape
    dq = torch.empty_like(q, dtype=grad_dtype)
    dk = torch.empty_like(k, dtype=grad_dtype)
    dv = torch.empty_like(k, dtype=grad_dtype)
    stats = lse.reshape(b, h, sq, 1).mul(1.0 / LOG2E)
    amaxes = torch.zeros(4, 1, 1, 1, 1, dtype=torch.float32, device=q.device)
    handle = _handle(q.device)

    def make(g: Any) -> dict[str, Any]:
        named = (("q", q), ("k", k), ("v", v), ("o", out), ("dO", do), ("stats", stats))
        ports = {n: _port(g, t) for n, t in named}
        ports |= {n: _scalar_port(g) for n in _BWD_SCALARS}
        dq_, dk_, dv_, *amax_ports = g.sdpa_fp8_backward(
            **{n: ports[n] for n in ("q", "k", "v", "o", "dO", "stats", *_BWD_SCALARS)},
            attn_scale=1.0 / math.sqrt(d), use_deterministic_algorithm=False, **_mask(causal),
        )  # fmt: skip
        for port, t in ((dq_, dq), (dk_, dk), (dv_, dv)):
            _output(port, t)
        for port, t in zip(amax_ports, amaxes):
            _output(port, t)
        names = ("amax_dQ", "amax_dK", "amax_dV", "amax_dP")
        return ports | {"dQ": dq_, "dK": dk_, "dV": dv_} | dict(zip(names, amax_ports))

    key = ("bwd", *map(_layout, (q, k, v, out, do, dq, dk)), causal, q.device.index)
    graph = _built(key, make, handle)
    # cuDNN rounds dS / sqrt(d) (the softmax scale applied before the rounding, its amax says
    # so): a scale sqrt(d) larger puts the codes on the definition's, those of dS * dp_scale
    ds_scale = dp_scale * math.sqrt(d)
    scalars = (
        q_scale_inv, k_scale_inv, v_scale_inv, out_scale_inv, do_scale_inv,
        torch.reciprocal(s_scale), torch.reciprocal(ds_scale), s_scale,
        grad_scale, grad_scale, grad_scale, ds_scale,
    )  # fmt: skip
    tensors = {"q": q, "k": k, "v": v, "o": out, "dO": do, "stats": stats}
    tensors |= {"dQ": dq, "dK": dk, "dV": dv}
    tensors |= dict(zip(("amax_dQ", "amax_dK", "amax_dV", "amax_dP"), amaxes))
    tensors |= {n: _one(t) for n, t in zip(_BWD_SCALARS, scalars)}
    _run(graph, handle, tensors, q.device)
    dp_amax.copy_(torch.maximum(dp_amax, amaxes[3].reshape(1) * math.sqrt(d)))
    grad_amax.copy_(torch.maximum(grad_amax, amaxes[:3].amax().reshape(1)))
    return dq, dk, dv


# ---- the ops ------------------------------------------------------------------------------------
def _fwd_impl(
    q: Tensor, k: Tensor, v: Tensor, q_scale_inv: Tensor, k_scale_inv: Tensor,
    v_scale_inv: Tensor, s_scale: Tensor, s_amax: Tensor, o_scale: Tensor, o_amax: Tensor,
    o_dtype: torch.dtype, causal: bool,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:  # fmt: skip
    out, lse = attention_fwd_cudnn(
        q, k, v, q_scale_inv, k_scale_inv, v_scale_inv, s_scale, s_amax, o_scale, o_amax,
        o_dtype, causal,
    )  # fmt: skip
    # the backward's P and O scales as of this forward (delayed scales change in place before
    # the backward runs; see attention.py)
    return out, lse, s_scale.clone(), torch.reciprocal(o_scale)


def _fwd_fake(
    q: Tensor, k: Tensor, v: Tensor, q_scale_inv: Tensor, k_scale_inv: Tensor,
    v_scale_inv: Tensor, s_scale: Tensor, s_amax: Tensor, o_scale: Tensor, o_amax: Tensor,
    o_dtype: torch.dtype, causal: bool,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:  # fmt: skip
    lse = q.new_empty(q.shape[:-1], dtype=torch.float32)
    return torch.empty_like(q, dtype=o_dtype), lse, s_scale.new_empty(1), o_scale.new_empty(1)


def _bwd_fake(q: Tensor, k: Tensor, *args: object) -> tuple[Tensor, Tensor, Tensor]:
    grad_dtype = args[-2]
    return (
        torch.empty_like(q, dtype=grad_dtype),
        torch.empty_like(k, dtype=grad_dtype),
        torch.empty_like(k, dtype=grad_dtype),
    )


# CUDA only (the module calls them where `cudnn_runs` says so); opaque under compile: cuDNN
# executes its own plan. The forward returns (out FP8, lse fp32 base 2, the P scale and the O
# scale inverse for the backward) and folds max P and max |out| into `s_amax` and `o_amax`; the
# backward returns (dq, dk, dv) FP8 and folds max |dS| and the gradients' max.
fp8_attention_fwd_cudnn = register_op(
    "fp8_attention_fwd_cudnn", ("s_amax", "o_amax"), None, _fwd_impl, _fwd_fake, traceable=False
)
fp8_attention_bwd_cudnn = register_op(
    "fp8_attention_bwd_cudnn", ("dp_amax", "grad_amax"), None, attention_bwd_cudnn, _bwd_fake,
    traceable=False,
)  # fmt: skip
