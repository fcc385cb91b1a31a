"""`convert_model`: swap an existing model's Linears (and LayerNorm + Linear pairs) for dist-quant
modules in place, keeping the very same Parameter objects (optimizer state, tied weights and
checkpoints keep pointing at them).

- A module is Linear-like when it is an `nn.Linear` whose class keeps `nn.Linear.forward`:
  `nn.Linear` itself and framework subclasses such as torchtitan's `Linear(nn.Linear, Module)`.
  Each becomes a dist-quant `Linear`; a subclass's other bases (torchtitan's `Module`, with its
  `init_states` and `_param_init` lookup) are mixed into the new module's class, so the framework
  still recognises and initialises it. A subclass that overrides `forward` is left alone: its
  forward may do something else with the weight.
- What a framework hangs on the module instance comes along: its attributes (`_param_init`,
  `_extra_repr`, ...) and its hooks (forward, backward, state-dict, load-state-dict).
- Inside an `nn.Sequential`, an `nn.LayerNorm` (affine, with bias, normalizing the Linear's
  `in_features`) directly followed by a converted plain `nn.Linear` is unambiguous: the norm's
  output feeds that Linear and nothing else. The pair becomes one `LayerNormLinear` in the
  Linear's position and an `nn.Identity` in the norm's, so the other indices stay put.
- The walk is post-order (children before their parent); dist-quant modules are not entered.
- `module_filter_fn(module, fqn) -> bool` is asked about each Linear-like module (fqn: its
  dotted path in `model`); False keeps it, and a norm in front of it, as they are.
- Parameters on the meta device stay there: convert before `to_empty` / weight init as a
  framework's trainer does, and the framework's init reaches the new modules.

`convert_model_with_report` returns a `ConversionReport`: what was converted, what was left
alone and why. `convert_model` logs that report (logger `dist_quant.convert`) and warns when a
model with Linears gets no module converted (training would silently stay in high precision).

Role names come from the new modules' paths in the model, as for any unnamed dist-quant module.
"""

from __future__ import annotations

import dataclasses
import logging
import warnings
from collections.abc import Callable

from torch import nn
from torch.nn.utils import parametrize

from dist_quant.modules.base import QuantizedModule
from dist_quant.modules.layernorm_linear import LayerNormLinear
from dist_quant.modules.linear import Linear

ModuleFilter = Callable[[nn.Module, str], bool]

logger = logging.getLogger(__name__)

# nn.Module's own bookkeeping: the new module has its own, except the hook tables (carried over)
_HOOK_TABLES = (
    "_forward_hooks",
    "_forward_hooks_with_kwargs",
    "_forward_hooks_always_called",
    "_forward_pre_hooks",
    "_forward_pre_hooks_with_kwargs",
    "_backward_hooks",
    "_backward_pre_hooks",
    "_state_dict_hooks",
    "_state_dict_pre_hooks",
    "_load_state_dict_pre_hooks",
    "_load_state_dict_post_hooks",
)
_MODULE_INTERNALS = frozenset(nn.Linear(1, 1, device="meta").__dict__) | {"_is_full_backward_hook"}


@dataclasses.dataclass(frozen=True)
class Skipped:
    """A Linear-like (or Linear subclass) module left as it was."""

    fqn: str
    type_name: str
    reason: str


@dataclasses.dataclass(frozen=True)
class ConversionReport:
    """What `convert_model_with_report` did to a model."""

    model: nn.Module
    """The converted model (a new module when the root itself was a Linear)."""
    converted: tuple[tuple[str, str, str], ...]
    """(fqn, original type, new type) per converted module, in walk order."""
    skipped: tuple[Skipped, ...]
    """Each `nn.Linear` (or subclass) left alone, with the reason."""
    linears_seen: int
    """`nn.Linear` instances (subclasses included) found outside dist-quant modules."""

    def summary(self) -> str:
        lines = [f"convert_model: {len(self.converted)} of {self.linears_seen} Linears converted"]
        lines += [
            f"  converted {fqn or '<root>'}: {old} -> {new}" for fqn, old, new in self.converted
        ]
        lines += [
            f"  left alone {s.fqn or '<root>'} ({s.type_name}): {s.reason}" for s in self.skipped
        ]
        return "\n".join(lines)


