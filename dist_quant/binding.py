"""A dist-quant module's quantization binding, and the planning of a model's structure.

Every dist-quant module holds one `QuantBinding` (`module.quant_binding`), the only per-module
store: its role names and boundary roles, the runtime the runtime layer installed (`ModuleRuntime`),
the recipe pinned by `apply_recipe` / the coordinator, the forward plan built with that runtime (per
GEMM: quantizers, groups, the amax reduction group, everything the forward needs), the cached
quantized weights and when they are invalid, the key that names the module to the enrolment ops
(`bound(key)` finds the binding), and the private bookkeeping of the forward's fast path, which only
`dist_quant.forward` reads and writes. The runtime (`dist_quant.runtime`), checkpoint loads and CUDA
graphs read and write a module's quantization only through this object's methods.

A module that owns quantizers declares its slots to the runtime through `BoundModule` (slot counts,
roles, device, validation, the forward plan); `assign_role_names` plans a model's structure: names
from paths, boundary roles, the planned root (the unit of a lazy recipe switch).

This file sits below `context` and `runtime` (it imports neither): the autocast region asks it which
modules are still unplanned, and the runtime plans against the protocol declared here.
"""

from __future__ import annotations

import copy
import itertools
import warnings
import weakref
from collections.abc import Hashable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import torch
from torch import nn

from dist_quant.roles import QuantizerRole

if TYPE_CHECKING:
    from dist_quant.recipes import Recipe
    from dist_quant.runtime import ModuleRuntime


@dataclass(frozen=True)
class ForwardPlan:
    """What one forward of a module needs, built once per runtime and amax reduction group (at plan
    time where the group is known, else by the first forward under it)."""

    runtime: ModuleRuntime
    reduction_group: Any
    """The autocast region's amax reduction group the plan's quantizers and groups reduce over."""
    gemms: tuple
    """Per GEMM, in the module's order, the module's slot object (`LinearSlots`, attention slots;
    None where that GEMM runs in high precision)."""
    enrol_anchor: torch.Tensor | None
    """One of the runtime's delayed-scaling scale buffers when the forward must enrol its groups in
    the region's amax reduction (see `dist_quant.forward`); None when there is nothing to enrol."""


class BoundModule(Protocol):
    """What the runtime plans against: a module that declares its quantizer slots."""

    quant_binding: QuantBinding
    owns_quantizers: bool

    @property
    def role_name(self) -> str: ...

    def num_quantizers(self, *, fwd: bool) -> int: ...

    def get_quantizer_roles(
        self, *, fwd: bool, num_quantizers: int
    ) -> list[QuantizerRole | None]: ...

    def quantizer_device(self) -> torch.device: ...

    def validate_quantizers(
        self, quantizers: list, roles: tuple, *, fwd: bool, recipe: Recipe
    ) -> None: ...

    def plan_forward(self, runtime: ModuleRuntime, reduction_group: Any) -> ForwardPlan: ...

    def _wire_boundary_roles(self) -> None: ...


STATE_DICT_TRANSPARENT = ("_checkpoint_wrapped_module", "_fsdp_wrapped_module")
"""Attributes under which torch's wrappers hold the module they wrap and which their state-dict
hooks drop from the keys: the activation-checkpoint and offload wrappers (`checkpoint_wrapper`,
torchtitan's way of checkpointing every block) and FSDP1."""

WRAPPER_ATTRIBUTES = frozenset((*STATE_DICT_TRANSPARENT, "_orig_mod"))
"""Path segments role names skip: those wrappers, and torch.compile's `OptimizedModule` (whose
state-dict keys keep `_orig_mod`), so a module is named by its place in the model, wrapped or not."""


def _key_tag(key: int) -> torch.Tensor:
    """A 0-dim int64 CPU tensor holding `key` (see `dist_quant.forward`); on the CPU even
    when the module is built under `with torch.device("meta")` (torchtitan's trainer), where a
    default-device tag would hold no key."""
    return torch.tensor(key, dtype=torch.int64, device="cpu")


