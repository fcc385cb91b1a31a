"""`QuantizedModule`: what every dist-quant module shares.

A module that owns quantizers declares its slots (`num_quantizers`, `get_quantizer_roles`), its
boundary roles, its extra state and its forward plan (`plan_forward`: per GEMM, the slot objects its
forward runs), and keeps the cache of its quantized weights. It decides nothing about what a forward
runs: its forward asks `dist_quant.forward.forward_plan(self)` once, which reads and writes the
module's `quant_binding` (`dist_quant.binding.QuantBinding`).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from dist_quant import context as _context
from dist_quant.binding import ForwardPlan, QuantBinding
from dist_quant.checkpoint.module_state import load_module_extra_state, module_extra_state
from dist_quant.forward import delayed_anchor
from dist_quant.fsdp_tensor import gatherable_in_fp8
from dist_quant.kinds import PassMode
from dist_quant.quantizers import IdentityQuantizer, Quantizer
from dist_quant.recipes import Recipe
from dist_quant.roles import QuantizerRole
from dist_quant.runtime import ModuleRuntime


def check_sizes(owner: str, **sizes: object) -> None:
    """The one check of every module constructor's sizes: ValueError naming `owner`, the first
    argument that is not an int >= 1 and its value. A bool is not a size (`Linear(True, 4)` is a
    bug, not `Linear(1, 4)`), nor is a float, however whole."""
    for field, value in sizes.items():
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{owner}: {field} must be an int >= 1, got {value!r}")


class QuantizedModule(nn.Module):
    """Base of dist-quant modules. Subclasses that own quantizers set `owns_quantizers = True`.

    `quant_binding` is the module's quantization binding (installed runtime, pinned recipe, forward
    plan, cached weights, role names): see `dist_quant.binding.QuantBinding`."""

    module_type: str = ""
    owns_quantizers: bool = False

    def __init__(self, name: str | None = None) -> None:
        super().__init__()
        if name is not None and not isinstance(name, str):
            raise ValueError(f"{type(self).__name__}(name=...) must be a str, got {name!r}")
        self.quant_binding = QuantBinding(name)
        _context.track_unplanned(self)

    def __setstate__(self, state: dict[str, Any]) -> None:
        # a copy or an unpickled module keeps its names but not its planned root: the next plan
        # (or call under autocast) records the root again; it enrols as itself
        super().__setstate__(state)
        self.quant_binding = self.quant_binding.copied()
        _context.track_unplanned(self)

    # ---- names and roles -------------------------------------------------------------------
    @property
    def role_name(self) -> str:
        """The hierarchical name used in roles: explicit `name=`, else the path in the model."""
        return self.quant_binding.role_name

    @property
    def is_planned(self) -> bool:
        """Whether this module's names and boundary roles are fixed (it was part of a planned
        model: `apply_recipe`, a call under autocast, `attach`, a checkpoint load)."""
        return self.quant_binding.planned

    def _wire_boundary_roles(self) -> None:
        """Called once, when the module is first planned and every module below it is named: a
        block sets the roles of the slots between its children here (see MultiheadAttention)."""

    def num_quantizers(self, *, fwd: bool) -> int:
        raise NotImplementedError(f"{type(self).__name__} owns no quantizers")

    def get_quantizer_roles(self, *, fwd: bool, num_quantizers: int) -> list[QuantizerRole | None]:
        raise NotImplementedError(f"{type(self).__name__} owns no quantizers")

    def _check_num_quantizers(self, fwd: bool, num_quantizers: int) -> None:
        expected = self.num_quantizers(fwd=fwd)
        if num_quantizers != expected:
            direction = "forward" if fwd else "backward"
            raise ValueError(
                f"{type(self).__name__} {self.role_name!r} has {expected} {direction} quantizer "
                f"slots, asked for {num_quantizers}"
            )

    @property
    def output_quantizer_role(self) -> QuantizerRole | None:
        """Role of the output slot: who consumes this module's output (e.g. `dpa/qkv`)."""
        return self.quant_binding.output_role

    @output_quantizer_role.setter
    def output_quantizer_role(self, role: QuantizerRole | None) -> None:
        if role is not None and not isinstance(role, QuantizerRole):
            raise ValueError(f"output_quantizer_role must be a QuantizerRole or None, got {role!r}")
        self.quant_binding.set_output_role(role)

    @property
    def grad_input_quantizer_role(self) -> QuantizerRole | None:
        """Role of the grad-input slot: who consumes this module's input gradient."""
        return self.quant_binding.grad_input_role

    @grad_input_quantizer_role.setter
    def grad_input_quantizer_role(self, role: QuantizerRole | None) -> None:
        if role is not None and not isinstance(role, QuantizerRole):
            raise ValueError(
                f"grad_input_quantizer_role must be a QuantizerRole or None, got {role!r}"
            )
        self.quant_binding.set_grad_input_role(role)

    # ---- checkpoints: recipe and scaling state (format and rules in checkpoint/module_state.py) --
    def get_extra_state(self) -> dict[str, Any]:
        return module_extra_state(self)

    def set_extra_state(self, state: Any) -> None:
        """Validates everything first; raises ValueError / RecipeUpdateError leaving it unchanged."""
        load_module_extra_state(self, state)

    # ---- validation hook for runtime.validate_candidate -------------------------------------
    def validate_quantizers(
        self, quantizers: list, roles: tuple, *, fwd: bool, recipe: Recipe
    ) -> None:
        """Raise ValueError naming the role if a slot got a quantizer this module cannot use under
        `recipe` (plan time: nothing has been quantized yet)."""
        for q, role in zip(quantizers, roles):
            if not isinstance(q, Quantizer):
                raise TypeError(f"slot {role} got {type(q).__name__}, not a Quantizer")
        if not fwd:
            return
        gathered = self.quant_binding.fp8_gathered_weights
        if gathered and PassMode.of_recipe(recipe) != (PassMode.QUANTIZED, PassMode.QUANTIZED):
            raise ValueError(
                f"{type(recipe).__name__} overrides a pass (forward_override / backward_override),"
                f" but FSDP2 all-gathers {', '.join(map(repr, gathered.values()))} in FP8 "
                "(dist_quant.fsdp.enable_fp8_all_gather), whose bytes only a quantized forward "
                "and backward can use; drop the override or build the model without "
                "enable_fp8_all_gather"
            )
        for slot, weight in gathered.items():
            if not gatherable_in_fp8(quantizers[slot]):
                raise ValueError(
                    f"role {roles[slot]} got {quantizers[slot]!r} from {type(recipe).__name__}, "
                    f"but FSDP2 all-gathers the weight {weight!r} in FP8 "
                    "(dist_quant.fsdp.enable_fp8_all_gather), which needs per-tensor (delayed or "
                    "current) scaling of it: per-block scales or high precision cannot be cast "
                    "before the all-gather. Keep a per-tensor recipe, or build the model without "
                    "enable_fp8_all_gather"
                )

    def quantizer_device(self) -> torch.device:
        for p in self.parameters():
            return p.device
        return torch.device("cpu")

    def plan_forward(self, runtime: ModuleRuntime, reduction_group: Any) -> ForwardPlan:
        """What a forward under `runtime` needs (built at plan time, or by the first forward under
        a new amax reduction group): subclasses with GEMMs add their slot objects. The default
        enrols the runtime's delayed-scaling groups, if any, and runs no GEMM."""
        return ForwardPlan(runtime, reduction_group, (), delayed_anchor(runtime))

    # ---- cached quantized weights ------------------------------------------------------------
    def quantize_weight(
        self,
        slot: str,
        weight: torch.Tensor,
        quantizer: Quantizer,
        runtime: ModuleRuntime,
        is_first_microbatch: bool | None,
    ) -> Any:
        """Quantize `weight`, or reuse the cached copy across microbatches.

        `is_first_microbatch=None` always quantizes; True quantizes and caches; False reuses the cache
        when it was built under the same runtime key from the same weight version, else re-quantizes.
        """
        if (
            is_first_microbatch is None
            or isinstance(quantizer, IdentityQuantizer)
            or torch.compiler.is_compiling()  # a traced forward cannot keep Python-side copies
        ):
            return quantizer.quantize(weight)
        tag = (runtime.key, weight._version, weight.data_ptr())
        binding = self.quant_binding
        if is_first_microbatch is False:
            cached = binding.cached_weight(slot, tag)
            if cached is not None:
                return cached
        qw = quantizer.quantize(weight)
        binding.cache_weight(slot, tag, qw)
        return qw