def linear_like(module: nn.Module) -> bool:
    """An `nn.Linear` whose class keeps `nn.Linear.forward` (so `F.linear(x, weight, bias)` is
    all its forward does); dist-quant modules are not."""
    return (
        isinstance(module, nn.Linear)
        and not isinstance(module, QuantizedModule)
        and type(module).forward is nn.Linear.forward
    )


_CLASS_CACHE: dict[type, type] = {}


def _mixins(cls: type) -> tuple[type, ...]:
    """The bases a Linear subclass adds besides nn.Linear (torchtitan's `Module`), in MRO order."""
    out: list[type] = []
    for base in cls.__bases__:
        if issubclass(base, nn.Linear):
            out += [m for m in _mixins(base) if m not in out] if base is not nn.Linear else []
        elif base not in out and base not in (nn.Module, object):
            out.append(base)
    return tuple(out)


def _target_class(cls: type) -> type:
    """dist-quant's `Linear`, with the framework bases of a Linear subclass mixed in after it."""
    mixins = _mixins(cls)
    if not mixins:
        return Linear
    if cls not in _CLASS_CACHE:
        _CLASS_CACHE[cls] = type(
            f"DistQuant{cls.__name__}",
            (Linear, *mixins),
            {"__module__": __name__, "__doc__": f"dist-quant Linear converted from {cls!r}"},
        )
    return _CLASS_CACHE[cls]


def _why_not(lin: nn.Linear) -> str | None:
    """Why a Linear-like module cannot be swapped exactly, or None."""
    if parametrize.is_parametrized(lin):
        return "it has parametrizations (its weight is computed, not a Parameter)"
    if len(lin._modules):
        return f"it has child modules ({', '.join(lin._modules)}) the swap would not call"
    if not isinstance(lin.weight, nn.Parameter):
        return f"its weight is a {type(lin.weight).__name__}, not a Parameter"
    return None


def _carry_over(old: nn.Module, new: nn.Module, fqn: str) -> None:
    """The instance attributes and hooks a framework hung on `old`, onto `new`."""
    for table in _HOOK_TABLES:
        theirs, ours = old.__dict__.get(table), new.__dict__.get(table)
        if theirs:  # the handles a framework holds point at its table: keep that one
            for hook_id, hook in ours.items():
                theirs.setdefault(hook_id, hook)
            new.__dict__[table] = theirs
    for name, value in old.__dict__.items():
        if name in _MODULE_INTERNALS or name in _HOOK_TABLES:
            continue
        if name in new.__dict__ or hasattr(Linear, name):
            warnings.warn(
                f"convert_model: {fqn or '<root>'}: attribute {name!r} of the "
                f"{type(old).__name__} is not carried over: dist-quant's Linear defines its own",
                UserWarning,
                stacklevel=4,
            )
            continue
        new.__dict__[name] = value
    new.train(old.training)


def _to_linear(lin: nn.Linear, fqn: str) -> Linear:
    # built on the meta device so nothing is allocated, then given the original Parameters
    cls = _target_class(type(lin))
    new = cls(lin.in_features, lin.out_features, bias=lin.bias is not None, device="meta")
    new.weight = lin.weight
    new.bias = lin.bias
    _carry_over(lin, new, fqn)
    return new


def _fusable_norm(norm: nn.Module, lin: nn.Linear) -> bool:
    return (
        type(norm) is nn.LayerNorm
        and type(lin) is nn.Linear  # a subclass's framework hooks have no place in the pair
        and norm.elementwise_affine
        and norm.bias is not None
        and tuple(norm.normalized_shape) == (lin.in_features,)
        and not norm._forward_hooks
        and not norm._forward_pre_hooks
    )


def _to_layernorm_linear(norm: nn.LayerNorm, lin: nn.Linear, fqn: str) -> LayerNormLinear:
    new = LayerNormLinear(
        lin.in_features,
        lin.out_features,
        bias=lin.bias is not None,
        normalization="LayerNorm",
        eps=norm.eps,
        device="meta",
    )
    new.layer_norm_weight = norm.weight
    new.layer_norm_bias = norm.bias
    new.weight = lin.weight
    new.bias = lin.bias
    _carry_over(lin, new, fqn)
    return new


