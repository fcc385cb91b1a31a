"""Changing the recipe of a model in one process: plan -> validate -> publish.

`plan_model` builds a candidate runtime (forward and backward `RecipeState`s and their quantizers)
for every dist-quant module without touching the active ones, validates every candidate, and returns
a `ModelPlan`. `ModelPlan.publish()` swaps all modules' runtimes, then drops cached quantized weights
whose recipe key changed. `apply_recipe` does both and pins the recipe on the model. Any failure
raises `RecipeUpdateError` naming module, role and cause, with the model exactly as before.

Delayed-scaling state across a transition (the rule, per module and direction):
- same state class, slot count and history length: the candidate re-binds the active scale and amax
  history tensors (`inherit_state_from`), so nothing is lost; a changed margin, algorithm or format
  maximum recomputes the scale from the kept history at publish;
- same slots but another history length: the newest entries and the scale are copied;
- anything else (other slots, other formats, or no delayed state before): a fresh state, with a log
  line when delayed state existed and is dropped. DS -> CS -> DS therefore starts from scale 1 and an
  empty history: nothing stale from before the CS phase is restored.
"""

from __future__ import annotations

import hashlib
import logging
import os
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field

import torch
from torch import nn

from dist_quant import context as _context
from dist_quant.binding import BoundModule, ForwardPlan, assign_role_names, binding_of
from dist_quant.factory_keys import parts_of
from dist_quant.kinds import Direction
from dist_quant.recipes import CustomRecipe, Recipe
from dist_quant.roles import QuantizerRole
from dist_quant.state import RecipeState

log = logging.getLogger("dist_quant.runtime")


class RecipeUpdateError(ValueError):
    """A recipe change was refused; the model is exactly as it was before the call."""


@dataclass
class ModuleRuntime:
    """The quantization setup a module runs with: built from one recipe and its roles."""

    recipe: Recipe
    recipe_key: Hashable
    fwd_roles: tuple
    bwd_roles: tuple
    fwd_state: RecipeState
    bwd_state: RecipeState
    fwd_quantizers: list
    bwd_quantizers: list
    _groups: dict[bool, list] = field(default_factory=dict, repr=False, compare=False)

    @property
    def key(self) -> tuple:
        return (self.recipe_key, self.fwd_roles, self.bwd_roles)

    def __post_init__(self) -> None:
        # built with the runtime, not on first use: a forward traced by torch.compile would
        # otherwise fill the cache while tracing and guard on it (a retrace on the next call)
        self._groups = {
            True: list(self.fwd_state.delayed_groups()),
            False: list(self.bwd_state.delayed_groups()),
        }

    def delayed_groups(self, fwd: bool) -> list:
        """The state's delayed-scaling groups, built once per runtime: every forward asks, and the
        buffers they view never change identity after publish (updates and loads work in place)."""
        return self._groups[fwd]


@dataclass
class ModuleCandidate:
    module: BoundModule
    runtime: ModuleRuntime
    unchanged: bool
    state_notes: list[str] = field(default_factory=list)
    on_publish: list[Callable[[], None]] = field(default_factory=list)
    forward_plan: ForwardPlan | None = None
    """Built for the amax reduction group of the module's installed plan (None without one)."""


@dataclass
class UpdateReport:
    """What `apply_recipe` / `ModelPlan.publish` changed."""

    recipe_key: Hashable
    changed: list[str] = field(default_factory=list)
    kept: list[str] = field(default_factory=list)
    inherited: list[str] = field(default_factory=list)
    reset: list[str] = field(default_factory=list)


def _error(name: str, cause: BaseException) -> RecipeUpdateError:
    """A RecipeUpdateError that names the module once (state errors often name it already)."""
    text = str(cause)
    prefix = f"module {name!r}"
    return RecipeUpdateError(text if text.startswith(prefix) else f"{prefix}: {text}")


def _roles_of(module: BoundModule, fwd: bool) -> tuple:
    n = module.num_quantizers(fwd=fwd)
    return tuple(module.get_quantizer_roles(fwd=fwd, num_quantizers=n))


