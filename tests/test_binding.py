"""The module's public quantization binding (`module.quant_binding`): what publish builds, what the
forward reuses, what copies and checkpoint loads do to it, and the layering it allows."""

import copy
import gc
import subprocess
import sys

import pytest
import torch

import dist_quant as dq
from dist_quant import amax
from dist_quant.binding import bound
from dist_quant.kinds import Direction

DELAYED = dq.DelayedScaling(amax_history_len=4)


def step(model, x, recipe=None):
    with dq.autocast(recipe=recipe):
        y = model(x)
    y.float().sum().backward()
    return y.detach()


def test_publish_builds_the_plan_the_next_forward_runs_without_rebuilding():
    torch.manual_seed(0)
    lin = dq.Linear(32, 16)
    x = torch.randn(8, 32, requires_grad=True)
    step(lin, x, dq.Float8CurrentScaling())  # a forward ran: the binding knows its group (None)
    dq.apply_recipe(lin, DELAYED)
    binding = lin.quant_binding
    plan = binding.forward_plan
    assert plan is not None and plan.runtime is binding.runtime, "built by publish"
    assert binding.recipe is DELAYED and binding.pinned_recipe is DELAYED
    (slots,) = plan.gemms
    assert slots.input is binding.runtime.fwd_quantizers[0]
    assert plan.enrol_anchor is binding.runtime.delayed_groups(fwd=True)[0].scale
    y = step(lin, x)
    y2 = step(lin, x)
    assert binding.forward_plan is plan, "the forwards reused the published plan"
    # the same forwards on a copy planned from scratch (no plan before its first forward)
    fresh = dq.Linear(32, 16)
    fresh.load_state_dict({"weight": lin.weight, "bias": lin.bias}, strict=False)
    dq.apply_recipe(fresh, DELAYED)
    assert fresh.quant_binding.forward_plan is None, "no forward yet: built by the first one"
    assert torch.equal(step(fresh, x), y) and torch.equal(step(fresh, x), y2)


def test_plan_is_rebuilt_when_the_runtime_changes_and_not_when_it_is_kept():
    torch.manual_seed(1)
    lin = dq.Linear(32, 16)
    x = torch.randn(8, 32)
    step(lin, x, dq.Float8CurrentScaling())
    plan = lin.quant_binding.forward_plan
    report = dq.apply_recipe(lin, dq.Float8CurrentScaling())  # equal key: nothing changes
    assert report.changed == [] and lin.quant_binding.forward_plan is plan
    lin.output_quantizer_role = dq.QuantizerRole("linear", "input", "next")  # a role moved
    step(lin, x)
    assert lin.quant_binding.forward_plan is not plan
    assert lin.quant_binding.runtime.fwd_roles[2] == dq.QuantizerRole("linear", "input", "next")


def test_a_copy_gets_its_own_binding_and_quantizes_like_the_original():
    torch.manual_seed(2)
    lin = dq.Linear(32, 16)
    x = torch.randn(8, 32)
    dq.apply_recipe(lin, DELAYED)
    with dq.autocast():
        lin(x, is_first_microbatch=True)  # caches the FP8 weight
    for other in (copy.deepcopy(lin), copy.copy(lin)):
        a, b = lin.quant_binding, other.quant_binding
        assert a is not b and a.enrol_key != b.enrol_key
        assert b.role_name == a.role_name and b.pinned_recipe == a.pinned_recipe
        assert b.cached_weights().keys() == {"weight"}
        b.invalidate_weight_cache()
        assert b.cached_weight("weight") is None
        assert a.cached_weight("weight") is not None, "the original's cache is its own"
    twin = copy.deepcopy(lin)
    assert torch.equal(step(twin, x), step(lin, x)), "same scales, same quantization"


def test_a_deep_copy_names_its_own_delayed_groups_for_the_amax_packing():
    lin = dq.Linear(32, 16, name="proj")
    dq.apply_recipe(lin, DELAYED)
    step(lin, torch.randn(8, 32))
    twin = copy.deepcopy(lin)
    step(twin, torch.randn(8, 32))
    groups = [*twin.quant_binding.runtime.delayed_groups(fwd=True)]
    groups += twin.quant_binding.runtime.delayed_groups(fwd=False)
    assert [amax._name_of(g) for g in groups] == ["proj"] * len(groups) and groups


def test_clear_drops_runtime_pin_and_cached_weights():
    lin = dq.Linear(32, 16)
    dq.apply_recipe(lin, DELAYED)
    with dq.autocast():
        lin(torch.randn(8, 32), is_first_microbatch=True)
    lin.quant_binding.clear()
    b = lin.quant_binding
    assert b.runtime is None and b.pinned_recipe is None and b.forward_plan is None
    assert b.cached_weights() == {}
    assert dq.current_recipe(lin) is None
    step(lin, torch.randn(8, 32), dq.Float8CurrentScaling())  # plans again, lazily
    assert isinstance(dq.current_recipe(lin), dq.Float8CurrentScaling)


def test_backward_reduces_over_the_group_its_forward_ran_under(backward_reductions):
    # the plan carries the region's reduction group: a second forward under another group before
    # the first one's backward must not redirect that backward's amax reduction
    lin = dq.Linear(32, 16)
    dq.apply_recipe(lin, DELAYED)
    first, second = object(), object()
    x = torch.randn(8, 32, requires_grad=True)
    with dq.autocast(amax_reduction_group=first):
        y_first = lin(x)
    assert lin.quant_binding.forward_plan.reduction_group is first
    with dq.autocast(amax_reduction_group=second):
        lin(x)
    y_first.float().sum().backward()
    assert backward_reductions == [(Direction.BACKWARD, first)]


def test_an_enrolment_key_names_its_binding_while_the_module_lives():
    lin = dq.Linear(8, 8)
    key = lin.quant_binding.enrol_key
    assert bound(key) is lin.quant_binding
    twin = copy.deepcopy(lin)
    assert bound(twin.quant_binding.enrol_key) is twin.quant_binding
    del lin
    gc.collect()
    with pytest.raises(RuntimeError, match=f"no live module has key {key}"):
        bound(key)


def test_binding_context_and_runtime_import_no_module_code():
    code = (
        "import sys, dist_quant.binding, dist_quant.context, dist_quant.runtime\n"
        "print(sorted(m for m in sys.modules if m.startswith(('dist_quant.modules', "
        "'dist_quant.checkpoint'))))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout


def test_a_module_built_under_a_meta_default_device_enrols_its_checkpointed_forward():
    # torchtitan builds models inside `with torch.device("meta")`; the enrolment tag must still
    # name the module, or the checkpointed forward's delayed amaxes go to no module
    def make():
        torch.manual_seed(0)
        return dq.Linear(16, 16)

    with torch.device("meta"):
        meta_built = dq.Linear(16, 16)
    meta_built.to_empty(device="cpu")
    meta_built.load_state_dict(make().state_dict())
    grads = []
    for model in (make(), meta_built):
        dq.apply_recipe(model, dq.DelayedScaling())
        x = torch.randn(4, 16, generator=torch.Generator().manual_seed(1), requires_grad=True)
        with dq.autocast():
            y = dq.activation_checkpoint(model, x, use_reentrant=False)
        y.square().sum().backward()
        grads.append((x.grad, model.weight.grad))
    assert torch.equal(grads[0][0], grads[1][0]) and torch.equal(grads[0][1], grads[1][1])