class _Walk:
    def __init__(self, keep: ModuleFilter) -> None:
        self.keep = keep
        self.converted: list[tuple[str, str, str]] = []
        self.skipped: list[Skipped] = []
        self.seen = 0

    def decide(self, child: nn.Module, fqn: str) -> bool:
        """True to convert `child`; a Linear left alone is recorded with its reason."""
        if not isinstance(child, nn.Linear) or isinstance(child, QuantizedModule):
            return False
        self.seen += 1
        name = type(child).__name__
        if not linear_like(child):
            reason = f"{name}.forward overrides nn.Linear.forward (it may use the weight otherwise)"
            self.skipped.append(Skipped(fqn, name, reason))
            return False
        reason = _why_not(child)
        if reason is None and not self.keep(child, fqn):
            reason = "module_filter_fn returned False"
        if reason is not None:
            self.skipped.append(Skipped(fqn, name, reason))
            return False
        return True

    def children(self, module: nn.Module, prefix: str) -> None:
        for child_name, child in list(module.named_children()):
            if not isinstance(child, QuantizedModule):
                self.children(child, f"{prefix}{child_name}.")
        names = [name for name, _ in module.named_children()]
        for i, child_name in enumerate(names):
            child, fqn = getattr(module, child_name), f"{prefix}{child_name}"
            if not self.decide(child, fqn):
                continue
            before = getattr(module, names[i - 1]) if i > 0 else None
            if (
                isinstance(module, nn.Sequential)
                and before is not None
                and _fusable_norm(before, child)
            ):
                setattr(module, names[i - 1], nn.Identity())
                new = _to_layernorm_linear(before, child, fqn)
            else:
                new = _to_linear(child, fqn)
            setattr(module, child_name, new)
            self.converted.append((fqn, type(child).__name__, type(new).__name__))


def convert_model_with_report(
    model: nn.Module, *, module_filter_fn: ModuleFilter | None = None
) -> ConversionReport:
    """`convert_model`, returning what it converted and what it left alone (nothing logged)."""
    if module_filter_fn is not None and not callable(module_filter_fn):
        raise ValueError(
            f"convert_model: module_filter_fn must be callable(module, fqn) -> bool, "
            f"got {module_filter_fn!r}"
        )

    def keep(module: nn.Module, fqn: str) -> bool:
        if module_filter_fn is None:
            return True
        answer = module_filter_fn(module, fqn)
        if not isinstance(answer, bool):
            raise ValueError(
                f"convert_model: module_filter_fn returned {answer!r} for {fqn!r}; expected a bool"
            )
        return answer

    walk = _Walk(keep)
    if isinstance(model, nn.Linear) and not isinstance(model, QuantizedModule):
        if walk.decide(model, ""):
            new = _to_linear(model, "")
            walk.converted.append(("", type(model).__name__, type(new).__name__))
            model = new
    elif not isinstance(model, QuantizedModule):
        walk.children(model, "")
    return ConversionReport(model, tuple(walk.converted), tuple(walk.skipped), walk.seen)


def convert_model(model: nn.Module, *, module_filter_fn: ModuleFilter | None = None) -> nn.Module:
    """Swap `model`'s Linear-like modules (and unambiguous LayerNorm + Linear pairs) for dist-quant
    modules in place; returns `model` (or the new module when `model` itself is a Linear).

    The report is logged at INFO; a model with Linears of which none was converted warns."""
    report = convert_model_with_report(model, module_filter_fn=module_filter_fn)
    logger.info("%s", report.summary())
    if report.linears_seen and not report.converted:
        warnings.warn(
            f"convert_model converted none of the model's {report.linears_seen} Linears, so it "
            "trains in high precision: "
            + "; ".join(
                f"{s.fqn or '<root>'} ({s.type_name}): {s.reason}" for s in report.skipped[:5]
            )
            + ("; ..." if len(report.skipped) > 5 else ""),
            UserWarning,
            stacklevel=2,
        )
    return report.model
