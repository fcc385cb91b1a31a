"""Recipe states: the quantizers of one module in one direction, and the buffers they persist.

`RecipeState.create(recipe, mode=..., num_quantizers=..., roles=...)` picks the subclass for the
recipe. A state owns its persistent buffers (delayed scaling's scale `(n,)` and amax history
`(L, n)`), hands out fresh quantizer objects from `make_quantizers()` (delayed ones are views into
those buffers), exposes the buffers to the amax reduction as `DelayedGroup`s, and can take over
another state's buffers across a rebuild (`inherit_state_from`) so that no history is lost.
"""

from __future__ import annotations

import abc
import copy
import dataclasses
import zlib
from collections.abc import Callable, Sequence

import torch
from torch import Tensor

from dist_quant.formats import Format
from dist_quant.kernels import reference
from dist_quant.kinds import AmaxAlgo, Direction, PassMode, parse_kind
from dist_quant.nvfp4 import NVFP4Quantizer
from dist_quant.quantizers import (
    Float8BlockQuantizer,
    Float8CurrentScalingQuantizer,
    Float8Quantizer,
    IdentityQuantizer,
    MXFP8Quantizer,
    Quantizer,
)
from dist_quant.recipes import (
    CustomRecipe,
    DelayedScaling,
    Float8BlockScaling,
    Float8CurrentScaling,
    HighPrecision,
    MXFP8BlockScaling,
    NVFP4BlockScaling,
    Recipe,
)
from dist_quant.roles import DelayedScalingRequest, QuantizerRequest, QuantizerRole


@dataclasses.dataclass(frozen=True, eq=False)
class DelayedGroup:
    """Delayed-scaling slots sharing one scale / amax history: the unit `amax.py` packs,
    reduces and updates. The tensors are the state's own buffers; `update()` works in place."""

    scale: Tensor  # (n,) fp32
    amax_history: Tensor  # (L, n) fp32; row 0 is this step's accumulator
    fp8_max: Tensor  # (n,) fp32, the largest value of each slot's FP8 dtype
    margin: int
    algo: AmaxAlgo | Callable
    """An `AmaxAlgo` (given as one or its spelling), or TE's
    `amax_compute_algo(amax_history (L, n)) -> amax (n,)`."""
    reduce_amax: bool
    scaling_factor_compute_algo: Callable | None = None
    """TE's `f(amax (n,), scale (n,), fp8_max (n,), recipe) -> new scale (n,)`; None: default."""
    recipe: Recipe | None = None
    """Passed to `scaling_factor_compute_algo` (it may read the margin from it)."""

    def __post_init__(self) -> None:
        if not callable(self.algo):
            object.__setattr__(self, "algo", parse_kind(AmaxAlgo, self.algo, "DelayedGroup.algo"))

    @property
    def is_standard(self) -> bool:
        """Updated by the reference formula alone (a fused kernel can do many such groups)."""
        return isinstance(self.algo, AmaxAlgo) and self.scaling_factor_compute_algo is None

    def update(self) -> None:
        """One step: amax from the history, new scale, history rolled; all in place.

        The step's amax row must already be reduced across ranks (`amax.py` does it).
        """
        if self.is_standard:
            reference.delayed_scaling_update(
                self.amax_history, self.scale, self.fp8_max, margin=self.margin, algo=self.algo
            )
            return
        n = self.scale.shape[0]
        if callable(self.algo):
            amax = _per_slot(self.algo(self.amax_history), n, "amax_compute_algo")
        else:
            amax = reference.delayed_amax(self.amax_history, self.algo)
        if self.scaling_factor_compute_algo is None:
            new = reference.delayed_scale(amax, self.scale, self.fp8_max, margin=self.margin)
        else:
            new = self.scaling_factor_compute_algo(amax, self.scale, self.fp8_max, self.recipe)
            new = _per_slot(new, n, "scaling_factor_compute_algo")
        self.scale.copy_(new)
        reference.roll_amax_history(self.amax_history)

    def rescale_from_history(self) -> None:
        """At a step boundary, recompute the scale from the kept history under this group's
        margin and algorithm (`reference.rescale_from_history`). A callable algorithm or scale
        function decides at its next update instead: the runtime does not call user code while
        publishing, which must not fail half-way."""
        if self.is_standard:
            reference.rescale_from_history(
                self.amax_history, self.scale, self.fp8_max, margin=self.margin, algo=self.algo
            )