class QuantBinding:
    """One module's quantization binding, the only per-module store: names and roles, the installed
    runtime and pinned recipe, the forward plan, the weight cache and the enrolment key. Read
    freely. Writers: the runtime layer (`install`, `pin`, `clear`), planning (role names,
    `set_output_role` / `set_grad_input_role`, `gather_weight_in_fp8`) and `dist_quant.forward`,
    which alone reads and writes the private fields of the forward's fast path."""

    def __init__(self, explicit_name: str | None) -> None:
        self.explicit_name = explicit_name
        self.path_name: str | None = None
        self.output_role: QuantizerRole | None = None
        self.grad_input_role: QuantizerRole | None = None
        self.role_revision = 0
        self.planned = False
        self._root: weakref.ref[nn.Module] | None = None  # see `planned_root`
        self._register()
        self._runtime: ModuleRuntime | None = None
        self._pinned: Recipe | None = None
        self._weights: dict[str, tuple[tuple, Any]] = {}  # slot -> (tag, quantized weight)
        self.fp8_gathered_weights: dict[int, str] = {}
        """Forward weight slot -> its parameter's name, for the weights FSDP2 all-gathers in FP8
        (`dist_quant.fsdp.enable_fp8_all_gather`): every runtime planned for the module must give
        those slots a quantizer the gather can serve (the module's `validate_quantizers`)."""
        # ---- the forward's fast path (`dist_quant.forward` reads and writes these) ----
        self._plan: ForwardPlan | None = None
        # the recipe revision at which `_runtime` was last found current (-1: resolve at the next
        # forward), autocast's recipe key then, and the role revision the runtime was planned from
        self._seen_revision = -1
        self._resolved_for: Any = None
        self._planned_roles = -1
        self._warned_override = False
        self._last_runtime: ModuleRuntime | None = None
        # the runtime whose delayed groups carry this module's name (named once per runtime), and
        # what the last compiled forward enrolled, for its compiled backward (which gets the key)
        self._named_runtime: ModuleRuntime | None = None
        self._traced_runtime: ModuleRuntime | None = None
        self._traced_group: Any = None

    def _register(self) -> None:
        self.enrol_key = next(_keys)
        """The key naming the module to the enrolment ops (`bound(key)` finds this binding)."""
        self.enrol_tag = _key_tag(self.enrol_key)
        """`enrol_key` as the ops take it in traced code (a graph input, not a constant)."""
        _by_key[self.enrol_key] = weakref.ref(
            self, lambda _r, k=self.enrol_key: _by_key.pop(k, None)
        )

    def __getstate__(self) -> dict[str, Any]:
        # a copy or an unpickled module keeps its names but not its planned root (a weak
        # reference, which neither pickles nor belongs to the copy): its next plan records one
        state = self.__dict__.copy()
        state["_root"] = None
        return state

    def copied(self) -> QuantBinding:
        """This binding for a copy of its module (deepcopy, unpickling): its own weight cache and
        enrolment key, names kept, the fast path reset."""
        other = copy.copy(self)
        other._weights = dict(self._weights)
        other.fp8_gathered_weights = dict(self.fp8_gathered_weights)
        other._register()
        other._seen_revision = -1
        # a deep copy's runtime holds new buffers: named and enrolled afresh under the new key
        other._named_runtime = other._traced_runtime = other._traced_group = None
        return other

    def plan_key(self) -> int | torch.Tensor:
        """The enrolment key a forward plan carries: `enrol_key`, or `enrol_tag` while
        torch.compile traces (a graph input: the graph and its backward are not specialised on
        it, so identical blocks share them)."""
        return self.enrol_tag if torch.compiler.is_compiling() else self.enrol_key

    # ---- names and roles -----------------------------------------------------------------------
    @property
    def role_name(self) -> str:
        """The hierarchical name used in roles: explicit `name=`, else the path in the model."""
        if self.explicit_name is not None:
            return self.explicit_name
        return self.path_name or ""

    @property
    def is_planned(self) -> bool:
        """Whether the module's names and boundary roles are fixed (see `assign_role_names`)."""
        return self.planned

    def set_path_name(self, name: str) -> None:
        # The first path wins: a module keeps the name its roles were first built with.
        if self.explicit_name is None and self.path_name is None:
            self.path_name = name
            self.roles_changed()

    def set_output_role(self, role: QuantizerRole | None) -> None:
        """Who consumes the module's output (a block wires it between its children)."""
        if role != self.output_role:
            self.output_role = role
            self.roles_changed()

    def set_grad_input_role(self, role: QuantizerRole | None) -> None:
        """Who consumes the module's input gradient."""
        if role != self.grad_input_role:
            self.grad_input_role = role
            self.roles_changed()

    def roles_changed(self) -> None:
        """A role of the module moved: its next forward re-plans its runtime."""
        self.role_revision += 1
        self._seen_revision = -1

    def gather_weight_in_fp8(self, slot: int, name: str) -> None:
        """FSDP2 all-gathers the weight of forward `slot` (parameter `name`) in FP8."""
        self.fp8_gathered_weights[slot] = name

    # ---- the installed runtime ----------------------------------------------------------------
    @property
    def runtime(self) -> ModuleRuntime | None:
        """The runtime the module runs under autocast, or None before its first plan."""
        return self._runtime

    @property
    def recipe(self) -> Recipe | None:
        """The recipe of the installed runtime."""
        return None if self._runtime is None else self._runtime.recipe

    @property
    def pinned_recipe(self) -> Recipe | None:
        """The recipe `apply_recipe` / the coordinator / a checkpoint load pinned: the module runs
        it whatever autocast's `recipe=` says; None: it follows autocast."""
        return self._pinned

    @property
    def forward_plan(self) -> ForwardPlan | None:
        """The installed runtime's plan for the amax reduction group of the module's last forward
        (built at publish, or by that forward), or None: not built yet."""
        return self._plan

    @property
    def last_runtime(self) -> ModuleRuntime | None:
        """The runtime of the module's last eager forward (None: autocast off), for recompute."""
        return self._last_runtime

    def install(self, runtime: ModuleRuntime, plan: ForwardPlan | None = None) -> None:
        """Make `runtime` active (publish); `plan` is its forward plan where one was built."""
        self._runtime = runtime
        self._plan = plan
        # A cached FP8 weight is only valid under the runtime key it was quantized with.
        self.invalidate_weight_cache(keep_runtime_key=runtime.key)
        self._seen_revision = -1
        self._planned_roles = self.role_revision  # planned just now, from these roles

    def pin(self, recipe: Recipe | None) -> None:
        self._pinned = recipe

    def clear(self) -> None:
        """No runtime, no pinned recipe, no cached weight (a checkpoint taken before any recipe)."""
        self._runtime, self._pinned, self._plan = None, None, None
        self.invalidate_weight_cache()
        self._seen_revision = -1

    # ---- cached quantized weights --------------------------------------------------------------
    def cached_weight(self, slot: str, tag: tuple | None = None) -> Any:
        """The quantized weight cached for `slot` (only if cached under `tag`, when given)."""
        entry = self._weights.get(slot)
        if entry is None or (tag is not None and entry[0] != tag):
            return None
        return entry[1]

    def cached_weights(self) -> dict[str, Any]:
        """Every cached quantized weight by slot."""
        return {slot: entry[1] for slot, entry in self._weights.items()}

    def cache_weight(self, slot: str, tag: tuple, weight: Any) -> None:
        """`tag` = (runtime key, weight version, weight pointer): what the copy is valid for."""
        self._weights[slot] = (tag, weight)

    def invalidate_weight_cache(self, keep_runtime_key: Hashable | None = None) -> None:
        """Drop the cached weights, except those quantized under `keep_runtime_key`."""
        self._weights = {
            slot: entry
            for slot, entry in self._weights.items()
            if keep_runtime_key is not None and entry[0][0] == keep_runtime_key
        }


