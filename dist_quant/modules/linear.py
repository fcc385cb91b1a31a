"""`Linear`: a drop-in `nn.Linear` whose GEMMs run in FP8 under `autocast`.

Slots (Transformer Engine's order, so factories port over):
    forward  [linear/input, linear/weight, output_quantizer_role]
    backward [linear/grad_output, grad_input_quantizer_role]
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from dist_quant.modules.base import QuantizedModule
from dist_quant.modules.functional import LinearSlots, quantized_linear
from dist_quant.roles import QuantizerRole

FWD_SLOTS = 3
BWD_SLOTS = 2


class LinearBase(QuantizedModule):
    """Shared by modules that run one GEMM triple over `self.weight`: slots, roles, dispatch."""

    module_type = "linear"
    owns_quantizers = True

    def num_quantizers(self, *, fwd: bool) -> int:
        return FWD_SLOTS if fwd else BWD_SLOTS

    def get_quantizer_roles(self, *, fwd: bool, num_quantizers: int) -> list[QuantizerRole | None]:
        self._check_num_quantizers(fwd, num_quantizers)
        name = self.role_name
        if fwd:
            return [
                QuantizerRole(self.module_type, "input", name),
                QuantizerRole(self.module_type, "weight", name),
                self.output_quantizer_role,
            ]
        return [
            QuantizerRole(self.module_type, "grad_output", name),
            self.grad_input_quantizer_role,
        ]

    def _gemm(
        self,
        x: torch.Tensor,
        is_first_microbatch: bool | None,
        fp8_output: bool = False,
        fp8_grad_input: bool = False,
    ) -> torch.Tensor:
        runtime = self.active_runtime()
        weight, bias = self.weight, self.bias
        if runtime is None:
            return F.linear(x, weight.to(x.dtype), None if bias is None else bias.to(x.dtype))
        fq, bq = runtime.fwd_quantizers, runtime.bwd_quantizers
        slots = LinearSlots(
            input=fq[0],
            weight=fq[1],
            output=fq[2],
            grad_output=bq[0],
            grad_input=bq[1],
            bwd_groups=tuple(runtime.delayed_groups(fwd=False)),
            reduction_group=self._amax_reduction_group(),
        )
        self.register_amax_groups(runtime)
        if slots.high_precision and not fp8_output:
            return F.linear(x, weight.to(x.dtype), None if bias is None else bias.to(x.dtype))
        slots.weight.set_usage(rowwise=True, columnwise=x.requires_grad)
        weight_q = self.quantize_weight(
            "weight", weight, slots.weight, runtime, is_first_microbatch
        )
        return quantized_linear(
            x, weight, bias, slots, weight_q, fp8_output=fp8_output, fp8_grad_input=fp8_grad_input
        )

    def _amax_reduction_group(self):
        from dist_quant.context import current_context

        return current_context().region.reduction_group


class Linear(LinearBase):
    """`y = x W^T + b` with FP8 operands under autocast; exact `F.linear` when autocast is off."""

    def __init__(
        self,
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
        super().__init__(name=name)
        if in_features <= 0 or out_features <= 0:
            raise ValueError(
                f"Linear {name!r}: in_features and out_features must be positive, "
                f"got {in_features}, {out_features}"
            )
        if parallel_mode is not None or tp_group is not None or sequence_parallel:
            raise NotImplementedError("tensor parallelism lands with issue 6")
        self.in_features, self.out_features = in_features, out_features
        dtype = params_dtype or torch.get_default_dtype()
        self.weight = nn.Parameter(
            torch.empty(out_features, in_features, dtype=dtype, device=device)
        )
        self.bias = (
            nn.Parameter(torch.empty(out_features, dtype=dtype, device=device)) if bias else None
        )
        self.reset_parameters()

    def reset_parameters(self) -> None:
        # nn.Linear's initialisation, so convert_model and fresh modules start alike
        nn.init.kaiming_uniform_(self.weight, a=math.sqrt(5))
        if self.bias is not None:
            bound = 1 / math.sqrt(self.in_features)
            nn.init.uniform_(self.bias, -bound, bound)

    def forward(
        self,
        x: torch.Tensor,
        *,
        is_first_microbatch: bool | None = None,
        fp8_output: bool = False,
        fp8_grad_input: bool = False,
    ) -> torch.Tensor:
        return self._gemm(x, is_first_microbatch, fp8_output, fp8_grad_input)

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"bias={self.bias is not None}, name={self.role_name!r}"
        )