def _per_slot(value: object, n: int, what: str) -> Tensor:
    if not isinstance(value, Tensor) or tuple(value.shape) != (n,):
        got = tuple(value.shape) if isinstance(value, Tensor) else type(value).__name__
        raise ValueError(f"{what} must return a tensor of shape ({n},), got {got}")
    return value.to(torch.float32)


class RecipeState(abc.ABC):
    """Quantizers and persistent buffers of one module in one direction under one recipe."""

    recipe: Recipe

    def __init__(
        self,
        recipe: Recipe,
        *,
        mode: Direction,
        num_quantizers: int,
        roles: tuple[QuantizerRole | None, ...],
        device: torch.device,
        module_name: str,
    ) -> None:
        # arguments are checked by create(); construct states through it
        self.recipe = recipe
        self.mode = mode
        self.num_quantizers = num_quantizers
        self.roles = roles
        self.device = device
        self.module_name = module_name

    @staticmethod
    def create(
        recipe: Recipe,
        *,
        mode: Direction | str = Direction.FORWARD,
        num_quantizers: int = 1,
        roles: Sequence[QuantizerRole | None] | None = None,
        device: torch.device | str | None = None,
        module_name: str | None = None,
    ) -> RecipeState:
        """The state for `recipe`; `roles` (one per slot, None allowed) default to all None.

        `module_name` names the module in error messages where a slot's role has no name.
        """
        if not isinstance(recipe, Recipe):
            raise TypeError(f"RecipeState.create: expected a Recipe, got {type(recipe).__name__}")
        cls = _STATE_CLASSES.get(type(recipe))
        if cls is None:
            raise NotImplementedError(f"RecipeState.create: no state for {type(recipe).__name__}")
        direction = parse_kind(Direction, mode, "RecipeState.create: mode")
        if (
            direction is Direction.BACKWARD
            and PassMode.of_recipe(recipe)[1] is not PassMode.QUANTIZED
        ):
            # a high-precision or dequantized backward quantizes nothing: no backward state
            cls = HighPrecisionRecipeState
        n = num_quantizers
        if not isinstance(n, int) or isinstance(n, bool) or n < 0:
            raise ValueError(f"RecipeState.create: num_quantizers must be an int >= 0, got {n!r}")
        if roles is None:
            roles = (None,) * num_quantizers
        if isinstance(roles, (str, bytes)) or not isinstance(roles, Sequence):
            raise ValueError(f"RecipeState.create: roles must be a list, got {roles!r}")
        if len(roles) != num_quantizers:
            raise ValueError(
                f"RecipeState.create: {len(roles)} roles for num_quantizers={num_quantizers}"
                f"{f' (module {module_name!r})' if module_name else ''}"
            )
        for i, role in enumerate(roles):
            if role is not None and not isinstance(role, QuantizerRole):
                raise ValueError(
                    f"RecipeState.create: roles[{i}] must be a QuantizerRole or None, got {role!r}"
                )
        try:
            dev = torch.device("cpu" if device is None else device)
        except (RuntimeError, TypeError) as e:
            raise ValueError(f"RecipeState.create: bad device {device!r}: {e}") from e
        return cls(
            recipe,
            mode=direction,
            num_quantizers=num_quantizers,
            roles=tuple(roles),
            device=dev,
            module_name=module_name or "",
        )

    @abc.abstractmethod
    def make_quantizers(self) -> list[Quantizer]:
        """One new quantizer object per slot, in slot order."""

    def persistent_buffers(self) -> dict[str, Tensor]:
        """The tensors that carry state across steps (and into checkpoints); empty if none."""
        return {}

    def delayed_groups(self) -> list[DelayedGroup]:
        """The delayed-scaling groups the amax reduction updates; empty if none."""
        return []

    def inherit_state_from(self, other: RecipeState) -> bool:
        """Re-bind this state's persistent buffers to `other`'s tensor objects (nothing copied).

        Only when both are the same class and every buffer matches in name, shape, dtype and
        device; otherwise returns False and changes neither. Whether the buffers *mean* the same
        (same roles, formats) is the caller's decision. Quantizers made before this call keep
        viewing the old buffers: call `make_quantizers()` again.
        """
        if type(other) is not type(self):
            return False
        mine, theirs = self.persistent_buffers(), other.persistent_buffers()
        if mine.keys() != theirs.keys():
            return False
        for name, t in mine.items():
            o = theirs[name]
            if (t.shape, t.dtype, t.device) != (o.shape, o.dtype, o.device):
                return False
        for name, o in theirs.items():
            setattr(self, name, o)
        return True

    def _fp8_dtype(self, fmt: Format) -> torch.dtype:
        return self.mode.fp8_dtype(fmt)

    def _module_of(self, role: QuantizerRole | None) -> str:
        name = role.name if role is not None and role.name else self.module_name
        return f"module {name!r}" if name else "unnamed module"

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}({type(self.recipe).__name__}, mode={self.mode.value!r}, "
            f"num_quantizers={self.num_quantizers}, module={self.module_name!r})"
        )