_keys = itertools.count()
_by_key: dict[int, weakref.ref[QuantBinding]] = {}


def bound(key: int) -> QuantBinding:
    """The live binding of enrolment key `key`, or RuntimeError naming the key."""
    ref = _by_key.get(key)
    binding = None if ref is None else ref()
    if binding is None:
        raise RuntimeError(f"dist_quant::enrol: no live module has key {key}")
    return binding


def binding_of(module: nn.Module) -> QuantBinding | None:
    """`module`'s binding, or None for a module that is not a dist-quant module."""
    binding = module.__dict__.get("quant_binding")
    return binding if isinstance(binding, QuantBinding) else None


# ---- modules not planned yet (read by autocast's call planner in `dist_quant.context`) -----------
_unplanned: weakref.WeakSet[nn.Module] = weakref.WeakSet()
_unplanned_generation = 0
_walked: weakref.WeakKeyDictionary[nn.Module, int] = weakref.WeakKeyDictionary()


def add_unplanned(module: nn.Module) -> None:
    global _unplanned_generation
    _unplanned.add(module)
    _unplanned_generation += 1


def any_unplanned() -> bool:
    return bool(_unplanned)


def planned_root(module: BoundModule) -> nn.Module | None:
    """The outermost model `module` was planned in (its unit of a lazy recipe switch), if alive."""
    ref = module.quant_binding._root
    return None if ref is None else ref()


