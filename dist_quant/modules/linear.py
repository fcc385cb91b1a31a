"""`Linear`: a drop-in `nn.Linear` whose GEMMs run in FP8 under `autocast`.

Slots (Transformer Engine's order, so factories port over):
    forward  [linear/input, linear/weight, output_quantizer_role]
    backward [linear/grad_output, grad_input_quantizer_role]
"""

from __future__ import annotations

import dataclasses
import math
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from dist_quant.binding import ForwardPlan
from dist_quant.forward import delayed_anchor, forward_plan
from dist_quant.fsdp_tensor import GatheredFloat8Weight, gathered_weight_operand
from dist_quant.kinds import NVFP4_BLOCK, ParallelMode, PassMode, ScalingKind
from dist_quant.modules.base import QuantizedModule, check_sizes
from dist_quant.modules.functional import (
    LinearSlots,
    SwiGLUGradHandoff,
    parallel_linear_hp,
    quantized_linear,
)
from dist_quant.parallel import TPLayout, group_size, mark_sequence_parallel, mark_tp_split
from dist_quant.roles import QuantizerRole
from dist_quant.runtime import ModuleRuntime

FWD_SLOTS = 3
BWD_SLOTS = 2


@dataclass(frozen=True)
class GemmSlots:
    """Where one GEMM's quantizers sit: indices into the runtime's forward quantizers (`input`,
    `weight`, `output`) and backward quantizers (`grad_output`, `grad_input`), and how the GEMM is
    split over a tensor-parallel group (None: not split)."""

    input: int
    weight: int
    output: int
    grad_output: int
    grad_input: int
    parallel_mode: ParallelMode | None = None


LINEAR_SLOTS = GemmSlots(input=0, weight=1, output=2, grad_output=0, grad_input=1)
"""The one GEMM of `Linear` / `LayerNormLinear`, in Transformer Engine's slot order."""