def _fp8_max_tensor(fp8_dtype: torch.dtype, n: int, device: torch.device) -> Tensor:
    return torch.full((n,), reference.fp8_max(fp8_dtype), dtype=torch.float32, device=device)


class DelayedScalingRecipeState(RecipeState):
    """Per-tensor delayed scaling: one scale `(n,)` and one amax history `(L, n)` for all slots."""

    recipe: DelayedScaling

    def __init__(self, recipe: DelayedScaling, **kwargs) -> None:
        super().__init__(recipe, **kwargs)
        n = self.num_quantizers
        self.fp8_dtype = self._fp8_dtype(recipe.fp8_format)
        self.scale = torch.ones(n, dtype=torch.float32, device=self.device)
        self.amax_history = torch.zeros(
            recipe.amax_history_len, n, dtype=torch.float32, device=self.device
        )
        self._fp8_max = _fp8_max_tensor(self.fp8_dtype, n, self.device)

    def make_quantizers(self) -> list[Quantizer]:
        return [
            Float8Quantizer(self.scale[i : i + 1], self.amax_history[0, i : i + 1], self.fp8_dtype)
            for i in range(self.num_quantizers)
        ]

    def persistent_buffers(self) -> dict[str, Tensor]:
        return {"scale": self.scale, "amax_history": self.amax_history}

    def delayed_groups(self) -> list[DelayedGroup]:
        r = self.recipe
        return [
            DelayedGroup(
                self.scale,
                self.amax_history,
                self._fp8_max,
                r.margin,
                r.amax_compute_algo,
                r.reduce_amax,
                r.scaling_factor_compute_algo,
                r,
            )
        ]


class Float8CurrentScalingRecipeState(RecipeState):
    """Per-tensor current scaling: stateless quantizers, the dtype set by the direction."""

    recipe: Float8CurrentScaling

    def make_quantizers(self) -> list[Quantizer]:
        r = self.recipe
        dtype = self._fp8_dtype(r.fp8_format)
        return [
            Float8CurrentScalingQuantizer(
                dtype, use_power_2_scales=r.use_power_2_scales, amax_epsilon=r.amax_epsilon
            )
            for _ in range(self.num_quantizers)
        ]


class MXFP8BlockScalingRecipeState(RecipeState):
    """MXFP8: E4M3 data with E8M0 scales per 32 elements, both directions."""

    recipe: MXFP8BlockScaling

    def make_quantizers(self) -> list[Quantizer]:
        dtype = self._fp8_dtype(self.recipe.fp8_format)
        return [MXFP8Quantizer(fp8_dtype=dtype) for _ in range(self.num_quantizers)]