def _carry_delayed_state(old: RecipeState | None, new: RecipeState, where: str) -> tuple[str, list]:
    """Move delayed-scaling buffers from `old` into `new` per the module docstring's rule."""
    new_groups = new.delayed_groups()
    old_groups = old.delayed_groups() if old is not None else []
    if not old_groups:
        return "", []
    if not new_groups:
        log.info("%s: delayed-scaling state dropped (the new recipe keeps no history)", where)
        return f"{where}: reset", []
    same_meaning = len(old_groups) == len(new_groups) and all(
        o.amax_history.shape[1] == n.amax_history.shape[1] and torch.equal(o.fp8_max, n.fp8_max)
        for o, n in zip(old_groups, new_groups)
    )
    if same_meaning and type(old) is type(new) and new.inherit_state_from(old):
        hooks = []
        # after inherit, new's groups view old's tensors; margin/algo come from the new recipe
        for g_new, g_old in zip(new.delayed_groups(), old_groups):
            if (g_new.margin, g_new.algo) != (g_old.margin, g_old.algo):
                hooks.append(g_new.rescale_from_history)
        return f"{where}: inherited", hooks
    if same_meaning:
        for o, n in zip(old_groups, new_groups):
            k = min(o.amax_history.shape[0], n.amax_history.shape[0]) - 1
            n.amax_history[0].copy_(o.amax_history[0])
            if k > 0:
                n.amax_history[-k:].copy_(o.amax_history[-k:])
            n.scale.copy_(o.scale)
        return f"{where}: inherited (history resized, newest entries kept)", []
    log.info("%s: delayed-scaling state reset (slots or formats changed meaning)", where)
    return f"{where}: reset", []


def plan_module(
    module: BoundModule, recipe: Recipe, recipe_key: Hashable | None = None
) -> ModuleCandidate:
    """Build (not publish) the runtime `module` would run under `recipe`; raises RecipeUpdateError."""
    name = module.role_name or type(module).__name__
    if recipe_key is None:
        recipe_key = recipe.key()
    try:
        fwd_roles = _roles_of(module, fwd=True)
        bwd_roles = _roles_of(module, fwd=False)
    except Exception as e:
        raise RecipeUpdateError(f"module {name!r}: cannot compute quantizer roles: {e}") from e
    binding = module.quant_binding
    active: ModuleRuntime | None = binding.runtime
    if active is not None and active.key == (recipe_key, fwd_roles, bwd_roles):
        return ModuleCandidate(module, active, unchanged=True)
    device = module.quantizer_device()
    try:
        fwd_state = RecipeState.create(
            recipe,
            mode=Direction.FORWARD,
            num_quantizers=len(fwd_roles),
            roles=list(fwd_roles),
            device=device,
            module_name=name,
        )
        bwd_state = RecipeState.create(
            recipe,
            mode=Direction.BACKWARD,
            num_quantizers=len(bwd_roles),
            roles=list(bwd_roles),
            device=device,
            module_name=name,
        )
    except (ValueError, TypeError, NotImplementedError) as e:
        raise _error(name, e) from e
    except RuntimeError as e:  # the allocator: e.g. an amax history too large for the device
        raise _error(name, RuntimeError(f"cannot allocate its recipe state: {e}")) from e
    notes, hooks = [], []
    for old, new, where in (
        (active.fwd_state if active else None, fwd_state, f"{name} forward"),
        (active.bwd_state if active else None, bwd_state, f"{name} backward"),
    ):
        note, h = _carry_delayed_state(old, new, where)
        if note:
            notes.append(note)
        hooks.extend(h)
    try:
        fwd_q = fwd_state.make_quantizers()
        bwd_q = bwd_state.make_quantizers()
    except (ValueError, TypeError) as e:
        raise _error(name, e) from e
    _tag_slots(fwd_q, fwd_roles, name, "forward")
    _tag_slots(bwd_q, bwd_roles, name, "backward")
    rt = ModuleRuntime(recipe, recipe_key, fwd_roles, bwd_roles, fwd_state, bwd_state, fwd_q, bwd_q)
    candidate = ModuleCandidate(module, rt, unchanged=False, state_notes=notes, on_publish=hooks)
    validate_candidate(candidate)
    last = binding.forward_plan
    if last is not None:  # a forward ran: plan for the amax reduction group it ran under
        try:
            candidate.forward_plan = module.plan_forward(rt, last.reduction_group)
        except (ValueError, TypeError, NotImplementedError) as e:
            raise _error(name, e) from e
    return candidate


