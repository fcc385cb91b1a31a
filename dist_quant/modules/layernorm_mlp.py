"""`LayerNormMLP`: norm -> fc1 -> activation -> fc2, two quantized GEMM triples in one module.

Slots (Transformer Engine's order, so factories port over); `fc1`/`fc2` roles are named
`{name}.fc1` / `{name}.fc2`, and the fc1 -> fc2 boundary slots carry the consumer's role:

    forward   0 linear/input@fc1   1 linear/weight@fc1   2 linear/input@fc2 (fc1's output)
              3 linear/input@fc2   4 linear/weight@fc2   5 output_quantizer_role
    backward  0 linear/grad_output@fc1   1 grad_input_quantizer_role (fc1's dgrad)
              2 linear/grad_output@fc2   3 linear/grad_output@fc1 (fc2's dgrad)

fc1 runs on slots (0, 1, 2 | 0, 1) column-parallel, fc2 on (3, 4, 5 | 2, 3) row-parallel
(`FC1_SLOTS`, `FC2_SLOTS`). The activation sits between the
GEMMs in high precision, so fc1's output slot and fc2's dgrad slot are boundary slots that this
module never applies: fc2 quantizes the activation with its own input slot, fc1 its incoming
gradient with its own grad-output slot. The module's own output and input gradient stay in high
precision too (they feed the residual add / the norm's backward).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from dist_quant.forward import forward_plan
from dist_quant.kinds import ParallelMode
from dist_quant.modules.base import check_sizes
from dist_quant.modules.functional import SwiGLU, SwiGLUGradHandoff
from dist_quant.modules.layernorm_linear import NormLinearBase, check_normalization
from dist_quant.modules.linear import GemmSlots, init_linear_
from dist_quant.parallel import mark_sequence_parallel, mark_tp_split
from dist_quant.roles import QuantizerRole

ACTIVATIONS = ("gelu", "swiglu")
FWD_SLOTS = 6
BWD_SLOTS = 4
FC1_SLOTS = GemmSlots(
    input=0, weight=1, output=2, grad_output=0, grad_input=1, parallel_mode=ParallelMode.COLUMN
)
FC2_SLOTS = GemmSlots(
    input=3, weight=4, output=5, grad_output=2, grad_input=3, parallel_mode=ParallelMode.ROW
)


def activate(h: torch.Tensor, activation: str) -> torch.Tensor:
    """gelu: tanh approximation (Transformer Engine's "gelu"); swiglu: silu(h1) * h2, where h1 and
    h2 are the first and second halves of fc1's output."""
    if activation == "gelu":
        return F.gelu(h, approximate="tanh")
    return SwiGLU.apply(h)


class LayerNormMLP(NormLinearBase):
    """`fc2(act(fc1(norm(x))))` with FP8 GEMMs under autocast; exact PyTorch math when off.

    Tensor parallel (`tp_group` of more than one rank; `parallel_mode` is not used): fc1 is
    column-parallel and fc2 row-parallel, so the activation runs on `ffn_hidden_size / tp` features
    per rank and the only forward collective is fc2's reduction (plus, with `sequence_parallel`,
    fc1's all-gather of the norm output; the output then holds this rank's sequence rows).
    """

    def __init__(
        self,
        hidden_size: int,
        ffn_hidden_size: int,
        *,
        activation: str = "gelu",
        normalization: str = "LayerNorm",
        eps: float = 1e-5,
        bias: bool = True,
        name: str | None = None,
        tp_group=None,
        parallel_mode: ParallelMode | str | None = None,
        sequence_parallel: bool = False,
        params_dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
    ) -> None:
        owner = f"LayerNormMLP {name!r}"
        check_sizes(owner, hidden_size=hidden_size, ffn_hidden_size=ffn_hidden_size)
        super().__init__(name=name)
        if activation not in ACTIVATIONS:
            raise ValueError(
                f"{owner}: activation must be one of {', '.join(ACTIVATIONS)}, got {activation!r}"
            )
        check_normalization(owner, normalization, eps)
        # fc1 is column-parallel and fc2 row-parallel whenever tp_group has more than one rank
        self._init_parallel(owner, tp_group, parallel_mode, sequence_parallel, modes=())
        self.hidden_size, self.ffn_hidden_size = hidden_size, ffn_hidden_size
        self.activation = activation
        dtype = params_dtype or torch.get_default_dtype()
        ffn = self._check_divisible(owner, "ffn_hidden_size", ffn_hidden_size)  # per rank
        fc1_out = 2 * ffn if activation == "swiglu" else ffn
        self._init_norm(normalization, eps, hidden_size, dtype, device)
        for gemm, out_f, in_f in (
            ("fc1", fc1_out, hidden_size),
            ("fc2", hidden_size, ffn),
        ):
            w = nn.Parameter(torch.empty(out_f, in_f, dtype=dtype, device=device))
            self.register_parameter(f"{gemm}_weight", w)
            b = nn.Parameter(torch.empty(out_f, dtype=dtype, device=device)) if bias else None
            self.register_parameter(f"{gemm}_bias", b)
        if self.tp_size > 1:
            # swiglu's fc1 stacks [gate; up]: each half is split, so a rank holds matching rows
            parts = 2 if activation == "swiglu" else 1
            mark_tp_split(self, "fc1_weight", 0, parts)
            if bias:
                mark_tp_split(self, "fc1_bias", 0, parts)
            mark_tp_split(self, "fc2_weight", 1)
            if sequence_parallel:
                self._mark_norm_sequence_parallel()
                if bias:
                    mark_sequence_parallel(self.fc2_bias)  # added after the reduce-scatter
        self.reset_parameters()

    def reset_parameters(self) -> None:
        # each GEMM as nn.Linear initialises itself (with its unsharded fan-in)
        self._reset_norm_parameters()
        init_linear_(self.fc1_weight, self.fc1_bias, self.hidden_size)
        init_linear_(self.fc2_weight, self.fc2_bias, self.ffn_hidden_size)

    def num_quantizers(self, *, fwd: bool) -> int:
        return FWD_SLOTS if fwd else BWD_SLOTS

    def get_quantizer_roles(self, *, fwd: bool, num_quantizers: int) -> list[QuantizerRole | None]:
        self._check_num_quantizers(fwd, num_quantizers)
        base = self.role_name
        fc1, fc2 = (f"{base}.{gemm}" if base else gemm for gemm in ("fc1", "fc2"))
        t = self.module_type
        if fwd:
            return [
                QuantizerRole(t, "input", fc1),
                QuantizerRole(t, "weight", fc1),
                QuantizerRole(t, "input", fc2),
                QuantizerRole(t, "input", fc2),
                QuantizerRole(t, "weight", fc2),
                self.output_quantizer_role,
            ]
        return [
            QuantizerRole(t, "grad_output", fc1),
            self.grad_input_quantizer_role,
            QuantizerRole(t, "grad_output", fc2),
            QuantizerRole(t, "grad_output", fc1),
        ]

    def gemm_layout(self) -> tuple[GemmSlots, ...]:
        return (FC1_SLOTS, FC2_SLOTS)

    def gemm_weights(self) -> tuple[torch.Tensor, torch.Tensor]:
        return (self.fc1_weight, self.fc2_weight)

    def forward(self, x: torch.Tensor, *, is_first_microbatch: bool | None = None) -> torch.Tensor:
        plan = forward_plan(self)
        runtime = fc1_slots = fc2_slots = None
        if plan is not None:
            runtime, (fc1_slots, fc2_slots) = plan.runtime, plan.gemms
        ln_out = self._norm(x)
        # SwiGLU -> fc2's per-tensor input cast fused on one rank: fc2 reads h, and SwiGLU's
        # output is never written in high precision (functional.quantized_linear)
        fused = (
            self.activation == "swiglu"
            and fc2_slots is not None
            and fc2_slots.per_tensor
            and self.tp_size == 1
        )
        # ... and in the backward SwiGLU's gradient -> fc1's grad-output cast, where fc1 arms the
        # handoff (eager only: a traced backward cannot pass Python state between the GEMMs)
        handoff = SwiGLUGradHandoff() if fused and not torch.compiler.is_compiling() else None
        h = self._linear(
            ln_out, self.fc1_weight, self.fc1_bias, runtime=runtime, slots=fc1_slots,
            cache_slot="fc1_weight", is_first_microbatch=is_first_microbatch,
            tp=self._tp_layout(FC1_SLOTS.parallel_mode), swiglu_handoff=handoff,
        )  # fmt: skip
        # h: (..., ffn) or (..., 2 * ffn) for swiglu; per rank: ffn / tp (SP: sequence gathered)
        a = h if fused else activate(h, self.activation)  # (..., ffn) unless fused
        # -> (..., hidden): partial sums reduced over TP (SP: reduce-scattered to this rank's rows)
        return self._linear(
            a, self.fc2_weight, self.fc2_bias, runtime=runtime, slots=fc2_slots,
            cache_slot="fc2_weight", is_first_microbatch=is_first_microbatch,
            tp=self._tp_layout(FC2_SLOTS.parallel_mode), swiglu_input=fused,
            swiglu_handoff=handoff,
        )  # fmt: skip

    def extra_repr(self) -> str:
        return (
            f"hidden_size={self.hidden_size}, ffn_hidden_size={self.ffn_hidden_size}, "
            f"activation={self.activation}, normalization={self.normalization}, "
            f"name={self.role_name!r}"
        )