class Float8BlockScalingRecipeState(RecipeState):
    """Float8 block scaling: 128x128 blocks for weights, 1x128 tiles for everything else.

    A slot is a weight when its role's tensor_type is "weight"; without roles, Transformer
    Engine's slot convention applies: forward slots are (input, weight, output) per GEMM, so
    slot 3k+1 is a weight, and backward slots hold no weights.
    """

    recipe: Float8BlockScaling

    def __init__(self, recipe: Float8BlockScaling, **kwargs) -> None:
        super().__init__(recipe, **kwargs)
        if all(role is None for role in self.roles):
            weights = [self.mode.fwd and i % 3 == 1 for i in range(self.num_quantizers)]
        else:
            weights = [role is not None and role.tensor_type == "weight" for role in self.roles]
        self.block_scaling_dims = tuple(2 if w else 1 for w in weights)

    def make_quantizers(self) -> list[Quantizer]:
        dtype = self._fp8_dtype(self.recipe.fp8_format)
        return [
            Float8BlockQuantizer(
                fp8_dtype=dtype,
                block_scaling_dim=dim,
                use_power_2_scales=self.recipe.use_power_2_scales,
            )
            for dim in self.block_scaling_dims
        ]


class NVFP4BlockScalingRecipeState(RecipeState):
    """NVFP4 per slot, by role: weights in 16x16 blocks (`weight_2d`), the input's and the output
    gradient's columnwise copies through the Hadamard transform (`input_rht`,
    `grad_output_rht`), the output gradient rounded stochastically (`stochastic_rounding`); other
    slots (FP8 boundaries, attention) plain 1x16. Without roles, Transformer Engine's slot order
    applies: forward (input, weight, output) per GEMM, backward (grad_output, grad_input).

    Stochastic rounding draws from `(seed, offset)`: the seed is the recipe's mixed with a digest of
    the module's name, direction and slot (the same on every rank, different per slot), the offset
    a per-slot int64 counter this state owns (`sr_offset`, checkpointed), so a resumed run
    continues the same stream."""

    recipe: NVFP4BlockScaling

    def __init__(self, recipe: NVFP4BlockScaling, **kwargs) -> None:
        super().__init__(recipe, **kwargs)
        if all(role is None for role in self.roles):
            names = ("input", "weight", "output") if self.mode.fwd else ("grad_output", "")
            self.tensor_types = tuple(names[i % len(names)] for i in range(self.num_quantizers))
        else:
            self.tensor_types = tuple("" if r is None else r.tensor_type for r in self.roles)
        self.sr_offset = torch.zeros(self.num_quantizers, dtype=torch.int64)

    def _slot_seed(self, slot: int) -> int:
        salt = zlib.crc32(f"{self.module_name}/{self.mode.value}/{slot}".encode())
        return (self.recipe.seed * 0x9E3779B1 + salt) % 2**31

    def make_quantizers(self) -> list[Quantizer]:
        r = self.recipe
        out: list[Quantizer] = []
        for slot, tensor_type in enumerate(self.tensor_types):
            grad = tensor_type == "grad_output"
            out.append(
                NVFP4Quantizer(
                    block_2d=r.weight_2d and tensor_type == "weight",
                    rht=(r.input_rht and tensor_type == "input") or (r.grad_output_rht and grad),
                    stochastic_rounding=r.stochastic_rounding and grad,
                    seed=self._slot_seed(slot),
                    sr_offset=self.sr_offset[slot : slot + 1],
                    reduce_amax=r.reduce_amax,
                )
            )
        return out

    def persistent_buffers(self) -> dict[str, Tensor]:
        return {"sr_offset": self.sr_offset} if self.num_quantizers else {}