def stats_slot(module_name: str, role: QuantizerRole | None, index: int, direction: str) -> tuple:
    """A slot's telemetry name: (its role's name, else the module's; the role's tensor type, else
    `slot<index>`; direction). Role names are what factories key on (`layers.0.mlp.fc2` inside a
    LayerNormMLP `layers.0.mlp`), so a slot reports under the name a fallback recipe would target."""
    name = role.name if role is not None and role.name else module_name
    tensor_type = role.tensor_type if role is not None and role.tensor_type else f"slot{index}"
    return (name, tensor_type, direction)


def _tag_slots(quantizers: list, roles: tuple, module_name: str, direction: str) -> None:
    """Name each quantizer's slot for telemetry (`Quantizer.stats_slot`). A factory that hands
    one object to several slots: it reports as the last of them."""
    for i, (q, role) in enumerate(zip(quantizers, roles)):
        q.stats_slot = stats_slot(module_name, role, i, direction)


EMULATION_ENV = "DIST_QUANT_EMULATE_FP8"
"""Set to 1 to run FP8 recipes emulated on a CUDA GPU without FP8 tensor cores (slow)."""


def _gpu_without_fp8(device: torch.device) -> bool:
    """A CUDA GPU older than compute capability 8.9 (Ada / Hopper), which has no FP8 GEMMs."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device) < (8, 9)


def validate_candidate(candidate: ModuleCandidate) -> None:
    """Every slot got a quantizer this module supports, and the device can run it; raises
    RecipeUpdateError naming the module and role."""
    rt, module = candidate.runtime, candidate.module
    name = module.role_name or type(module).__name__
    try:
        module.validate_quantizers(rt.fwd_quantizers, rt.fwd_roles, fwd=True, recipe=rt.recipe)
        module.validate_quantizers(rt.bwd_quantizers, rt.bwd_roles, fwd=False, recipe=rt.recipe)
    except (ValueError, TypeError, NotImplementedError) as e:
        raise _error(name, e) from e
    # Identity-only recipes (BF16) run anywhere; FP8 ones are emulated exactly on CPUs, but on an
    # old GPU emulation would be a silent, large slowdown, so it must be asked for.
    device = module.quantizer_device()
    if _gpu_without_fp8(device) and os.environ.get(EMULATION_ENV) != "1":
        pairs = zip((*rt.fwd_quantizers, *rt.bwd_quantizers), (*rt.fwd_roles, *rt.bwd_roles))
        for q, role in pairs:
            if q.scaling.needs_fp8_gemm:
                raise RecipeUpdateError(
                    f"module {name!r}: role {role} needs an FP8 GEMM, which "
                    f"{torch.cuda.get_device_name(device)} (compute capability "
                    f"{'.'.join(map(str, torch.cuda.get_device_capability(device)))}) does not "
                    f"have; set {EMULATION_ENV}=1 to run it emulated, or use an identity recipe "
                    "such as 'bf16'"
                )


def publish_candidates(candidates: list[ModuleCandidate], recipe_key: Hashable) -> UpdateReport:
    """Swap every module's runtime, then drop cached weights whose recipe changed. Cannot fail
    half-way: only attribute assignments and the state hooks prepared at plan time run here."""
    report = UpdateReport(recipe_key)
    for c in candidates:
        label = c.module.role_name or type(c.module).__name__
        if c.unchanged:
            report.kept.append(label)
            continue
        c.module.quant_binding.install(c.runtime, c.forward_plan)
        for hook in c.on_publish:
            hook()
        report.changed.append(label)
        for note in c.state_notes:
            (report.reset if note.endswith("reset") else report.inherited).append(note)
    _context.bump_recipe_revision()
    return report


def dist_quant_modules(model: nn.Module) -> list[BoundModule]:
    """Every dist-quant module that owns quantizers, in `named_modules` order, names assigned."""
    assign_role_names(model)
    return [m for m in model.modules() if binding_of(m) is not None and m.owns_quantizers]


@dataclass
class ModelPlan:
    """Validated candidates for a whole model; nothing is active until `publish()`."""

    model: nn.Module
    recipe: Recipe
    recipe_key: Hashable
    candidates: list[ModuleCandidate]
    digest: str
    part_digests: dict[str, str] = field(default_factory=dict)
    """For a factory answering by named parts (a policy's rules), the digest of each part's
    slots: what names the rule when a TP group's digests differ. Empty for other recipes."""

    def publish(self, *, pin: bool = True) -> UpdateReport:
        report = publish_candidates(self.candidates, self.recipe_key)
        if pin:
            for c in self.candidates:
                c.module.quant_binding.pin(self.recipe)
        return report


def quantizers_fingerprint(candidates: list[ModuleCandidate]) -> str:
    """Digest of every planned slot's quantizer, so ranks of a TP group that would quantize one
    tensor differently (a factory answering per rank) cannot agree on a digest. Each quantizer
    describes itself (`Quantizer.describe`)."""
    h = hashlib.sha256()
    for c in candidates:
        rt = c.runtime
        described = [q.describe() for q in (*rt.fwd_quantizers, *rt.bwd_quantizers)]
        h.update(repr(described).encode())
    return h.hexdigest()


def part_fingerprints(recipe: Recipe, candidates: list[ModuleCandidate]) -> dict[str, str]:
    """Digest of each named part's slots (`factory_keys.answered_by_parts`): role and quantizer
    of every slot the part answers, so a part that answers one rank differently from another
    changes that part's digest only."""
    part_of = parts_of(recipe.qfactory) if isinstance(recipe, CustomRecipe) else None
    if part_of is None:
        return {}
    slots: dict[str, list] = {}
    for c in candidates:
        rt = c.runtime
        for fwd, quantizers in ((True, rt.fwd_quantizers), (False, rt.bwd_quantizers)):
            for role, q in zip(_roles_of(c.module, fwd), quantizers):
                slots.setdefault(part_of(role), []).append((repr(role), q.describe()))
    return {
        part: hashlib.sha256(repr(described).encode()).hexdigest()
        for part, described in sorted(slots.items())
    }


def roles_fingerprint(modules: list[BoundModule]) -> str:
    h = hashlib.sha256()
    for m in modules:
        h.update(repr((m.role_name, _roles_of(m, True), _roles_of(m, False))).encode())
    return h.hexdigest()


def plan_modules(
    modules: list[BoundModule], recipe: Recipe, recipe_key: Hashable
) -> list[ModuleCandidate]:
    """Plan and validate every module; the first failure raises and nothing is published."""
    return [plan_module(m, recipe, recipe_key) for m in modules]


def plan_model(model: nn.Module, recipe: Recipe) -> ModelPlan:
    """Plan and validate `recipe` for every dist-quant module of `model` (branches that have not run
    yet included). Raises RecipeUpdateError at the first failure; nothing active is touched."""
    if not isinstance(recipe, Recipe):
        raise RecipeUpdateError(f"expected a dist_quant Recipe, got {type(recipe).__name__}")
    try:
        recipe_key = recipe.key()
    except Exception as e:
        raise RecipeUpdateError(
            f"recipe {type(recipe).__name__}: cannot compute its key: {e}"
        ) from e
    modules = dist_quant_modules(model)
    candidates = plan_modules(modules, recipe, recipe_key)
    digest = hashlib.sha256(
        repr(recipe_key).encode()
        + roles_fingerprint(modules).encode()
        + quantizers_fingerprint(candidates).encode()
    ).hexdigest()
    parts = part_fingerprints(recipe, candidates)
    return ModelPlan(model, recipe, recipe_key, candidates, digest, parts)


def apply_recipe(model: nn.Module, recipe: Recipe) -> UpdateReport:
    """Switch every dist-quant module of `model` to `recipe` atomically; returns what changed.

    Refused inside autocast (a step would run with two recipes) and during CUDA graph capture.
    """
    if _context.in_autocast():
        raise RecipeUpdateError("apply_recipe is refused inside autocast: call it between steps")
    if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
        raise RecipeUpdateError("apply_recipe is refused during CUDA graph capture")
    return plan_model(model, recipe).publish()


def current_recipe(model: nn.Module) -> Recipe | None:
    """The recipe every dist-quant module of `model` runs, or None if they have none or differ."""
    keys, recipe = set(), None
    for m in dist_quant_modules(model):
        rt = m.quant_binding.runtime
        if rt is None:
            return None
        keys.add(rt.recipe_key)
        recipe = rt.recipe
    return recipe if len(keys) == 1 else None


def recipe_key_of(model: nn.Module) -> Hashable | None:
    r = current_recipe(model)
    return None if r is None else r.key()
