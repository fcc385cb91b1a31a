"""`LayerNormLinear`: LayerNorm or RMSNorm followed by one quantized GEMM.

The normalization runs in high precision (plain PyTorch autograd); only the GEMM's operands are
quantized, with `Linear`'s slots (Transformer Engine's order):
    forward  [linear/input, linear/weight, output_quantizer_role]
    backward [linear/grad_output, grad_input_quantizer_role]

`NormLinearBase` here, which owns the norm, is shared with `LayerNormMLP`.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from dist_quant.kinds import ParallelMode
from dist_quant.modules.base import check_sizes
from dist_quant.modules.linear import LinearBase, init_linear_
from dist_quant.parallel import mark_sequence_parallel, mark_tp_split

NORMALIZATIONS = ("LayerNorm", "RMSNorm")


def check_normalization(owner: str, normalization: object, eps: object) -> None:
    """ValueError naming the owner unless `normalization` and `eps` are valid."""
    if normalization not in NORMALIZATIONS:
        raise ValueError(
            f"{owner}: normalization must be one of {', '.join(NORMALIZATIONS)}, "
            f"got {normalization!r}"
        )
    if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not 0 <= eps < math.inf:
        raise ValueError(f"{owner}: eps must be a finite number >= 0, got {eps!r}")


def apply_norm(
    x: torch.Tensor,
    normalization: str,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    eps: float,
) -> torch.Tensor:
    """The normalization in `x`'s dtype, exactly `F.layer_norm` / `F.rms_norm`."""
    shape = (x.shape[-1],)
    if normalization == "LayerNorm":
        return F.layer_norm(x, shape, weight.to(x.dtype), bias.to(x.dtype), eps)
    return F.rms_norm(x, shape, weight.to(x.dtype), eps)


class NormLinearBase(LinearBase):
    """A `LinearBase` whose first GEMM reads `norm(x)`: the one owner of the norm's parameters
    (`layer_norm_weight`, and `layer_norm_bias` for LayerNorm), their initialisation, their
    sequence-parallel marking and the norm itself (`LayerNormLinear`, `LayerNormMLP`)."""

    normalization: str
    eps: float

    def _init_norm(
        self,
        normalization: str,
        eps: float,
        hidden_size: int,
        dtype: torch.dtype,
        device: torch.device | str | None,
    ) -> None:
        """Register the norm's parameters (validated first by `check_normalization`)."""
        self.normalization, self.eps = normalization, float(eps)
        self.layer_norm_weight = nn.Parameter(torch.ones(hidden_size, dtype=dtype, device=device))
        if normalization == "LayerNorm":
            self.layer_norm_bias = nn.Parameter(
                torch.zeros(hidden_size, dtype=dtype, device=device)
            )
        else:
            self.register_parameter("layer_norm_bias", None)

    def _mark_norm_sequence_parallel(self) -> None:
        """Under SP the norm's parameter gradients are partial sums over this rank's sequence
        rows."""
        mark_sequence_parallel(self.layer_norm_weight)
        if self.layer_norm_bias is not None:
            mark_sequence_parallel(self.layer_norm_bias)

    def _reset_norm_parameters(self) -> None:
        # the norm starts as the identity affine map
        nn.init.ones_(self.layer_norm_weight)
        if self.layer_norm_bias is not None:
            nn.init.zeros_(self.layer_norm_bias)

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        return apply_norm(
            x, self.normalization, self.layer_norm_weight, self.layer_norm_bias, self.eps
        )


class LayerNormLinear(NormLinearBase):
    """`Linear(norm(x))`; with `return_layernorm_output=True` forward returns `(y, norm(x))`.

    Tensor parallel: `parallel_mode="column"` only (the norm needs whole rows); each rank keeps
    `out_features / tp` weight rows. With `sequence_parallel` the norm runs on this rank's sequence
    shard, and its output is all-gathered (as FP8 bytes for per-tensor FP8 input slots) before the
    GEMM; `return_layernorm_output` then returns the local shard. The norm's parameters are marked
    `sequence_parallel` (see `dist_quant.parallel.allreduce_sequence_parallel_grads`).
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        *,
        normalization: str = "LayerNorm",
        eps: float = 1e-5,
        return_layernorm_output: bool = False,
        name: str | None = None,
        tp_group=None,
        parallel_mode: ParallelMode | str | None = None,
        sequence_parallel: bool = False,
        params_dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
    ) -> None:
        owner = f"LayerNormLinear {name!r}"
        check_sizes(owner, in_features=in_features, out_features=out_features)
        super().__init__(name=name)
        check_normalization(owner, normalization, eps)
        if not isinstance(return_layernorm_output, bool):
            raise ValueError(
                f"{owner}: return_layernorm_output must be a bool, got {return_layernorm_output!r}"
            )
        # the norm needs whole rows (all input features), so only the output features can split
        self._init_parallel(
            owner, tp_group, parallel_mode, sequence_parallel, modes=(ParallelMode.COLUMN,)
        )
        self.in_features, self.out_features = in_features, out_features
        self.return_layernorm_output = return_layernorm_output
        dtype = params_dtype or torch.get_default_dtype()
        self._init_norm(normalization, eps, in_features, dtype, device)
        rows = out_features
        if self.parallel_mode is ParallelMode.COLUMN:
            rows = self._check_divisible(owner, "out_features", out_features)
        self.weight = nn.Parameter(torch.empty(rows, in_features, dtype=dtype, device=device))
        self.bias = nn.Parameter(torch.empty(rows, dtype=dtype, device=device)) if bias else None
        if self.tp_size > 1:
            mark_tp_split(self, "weight", 0)
            if self.bias is not None:
                mark_tp_split(self, "bias", 0)
            if sequence_parallel:  # the norm sees only this rank's sequence rows
                self._mark_norm_sequence_parallel()
        self.reset_parameters()

    def reset_parameters(self) -> None:
        # nn.Linear's initialisation for the GEMM
        self._reset_norm_parameters()
        init_linear_(self.weight, self.bias, self.in_features)

    def forward(
        self,
        x: torch.Tensor,
        *,
        is_first_microbatch: bool | None = None,
        fp8_output: bool = False,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        # no fp8_grad_input: the GEMM's input gradient still has to go through the norm's backward
        ln_out = self._norm(x)
        y = self._gemm(ln_out, is_first_microbatch=is_first_microbatch, fp8_output=fp8_output)
        return (y, ln_out) if self.return_layernorm_output else y

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"bias={self.bias is not None}, normalization={self.normalization}, "
            f"name={self.role_name!r}"
        )