class LinearBase(QuantizedModule):
    """Shared by modules that run GEMM triples: slots, roles, dispatch, tensor parallelism."""

    module_type = "linear"
    owns_quantizers = True
    # tensor parallelism (`_init_parallel`); the class defaults mean "not split"
    tp_group: Any = None
    tp_size: int = 1
    parallel_mode: ParallelMode | None = None
    sequence_parallel: bool = False

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

    # ---- tensor parallelism --------------------------------------------------------------------
    def _init_parallel(
        self,
        owner: str,
        tp_group: Any,
        parallel_mode: ParallelMode | str | None,
        sequence_parallel: bool,
        *,
        modes: tuple[ParallelMode, ...] = tuple(ParallelMode),
    ) -> None:
        """Validate and store the TP settings (`parallel_mode` as a `ParallelMode`);
        `tp_group=None` means one rank (nothing split). `modes=()`: the module splits its GEMMs
        itself (LayerNormMLP) and takes no parallel_mode."""
        if parallel_mode is not None and parallel_mode not in modes:
            choices = ", ".join(["None", *(repr(m.value) for m in modes)])
            raise ValueError(
                f"{owner}: parallel_mode must be one of {choices}, got {parallel_mode!r}"
            )
        if not isinstance(sequence_parallel, bool):
            raise ValueError(
                f"{owner}: sequence_parallel must be a bool, got {sequence_parallel!r}"
            )
        if sequence_parallel and parallel_mode is None and modes:
            raise ValueError(f"{owner}: sequence_parallel needs parallel_mode {' or '.join(modes)}")
        self.tp_group, self.tp_size = tp_group, group_size(tp_group)
        self.parallel_mode = None if parallel_mode is None else ParallelMode(parallel_mode)
        self.sequence_parallel = sequence_parallel

    def _check_divisible(self, owner: str, what: str, value: int) -> int:
        """`value // tp_size`, or ValueError naming the field."""
        if value % self.tp_size:
            raise ValueError(
                f"{owner}: {what} ({value}) must be divisible by the tensor-parallel size "
                f"{self.tp_size}"
            )
        return value // self.tp_size

    def _tp_layout(self, mode: ParallelMode | None) -> TPLayout | None:
        if mode is None or self.tp_size == 1:
            return None
        return TPLayout(self.tp_group, mode, self.sequence_parallel, self)

    def _warn_unreduced_delayed(self, runtime: Any) -> None:
        if runtime.delayed_groups(fwd=True) or runtime.delayed_groups(fwd=False):
            warnings.warn(
                f"{type(self).__name__} {self.role_name!r} is tensor-parallel over {self.tp_size} "
                "ranks with delayed scaling, but autocast has no amax_reduction_group: each rank "
                "keeps its own scales, so TP ranks quantize shards of one tensor differently (and "
                "a sequence-parallel all-gather refuses). Pass the TP group (or TP x DP).",
                stacklevel=4,
            )

    # ---- the forward plan ------------------------------------------------------------------
    def gemm_layout(self) -> Sequence[GemmSlots]:
        """The module's GEMMs, in forward order (Transformer Engine's slot order)."""
        return (dataclasses.replace(LINEAR_SLOTS, parallel_mode=self.parallel_mode),)

    def gemm_weights(self) -> Sequence[torch.Tensor]:
        """Each GEMM's weight `(out, in)` on this rank, in `gemm_layout()` order."""
        return (self.weight,)

    def validate_quantizers(
        self, quantizers: list, roles: tuple, *, fwd: bool, recipe: Any
    ) -> None:
        """The base checks, then each block-scaled operand's blocked dims (the features, known
        at plan time; token counts are checked when quantized): NVFP4 blocks every copy by 16
        along its contracted dim, so a GEMM whose in/out features are not multiples of 16 is
        refused here, naming the role, before anything is published."""
        super().validate_quantizers(quantizers, roles, fwd=fwd, recipe=recipe)
        for gemm, weight in zip(self.gemm_layout(), self.gemm_weights()):
            out_features, in_features = weight.shape
            if fwd:
                checks = [(gemm.input, in_features, "in_features (the input's inner dimension)")]
                checks.append(
                    (gemm.weight, in_features, "in_features (the weight's inner dimension)")
                )
                checks.append(
                    (gemm.weight, out_features, "out_features (the weight's columnwise copy)")
                )
            else:
                checks = [(gemm.grad_output, out_features, "out_features (the output gradient's)")]
            for slot, size, what in checks:
                q = quantizers[slot]
                align = NVFP4_BLOCK if q.scaling is ScalingKind.NVFP4 else 1
                if size % align:
                    raise ValueError(
                        f"role {roles[slot]} gets {type(q).__name__} under "
                        f"{type(recipe).__name__}, which needs {what} to be a multiple of "
                        f"{align}, but the weight is {tuple(weight.shape)}; keep this module "
                        "in another recipe (e.g. a CustomRecipe answering MXFP8 or bf16 for it)"
                    )

    def plan_forward(self, runtime: ModuleRuntime, reduction_group: Any) -> ForwardPlan:
        """One `LinearSlots` per GEMM of `gemm_layout()`; the quantizers of tensor-parallel
        operands replaced by copies reducing their amax over the TP group
        (`TPLayout.shard_quantizers`)."""
        fq, bq = runtime.fwd_quantizers, runtime.bwd_quantizers
        bwd_groups = tuple(runtime.delayed_groups(fwd=False))
        forward_mode, backward_mode = PassMode.of_recipe(runtime.recipe)
        key = self.quant_binding.plan_key()
        gemms, split = [], False
        for gemm in self.gemm_layout():
            slots = LinearSlots(
                input=fq[gemm.input],
                weight=fq[gemm.weight],
                output=fq[gemm.output],
                grad_output=bq[gemm.grad_output],
                grad_input=bq[gemm.grad_input],
                bwd_groups=bwd_groups,
                reduction_group=reduction_group,
                enrol_key=key,
                forward_mode=forward_mode,
                backward_mode=backward_mode,
            )
            tp = self._tp_layout(gemm.parallel_mode)
            if tp is not None:
                names = ("input", "weight", "output", "grad_output", "grad_input")
                shards = tp.shard_quantizers({n: getattr(slots, n) for n in names})
                slots, split = dataclasses.replace(slots, **shards), True
            gemms.append(slots)
        if split and reduction_group is None:
            self._warn_unreduced_delayed(runtime)
        return ForwardPlan(runtime, reduction_group, tuple(gemms), delayed_anchor(runtime))

    def _linear(
        self,
        x: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        *,
        runtime: ModuleRuntime | None,
        slots: LinearSlots | None,
        cache_slot: str,
        is_first_microbatch: bool | None,
        fp8_output: bool = False,
        fp8_grad_input: bool = False,
        tp: TPLayout | None = None,
        swiglu_input: bool = False,
        swiglu_handoff: SwiGLUGradHandoff | None = None,
    ) -> torch.Tensor:
        """One GEMM triple: exact PyTorch when autocast is off or every operand is high precision,
        else quantized with `slots` (the forward plan's; the weight cached under `cache_slot`);
        `tp` splits it over ranks. `swiglu_input`: `x` is `h = [gate, up]`, the GEMM reads
        `swiglu(h)` (see `quantized_linear`); set only where `slots` is a per-tensor plan.
        `swiglu_handoff`: LayerNormMLP's fc1 -> fc2 gradient cast (`SwiGLUGradHandoff`)."""
        gathered_fp8 = isinstance(weight, GatheredFloat8Weight)
        if runtime is None or (slots.high_precision and not (fp8_output or fp8_grad_input)):
            if gathered_fp8:
                raise RuntimeError(
                    f"{type(self).__name__} {self.role_name!r}: its weight was all-gathered in "
                    "FP8 (dist_quant.fsdp.enable_fp8_all_gather), so it runs only under "
                    "dq.autocast with per-tensor scaling of the weight, not in high precision"
                )
            if tp is not None:
                return parallel_linear_hp(x, weight, bias, tp)
            return F.linear(x, weight.to(x.dtype), None if bias is None else bias.to(x.dtype))
        if slots.forward_mode is not PassMode.QUANTIZED:
            # a high-precision forward: the backward quantizes W^T from the weight it keeps
            if x.requires_grad:
                slots.weight.set_usage(rowwise=False, columnwise=True)
            return quantized_linear(
                x, weight, bias, slots, None, fp8_output=fp8_output,
                fp8_grad_input=fp8_grad_input, tp=tp,
            )  # fmt: skip
        dgrad_quantized = x.requires_grad and slots.backward_mode is PassMode.QUANTIZED
        slots.weight.set_usage(rowwise=True, columnwise=dgrad_quantized)
        if gathered_fp8:  # FSDP2 gathered the bytes `slots.weight` would cast: no re-cast
            weight_q = gathered_weight_operand(
                weight, slots.weight, slots.reduction_group, lambda: f"module {self.role_name!r}"
            )
        else:
            weight_q = self.quantize_weight(
                cache_slot, weight, slots.weight, runtime, is_first_microbatch
            )
        return quantized_linear(
            x,
            weight,
            bias,
            slots,
            weight_q,
            fp8_output=fp8_output,
            fp8_grad_input=fp8_grad_input,
            tp=tp,
            swiglu_input=swiglu_input,
            swiglu_handoff=swiglu_handoff,
        )

    def _gemm(
        self,
        x: torch.Tensor,
        *,
        is_first_microbatch: bool | None,
        fp8_output: bool = False,
        fp8_grad_input: bool = False,
    ) -> torch.Tensor:
        plan = forward_plan(self)
        runtime, slots = (None, None) if plan is None else (plan.runtime, plan.gemms[0])
        tp = self._tp_layout(self.parallel_mode)
        return self._linear(
            x,
            self.weight,
            self.bias,
            runtime=runtime,
            slots=slots,
            cache_slot="weight",
            is_first_microbatch=is_first_microbatch,
            fp8_output=fp8_output,
            fp8_grad_input=fp8_grad_input,
            tp=tp,
        )