def assign_role_names(model: nn.Module, names: Mapping[nn.Module, str] | None = None) -> None:
    """Plan `model`'s structure: every dist-quant module under it that has no name yet takes its
    path in `model` (under an explicitly named module the path restarts at that name:
    `name="mlp"` -> `mlp.fc1`), or the name `names` gives it (a checkpoint's); a module planned for
    the first time then wires its boundary roles. Names already set are kept: a module keeps the
    name its roles were first built with, and replanning from an inner module gives the same paths.

    A module reached at two paths (the same object used twice) keeps the first path in
    `named_modules` order, with a warning naming both. `model` becomes the planned root (the unit
    of a lazy recipe switch) of every module under it, unless it was planned inside a larger model.
    """
    names = names or {}
    # torch.compile's wrapper holds the model as `_orig_mod`: names are the model's own paths
    model = getattr(model, "_orig_mod", model)
    prefix_of: dict[str, str] = {}  # structural path -> the role-name prefix of its children
    first_path: dict[int, str] = {}
    warned: set[str] = set()  # paths of reported second uses, and everything below them
    reached: list[nn.Module] = []
    for path, module in model.named_modules(remove_duplicate=False):
        binding = binding_of(module)
        parent, _, leaf = path.rpartition(".")
        if not path:
            candidate = ""
        elif leaf in WRAPPER_ATTRIBUTES:  # a wrapper's module is named as the wrapper
            candidate = prefix_of[parent]
        else:
            base = prefix_of[parent]
            candidate = f"{base}.{leaf}" if base else leaf
        if id(module) in first_path:
            if path and parent in warned:
                warned.add(path)
            elif binding is not None:
                warned.add(path)
                warnings.warn(
                    f"{type(module).__name__} {binding.role_name!r} is used at two places in "
                    f"the model ({first_path[id(module)]!r} and {path!r}): both uses share one "
                    f"module, its quantizer roles (named {binding.role_name!r}, the first path) "
                    "and its scaling state",
                    stacklevel=3,
                )
        else:
            first_path[id(module)] = path
            if binding is not None:
                binding.set_path_name(names.get(module, candidate))
                reached.append(module)
        prefix_of[path] = binding.role_name if binding is not None else candidate
    inside = set(first_path)
    for module in reached:
        binding = module.quant_binding
        if not binding.planned:
            binding.planned = True
            module._wire_boundary_roles()
        root = planned_root(module)
        if root is None or id(root) in inside:
            binding._root = weakref.ref(model)
        _unplanned.discard(module)


def plan_called_module(module: nn.Module) -> None:
    """Autocast's call planner: `module` was just called while unplanned modules exist; it plans
    the unplanned modules below it (itself included), as the root they are found under. Each
    module's subtree is searched once per generation of the unplanned set."""
    generation = _unplanned_generation
    if _walked.get(module) == generation:
        return
    _walked[module] = generation
    if any(m in _unplanned for m in module.modules()):
        assign_role_names(module)


@contextmanager
def provisional_role_names(model: nn.Module) -> Iterator[None]:
    """Inside the block, `assign_role_names` may plan `model` (to stage a checkpoint load against
    the roles it will have); on exit every module's names, boundary roles, role revision and
    planned state are as they were before."""
    bindings = [(m, b) for m in model.modules() if (b := binding_of(m)) is not None]
    saved = [
        (
            m,
            b,
            (b.path_name, b.output_role, b.grad_input_role, b.role_revision, b.planned, b._root),
            m in _unplanned,
        )
        for m, b in bindings
    ]
    try:
        yield
    finally:
        for m, b, fields, unplanned in saved:
            (b.path_name, b.output_role, b.grad_input_role, b.role_revision, b.planned, b._root) = (
                fields
            )
            b._seen_revision = -1
            if unplanned:
                add_unplanned(m)
