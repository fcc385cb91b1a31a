"""convert_model: swaps nn.Linear and unambiguous LayerNorm + Linear pairs, keeping Parameters."""

import pytest
import torch
from torch import nn

import dist_quant as dq

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


class Custom(nn.Linear):
    """A Linear subclass: its forward may use the weight differently, so it is never swapped."""

    def forward(self, x):
        return super().forward(x) * 2


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(16)  # an attribute, not in a Sequential: not fused
        self.fc = nn.Linear(16, 16)
        self.mlp = nn.Sequential(nn.LayerNorm(16), nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 16))
        self.custom = Custom(16, 16)

    def forward(self, x):
        return self.custom(self.mlp(self.fc(self.norm(x))))


def make() -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(Block(), nn.Linear(16, 8, bias=False)).to(DEVICE)
    with torch.no_grad():
        model[0].mlp[0].weight.uniform_(0.5, 1.5)
        model[0].mlp[0].bias.uniform_(-0.5, 0.5)
    return model


def test_swaps_linears_and_fuses_layernorm_pairs_keeping_parameter_objects():
    model = make()
    params = dict(model.named_parameters())
    x = torch.randn(4, 16, device=DEVICE)
    before = model(x)

    assert dq.convert_model(model) is model
    block = model[0]
    assert type(block.fc) is dq.Linear and type(model[1]) is dq.Linear
    assert type(block.norm) is nn.LayerNorm  # feeds `fc` through forward code, not a Sequential
    assert type(block.mlp[0]) is nn.Identity and type(block.mlp[1]) is dq.LayerNormLinear
    assert type(block.mlp[3]) is dq.Linear and type(block.custom) is Custom
    fused = block.mlp[1]
    assert fused.layer_norm_weight is params["0.mlp.0.weight"]
    assert fused.layer_norm_bias is params["0.mlp.0.bias"]
    assert fused.weight is params["0.mlp.1.weight"] and fused.bias is params["0.mlp.1.bias"]
    assert block.fc.weight is params["0.fc.weight"] and model[1].bias is None
    assert {id(p) for p in model.parameters()} == {id(p) for p in params.values()}

    with dq.autocast(enabled=False):
        after = model(x)
    assert torch.equal(before, after)


def test_converted_model_runs_fp8_with_roles_named_by_path():
    model = dq.convert_model(make())
    with dq.autocast(recipe=dq.Float8CurrentScaling()):
        y = model(torch.randn(4, 16, device=DEVICE))
    y.sum().backward()
    assert model[0].mlp[1].role_name == "0.mlp.1"
    assert model[0].mlp[1].quant_binding.runtime.fwd_roles[0] == dq.QuantizerRole(
        "linear", "input", "0.mlp.1"
    )
    assert model[1].quant_binding.runtime.fwd_roles[1] == dq.QuantizerRole("linear", "weight", "1")


def test_filter_sees_each_linear_with_its_fqn_and_false_keeps_it_and_its_norm():
    seen = []

    def keep_wide(module, fqn):
        seen.append(fqn)
        return module.out_features >= 16

    model = dq.convert_model(make(), module_filter_fn=keep_wide)
    # post-order: the Block's Sequential before the Block's own children, the head last
    assert seen == ["0.mlp.1", "0.mlp.3", "0.fc", "1"]
    assert type(model[1]) is nn.Linear  # 8 outputs: filtered out
    assert type(model[0].mlp[1]) is dq.LayerNormLinear

    def not_mlp_1(module, fqn):
        return fqn != "0.mlp.1"

    model = dq.convert_model(make(), module_filter_fn=not_mlp_1)
    assert type(model[0].mlp[0]) is nn.LayerNorm and type(model[0].mlp[1]) is nn.Linear

    with pytest.raises(ValueError, match="returned 1 for '0.mlp.1'"):
        dq.convert_model(make(), module_filter_fn=lambda m, fqn: 1)


def test_root_linear_and_dist_quant_modules():
    lin = nn.Linear(4, 4).to(DEVICE)
    new = dq.convert_model(lin)
    assert type(new) is dq.Linear and new.weight is lin.weight and new.bias is lin.bias
    mlp = dq.LayerNormMLP(8, 16)
    assert dq.convert_model(mlp) is mlp  # already dist-quant: left as it is
    with pytest.raises(ValueError, match="module_filter_fn must be callable"):
        dq.convert_model(lin, module_filter_fn="fc")


