"""`convert_model`: swap an existing model's `nn.Linear`s (and LayerNorm + Linear pairs) for
dist-quant modules in place, keeping the very same Parameter objects (optimizer state, tied
weights and checkpoints keep pointing at them).

- Every module whose type is exactly `nn.Linear` becomes a `Linear`. Subclasses are left alone:
  their forward may do something else with the weight.
- Inside an `nn.Sequential`, an `nn.LayerNorm` (affine, with bias, normalizing the Linear's
  `in_features`) directly followed by a converted Linear is unambiguous: the norm's output feeds
  that Linear and nothing else. The pair becomes one `LayerNormLinear` in the Linear's position
  and an `nn.Identity` in the norm's, so the other indices stay put.
- The walk is post-order (children before their parent); dist-quant modules are not entered.
- `module_filter_fn(module, fqn) -> bool` is asked about each `nn.Linear` (fqn: its dotted path
  in `model`); False keeps it, and a norm in front of it, as they are.

Role names come from the new modules' paths in the model, as for any unnamed dist-quant module.
"""

from __future__ import annotations

from collections.abc import Callable

from torch import nn

from dist_quant.modules.base import QuantizedModule
from dist_quant.modules.layernorm_linear import LayerNormLinear
from dist_quant.modules.linear import Linear

ModuleFilter = Callable[[nn.Module, str], bool]


def _to_linear(lin: nn.Linear) -> Linear:
    # built on the meta device so nothing is allocated, then given the original Parameters
    new = Linear(lin.in_features, lin.out_features, bias=lin.bias is not None, device="meta")
    new.weight = lin.weight
    new.bias = lin.bias
    return new


def _fusable_norm(norm: nn.Module, lin: nn.Linear) -> bool:
    return (
        type(norm) is nn.LayerNorm
        and norm.elementwise_affine
        and norm.bias is not None
        and tuple(norm.normalized_shape) == (lin.in_features,)
    )


def _to_layernorm_linear(norm: nn.LayerNorm, lin: nn.Linear) -> LayerNormLinear:
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
    return new


def _convert_children(module: nn.Module, prefix: str, keep: ModuleFilter) -> None:
    for child_name, child in list(module.named_children()):
        if not isinstance(child, QuantizedModule):
            _convert_children(child, f"{prefix}{child_name}.", keep)
    names = [name for name, _ in module.named_children()]
    for i, child_name in enumerate(names):
        child = getattr(module, child_name)
        if type(child) is not nn.Linear or not keep(child, f"{prefix}{child_name}"):
            continue
        before = getattr(module, names[i - 1]) if i > 0 else None
        if (
            isinstance(module, nn.Sequential)
            and before is not None
            and _fusable_norm(before, child)
        ):
            setattr(module, names[i - 1], nn.Identity())
            setattr(module, child_name, _to_layernorm_linear(before, child))
        else:
            setattr(module, child_name, _to_linear(child))


def convert_model(model: nn.Module, *, module_filter_fn: ModuleFilter | None = None) -> nn.Module:
    """Swap `model`'s `nn.Linear`s (and unambiguous LayerNorm + Linear pairs) for dist-quant
    modules in place; returns `model` (or the new module when `model` itself is an `nn.Linear`)."""
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

    if type(model) is nn.Linear:
        return _to_linear(model) if keep(model, "") else model
    if not isinstance(model, QuantizedModule):
        _convert_children(model, "", keep)
    return model
