"""`GroupedLinear`: `num_gemms` independent linears (one per expert) over row splits of one input.

`forward(x, m_splits)` runs GEMM i on rows `sum(m_splits[:i]) .. sum(m_splits[:i+1])` of `x` with
`weight{i}` / `bias{i}` (Transformer Engine's parameter names). All experts share one role name and
`module_type="grouped_linear"`; slots follow Transformer Engine's grouped order, each kind repeated
once per GEMM:

    forward   [input] * n, [weight] * n, [output_quantizer_role] * n      (GEMM i: i, n+i, 2n+i)
    backward  [grad_output] * n, [grad_input_quantizer_role] * n        (GEMM i: i, n+i)

Split padding: each non-empty split's rows are padded with zeros to the row alignment its
quantizers need on real kernels (MXFP8: 32, Float8 block: 128, per-tensor: 16 on CUDA where
`torch._scaled_mm` wants it, 1 in emulation) and the padded output rows are dropped. Zero rows
change no amax, no MXFP8 block or 1x128 tile of real rows, no wgrad sum (their gradient is zero)
and no real output row, so padding is exact. An empty split contributes no rows and zero gradients.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from dist_quant.forward import forward_plan
from dist_quant.fsdp_tensor import GatheredFloat8Weight, empty_gemm
from dist_quant.modules.base import check_sizes
from dist_quant.modules.functional import LinearSlots
from dist_quant.modules.linear import GemmSlots, LinearBase
from dist_quant.roles import QuantizerRole


def row_alignment(slots: Sequence[LinearSlots], device: torch.device) -> int:
    """The row multiple every split needs so all its row-split operands (input, grad output) fit
    the kernels of their scaling kinds (`ScalingKind.row_alignment`)."""
    align = 1
    for s in slots:
        for q in (s.input, s.grad_output):
            align = math.lcm(align, q.scaling.row_alignment(device))
    return align


class GroupedLinear(LinearBase):
    """`num_gemms` linears applied to consecutive row splits of the input (mixture of experts)."""

    module_type = "grouped_linear"

    def __init__(
        self,
        num_gemms: int,
        in_features: int,
        out_features: int,
        bias: bool = True,
        *,
        name: str | None = None,
        tp_group=None,
        parallel_mode: str | None = None,
        sequence_parallel: bool = False,
        params_dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
    ) -> None:
        owner = f"GroupedLinear {name!r}"
        check_sizes(owner, num_gemms=num_gemms, in_features=in_features, out_features=out_features)
        super().__init__(name=name)
        if parallel_mode is not None or tp_group is not None or sequence_parallel:
            raise NotImplementedError("tensor parallelism lands with issue 6")
        self.num_gemms, self.in_features, self.out_features = num_gemms, in_features, out_features
        self.use_bias = bias
        dtype = params_dtype or torch.get_default_dtype()
        for i in range(num_gemms):
            w = nn.Parameter(torch.empty(out_features, in_features, dtype=dtype, device=device))
            self.register_parameter(f"weight{i}", w)
            b = (
                nn.Parameter(torch.empty(out_features, dtype=dtype, device=device))
                if bias
                else None
            )
            self.register_parameter(f"bias{i}", b)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        # nn.Linear's initialisation, expert by expert
        bound = 1 / math.sqrt(self.in_features)
        for weight, bias in self._experts():
            nn.init.kaiming_uniform_(weight, a=math.sqrt(5))
            if bias is not None:
                nn.init.uniform_(bias, -bound, bound)

    def _experts(self) -> list[tuple[nn.Parameter, nn.Parameter | None]]:
        return [
            (getattr(self, f"weight{i}"), getattr(self, f"bias{i}")) for i in range(self.num_gemms)
        ]

    def num_quantizers(self, *, fwd: bool) -> int:
        return (3 if fwd else 2) * self.num_gemms

    def get_quantizer_roles(self, *, fwd: bool, num_quantizers: int) -> list[QuantizerRole | None]:
        self._check_num_quantizers(fwd, num_quantizers)
        n, name, t = self.num_gemms, self.role_name, self.module_type
        if fwd:
            return (
                [QuantizerRole(t, "input", name)] * n
                + [QuantizerRole(t, "weight", name)] * n
                + [self.output_quantizer_role] * n
            )
        return [QuantizerRole(t, "grad_output", name)] * n + [self.grad_input_quantizer_role] * n

    def gemm_layout(self) -> list[GemmSlots]:
        n = self.num_gemms  # expert i: slots i, n + i, 2n + i forward; i, n + i backward
        return [
            GemmSlots(input=i, weight=n + i, output=2 * n + i, grad_output=i, grad_input=n + i)
            for i in range(n)
        ]

    def gemm_weights(self) -> list[torch.Tensor]:
        return [getattr(self, f"weight{i}") for i in range(self.num_gemms)]

    def _check_splits(self, m_splits: object, tokens: int) -> list[int]:
        owner = f"GroupedLinear {self.role_name!r}"
        if not isinstance(m_splits, (list, tuple)) or len(m_splits) != self.num_gemms:
            raise ValueError(
                f"{owner}: m_splits must be a list of {self.num_gemms} ints (one per GEMM), "
                f"got {m_splits!r}"
            )
        splits = []
        for m in m_splits:
            if isinstance(m, bool) or not isinstance(m, int) or m < 0:
                raise ValueError(f"{owner}: m_splits must hold ints >= 0, got {m_splits!r}")
            splits.append(m)
        if sum(splits) != tokens:
            raise ValueError(
                f"{owner}: m_splits {splits} sum to {sum(splits)}, but the input has {tokens} "
                "tokens (rows)"
            )
        return splits

    def forward(
        self,
        x: torch.Tensor,
        m_splits: Sequence[int],
        *,
        is_first_microbatch: bool | None = None,
    ) -> torch.Tensor:
        """`x`: (..., in_features), its rows (all leading dims flattened) split by `m_splits`."""
        x2d = x.reshape(-1, self.in_features)  # (tokens, in_features)
        splits = self._check_splits(m_splits, x2d.shape[0])
        plan = forward_plan(self)
        runtime = None
        slots: Sequence[LinearSlots | None] = [None] * self.num_gemms
        align = 1
        if plan is not None:
            runtime, slots = plan.runtime, plan.gemms
            align = row_alignment(slots, x.device)
        outs = []
        for i, (x_i, (weight, bias)) in enumerate(zip(x2d.split(splits), self._experts())):
            m = x_i.shape[0]
            if m == 0:
                # nothing to quantize; the empty GEMM still gives the expert zero gradients
                if isinstance(weight, GatheredFloat8Weight):  # FP8 bytes: no weight.to(dtype)
                    outs.append(empty_gemm(x_i, weight, bias))
                    continue
                outs.append(
                    F.linear(x_i, weight.to(x.dtype), None if bias is None else bias.to(x.dtype))
                )
                continue
            pad = -m % align
            x_i = F.pad(x_i, (0, 0, 0, pad)) if pad else x_i  # (m + pad, in_features)
            y_i = self._linear(
                x_i,
                weight,
                bias,
                runtime=runtime,
                slots=slots[i],
                cache_slot=f"weight{i}",
                is_first_microbatch=is_first_microbatch,
            )
            outs.append(y_i[:m] if pad else y_i)
        return torch.cat(outs).reshape(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return (
            f"num_gemms={self.num_gemms}, in_features={self.in_features}, "
            f"out_features={self.out_features}, bias={self.use_bias}, name={self.role_name!r}"
        )