# ---- Linear subclasses a framework builds (torchtitan's `Linear(nn.Linear, Module)` pattern) ----
class FrameworkModule(nn.Module):
    """A framework base: initialises its modules' own parameters from `_param_init`, the way
    torchtitan's `Module.init_states` does, and only visits modules of its own type."""

    _param_init = None

    def init_states(self) -> None:
        for child in self.children():
            if isinstance(child, FrameworkModule):
                child.init_states()
        if self._param_init is not None:
            for name, param in self.named_parameters(recurse=False):
                self._param_init[name](param)


class FrameworkLinear(nn.Linear, FrameworkModule):
    """Keeps nn.Linear.forward: Linear-like, so converted."""


class FrameworkModel(FrameworkModule):
    def __init__(self) -> None:
        super().__init__()
        self.up = FrameworkLinear(8, 16)
        self.down = FrameworkLinear(16, 4, bias=False)
        self.custom = Custom(4, 4)
        for lin, value in ((self.up, 0.25), (self.down, -0.5)):
            lin._param_init = {
                "weight": lambda p, v=value: nn.init.constant_(p, v),
                "bias": nn.init.zeros_,
            }
        self.up.tag = "kept"

    def forward(self, x):
        return self.custom(self.down(self.up(x)))


def test_linear_subclass_keeping_nn_linear_forward_is_converted_and_asked_about():
    seen = []

    def keep_all(module, fqn):
        seen.append((fqn, type(module).__name__))
        return True

    model = FrameworkModel()
    report = dq.convert_model_with_report(model, module_filter_fn=keep_all)
    assert seen == [("up", "FrameworkLinear"), ("down", "FrameworkLinear")]
    assert isinstance(model.up, dq.Linear) and isinstance(model.up, FrameworkModule)
    assert not isinstance(model.up, FrameworkLinear)  # nn.Linear.forward is not what runs now
    assert [c[0] for c in report.converted] == ["up", "down"]
    assert report.linears_seen == 3 and len(report.skipped) == 1
    assert report.skipped[0].fqn == "custom" and "overrides nn.Linear.forward" in (
        report.skipped[0].reason
    )


def test_conversion_on_meta_keeps_framework_init_hooks_and_attributes():
    with torch.device("meta"):
        model = FrameworkModel()
    dq.convert_model(model)
    assert model.up.weight.device.type == "meta" and model.up.tag == "kept"
    model.to_empty(device="cpu")
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(float("nan"))  # what to_empty may leave: init must overwrite every value
    model.init_states()
    assert torch.equal(model.up.weight, torch.full((16, 8), 0.25))
    assert torch.equal(model.up.bias, torch.zeros(16))
    assert torch.equal(model.down.weight, torch.full((4, 16), -0.5))
    assert model.custom.weight.isnan().all()  # left alone: not a framework-initialised module


def test_hooks_registered_on_a_linear_survive_the_swap_and_their_handles_still_remove():
    model = nn.Sequential(nn.Linear(4, 4))
    calls = []
    handle = model[0].register_forward_hook(lambda m, i, o: calls.append(type(m).__name__))
    model[0].register_state_dict_post_hook(lambda m, sd, prefix, local: sd.update(extra=1))
    dq.convert_model(model)
    model(torch.randn(2, 4))
    assert calls == ["Linear"] and type(model[0]) is dq.Linear
    assert model.state_dict()["extra"] == 1
    handle.remove()
    model(torch.randn(2, 4))
    assert calls == ["Linear"]


def test_converting_no_linear_of_a_model_with_linears_warns_with_the_reasons():
    model = nn.Sequential(Custom(4, 4), nn.Linear(4, 4))
    with pytest.warns(UserWarning, match=r"converted none of the model's 2 Linears.*0 \(Custom\)"):
        dq.convert_model(model, module_filter_fn=lambda m, fqn: False)
    assert type(model[1]) is nn.Linear


def test_parametrized_linear_is_left_alone_with_its_reason():
    from torch.nn.utils import parametrize

    class Double(nn.Module):
        def forward(self, w):
            return 2 * w

    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    parametrize.register_parametrization(model[0], "weight", Double())
    report = dq.convert_model_with_report(model)
    assert [s.fqn for s in report.skipped] == ["0"] and "parametrizations" in report.skipped[
        0
    ].reason
    assert [c[0] for c in report.converted] == ["1"]