class HighPrecisionRecipeState(RecipeState):
    """All identity: every slot stays in high precision, in both directions (and the backward of
    a recipe whose `backward_override` keeps it out of quantization)."""

    recipe: HighPrecision

    def make_quantizers(self) -> list[Quantizer]:
        return [IdentityQuantizer() for _ in range(self.num_quantizers)]


class CustomRecipeState(RecipeState):
    """Per-slot quantizers from `CustomRecipe.qfactory(role)` (`None` for a slot without a role,
    as API.md says).

    The factory is called once per slot here, so a bad answer fails while planning, and those
    answers serve the first `make_quantizers()`; each later call asks the factory again, so every
    call returns new objects. `DelayedScalingRequest` slots become `Float8Quantizer`s viewing one
    shared scale `(n_ds,)` / amax history `(L, n_ds)`; the requests must agree (see the class).
    An NVFP4 quantizer that rounds stochastically counts its casts in a slot of this state's
    `sr_offset` `(num_quantizers,)` int64 buffer (a copy of the factory's object gets the view, as
    one object may serve several slots), checkpointed like the recipe state's own, so a resumed
    run draws the same bits whichever factory (`factories.nvfp4`, a policy, a fallback) built it.
    """

    recipe: CustomRecipe

    def __init__(self, recipe: CustomRecipe, **kwargs) -> None:
        super().__init__(recipe, **kwargs)
        answers = [self._ask(i) for i in range(self.num_quantizers)]
        self._first_answers: list[Quantizer | DelayedScalingRequest] | None = answers
        self._requests = {
            i: a for i, a in enumerate(answers) if isinstance(a, DelayedScalingRequest)
        }
        self._ds_index = {slot: j for j, slot in enumerate(self._requests)}
        self._sr_slots = frozenset(i for i, a in enumerate(answers) if _rounds_stochastically(a))
        self.sr_offset: Tensor | None = None
        if self._sr_slots:
            self.sr_offset = torch.zeros(self.num_quantizers, dtype=torch.int64)
        self.scale: Tensor | None = None
        self.amax_history: Tensor | None = None
        if not self._requests:
            return
        first_slot, first = next(iter(self._requests.items()))
        if self.mode.fwd and PassMode.of_recipe(recipe)[0] is PassMode.HIGH_PRECISION:
            raise ValueError(
                f"{self._module_of(self.roles[first_slot])}, role {self._role(first_slot)}: "
                "forward_override='high_precision' would cast this delayed-scaling slot in the "
                "backward, after the forward amax reduction; answer a stateless quantizer here"
            )
        self.fp8_dtype = self._fp8_dtype(first.fp8_format)
        for slot, req in self._requests.items():
            self._check_agrees(first_slot, first, slot, req)
        n = len(self._requests)
        self.scale = torch.ones(n, dtype=torch.float32, device=self.device)
        self.amax_history = torch.zeros(
            first.amax_history_len, n, dtype=torch.float32, device=self.device
        )
        self._fp8_max = _fp8_max_tensor(self.fp8_dtype, n, self.device)

    def _role(self, slot: int) -> str:
        """The slot's role for messages; a role-less slot reads `<no role>`."""
        role = self.roles[slot]
        return "<no role>" if role is None else str(role)

    def _ask(self, slot: int) -> Quantizer | DelayedScalingRequest:
        role, factory = self.roles[slot], self.recipe.qfactory
        where = f"{self._module_of(role)}, role {self._role(slot)} (slot {slot})"
        try:
            answer = factory(role)
        except Exception as e:
            raise ValueError(
                f"{where}: quantizer factory {factory!r} raised {type(e).__name__}: {e}"
            ) from e
        if answer is None:
            raise ValueError(
                f"{where}: quantizer factory {factory!r} returned None; return a quantizer "
                "(IdentityQuantizer() for high precision) or a DelayedScalingRequest"
            )
        if isinstance(answer, DelayedScalingRequest) or isinstance(answer, Quantizer):
            return answer
        if isinstance(answer, QuantizerRequest):
            raise NotImplementedError(f"{where}: unsupported request {answer!r}")
        raise TypeError(
            f"{where}: quantizer factory {factory!r} returned a {type(answer).__name__}, not a "
            "Quantizer or DelayedScalingRequest"
        )

    def _check_agrees(
        self, slot0: int, req0: DelayedScalingRequest, slot: int, req: DelayedScalingRequest
    ) -> None:
        mine = {f.name: getattr(req, f.name) for f in dataclasses.fields(req)}
        mine["fp8_format"] = self._fp8_dtype(req.fp8_format)  # HYBRID resolves per direction
        for name, value in mine.items():
            ref = self._fp8_dtype(req0.fp8_format) if name == "fp8_format" else getattr(req0, name)
            if value != ref:
                raise ValueError(
                    f"{self._module_of(self.roles[slot])}: the delayed-scaling requests of one "
                    f"{self.mode} state share one scale/amax history and must agree, but role "
                    f"{self._role(slot0)} (slot {slot0}) has {name}={ref!r} and role "
                    f"{self._role(slot)} (slot {slot}) has {name}={value!r}"
                )

    def make_quantizers(self) -> list[Quantizer]:
        answers, self._first_answers = self._first_answers, None
        out: list[Quantizer] = []
        for slot in range(self.num_quantizers):
            answer = answers[slot] if answers is not None else self._ask(slot)
            if slot in self._requests:
                if answer != self._requests[slot]:
                    raise ValueError(
                        f"{self._module_of(self.roles[slot])}, role {self._role(slot)}: the "
                        f"factory answered {self._requests[slot]!r} when the state was built and "
                        f"{answer!r} now; a factory must answer the same kind for a role"
                    )
                j = self._ds_index[slot]
                answer = Float8Quantizer(
                    self.scale[j : j + 1], self.amax_history[0, j : j + 1], self.fp8_dtype
                )
            elif not isinstance(answer, Quantizer):
                raise ValueError(
                    f"{self._module_of(self.roles[slot])}, role {self._role(slot)}: the factory "
                    f"returned a quantizer when the state was built and {answer!r} now"
                )
            elif (slot in self._sr_slots) != _rounds_stochastically(answer):
                raise ValueError(
                    f"{self._module_of(self.roles[slot])}, role {self._role(slot)}: the factory "
                    f"answered {'a' if slot in self._sr_slots else 'no'} stochastically rounding "
                    f"NVFP4 quantizer when the state was built and {answer!r} now; a factory "
                    "must answer the same kind for a role"
                )
            elif slot in self._sr_slots:
                answer = copy.copy(answer)
                answer.count_sr_in(self.sr_offset[slot : slot + 1])
            out.append(answer)
        return out

    def persistent_buffers(self) -> dict[str, Tensor]:
        out = {} if self.sr_offset is None else {"sr_offset": self.sr_offset}
        if self.scale is not None:
            out.update(scale=self.scale, amax_history=self.amax_history)
        return out

    def delayed_groups(self) -> list[DelayedGroup]:
        if self.scale is None:
            return []
        req = next(iter(self._requests.values()))
        return [
            DelayedGroup(
                self.scale,
                self.amax_history,
                self._fp8_max,
                req.margin,
                req.amax_compute_algo,
                req.reduce_amax,
                recipe=self.recipe,
            )
        ]


def _rounds_stochastically(answer: object) -> bool:
    return isinstance(answer, NVFP4Quantizer) and answer.stochastic_rounding


_STATE_CLASSES: dict[type[Recipe], type[RecipeState]] = {
    DelayedScaling: DelayedScalingRecipeState,
    Float8CurrentScaling: Float8CurrentScalingRecipeState,
    MXFP8BlockScaling: MXFP8BlockScalingRecipeState,
    Float8BlockScaling: Float8BlockScalingRecipeState,
    NVFP4BlockScaling: NVFP4BlockScalingRecipeState,
    CustomRecipe: CustomRecipeState,
    HighPrecision: HighPrecisionRecipeState,
}