def init_linear_(weight: torch.Tensor, bias: torch.Tensor | None, fan_in: int) -> None:
    """nn.Linear's initialisation (torch's `kaiming_uniform_(a=sqrt(5))`, same arithmetic) with the
    unsharded `fan_in`, so a TP shard draws from the distribution of the full layer."""
    gain = nn.init.calculate_gain("leaky_relu", math.sqrt(5))
    std = gain / math.sqrt(fan_in)
    with torch.no_grad():
        weight.uniform_(-math.sqrt(3.0) * std, math.sqrt(3.0) * std)
        if bias is not None:
            bound = 1 / math.sqrt(fan_in)
            bias.uniform_(-bound, bound)


class Linear(LinearBase):
    """`y = x W^T + b` with FP8 operands under autocast; exact `F.linear` when autocast is off.

    Tensor parallel (`tp_group` of more than one rank): `parallel_mode="column"` keeps rows
    `out_features / tp` of the weight (and of the bias) on each rank and returns the output features
    of this rank; `"row"` keeps columns `in_features / tp`, takes this rank's input features,
    sums the partial outputs over the group and adds the full bias once. `sequence_parallel`: the
    input (column) or output (row) is sharded along dim 0, the sequence. `in_features` and
    `out_features` are the full sizes.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        *,
        name: str | None = None,
        tp_group: Any = None,
        parallel_mode: ParallelMode | str | None = None,
        sequence_parallel: bool = False,
        params_dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
    ) -> None:
        owner = f"Linear {name!r}"
        check_sizes(owner, in_features=in_features, out_features=out_features)
        super().__init__(name=name)
        self._init_parallel(owner, tp_group, parallel_mode, sequence_parallel)
        self.in_features, self.out_features = in_features, out_features
        rows, cols = out_features, in_features
        if self.parallel_mode is ParallelMode.COLUMN:
            rows = self._check_divisible(owner, "out_features", out_features)
        elif self.parallel_mode is ParallelMode.ROW:
            cols = self._check_divisible(owner, "in_features", in_features)
        dtype = params_dtype or torch.get_default_dtype()
        self.weight = nn.Parameter(torch.empty(rows, cols, dtype=dtype, device=device))
        self.bias = nn.Parameter(torch.empty(rows, dtype=dtype, device=device)) if bias else None
        if self.tp_size > 1 and self.parallel_mode is not None:
            mark_tp_split(self, "weight", self.parallel_mode.weight_split_dim)
            if self.bias is not None and self.parallel_mode is ParallelMode.COLUMN:
                mark_tp_split(self, "bias", 0)
            elif self.bias is not None and sequence_parallel:
                mark_sequence_parallel(self.bias)  # row + SP: each rank sums its own rows
        self.reset_parameters()

    def reset_parameters(self) -> None:
        # nn.Linear's initialisation, so convert_model and fresh modules start alike
        init_linear_(self.weight, self.bias, self.in_features)

    def forward(
        self,
        x: torch.Tensor,
        *,
        is_first_microbatch: bool | None = None,
        fp8_output: bool = False,
        fp8_grad_input: bool = False,
    ) -> torch.Tensor:
        return self._gemm(
            x,
            is_first_microbatch=is_first_microbatch,
            fp8_output=fp8_output,
            fp8_grad_input=fp8_grad_input,
        )

    def extra_repr(self) -> str:
        tp = (
            f", parallel_mode={self.parallel_mode}, tp_size={self.tp_size}, "
            f"sequence_parallel={self.sequence_parallel}"
            if self.parallel_mode
            else ""
        )
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"bias={self.bias is not None}, name={self.role_name!r}{tp}"
        )
