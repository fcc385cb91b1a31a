"""`GuardRunner`: the recipe a guard decision asks for, derived from the base recipe."""

import torch
from dist_quant.coordinator.decision_log import DecisionLog
from dist_quant.coordinator.guard import Observation, PrecisionGuard
from dist_quant.coordinator.guard_runner import GuardRunner
from dist_quant.coordinator.results import SwitchResult

import dist_quant as dq
from dist_quant.recipes import recipe_from_dict


def _requested(tmp_path, model, policy, observations):
    """The recipe payloads the runner sends (each answered with an aborted switch)."""
    sent = []

    def request(recipe, timeout):
        sent.append(recipe)
        return SwitchResult(1, False, None, {0: "test"}, {})

    runner = GuardRunner(policy, model, log=DecisionLog(tmp_path / "log.jsonl"), request=request)
    for obs in observations:
        runner.observe(obs)
        runner.wait(5)
    return sent


def test_a_layer_fallback_keeps_the_bases_high_precision_backward_on_the_layers_it_leaves(
    tmp_path,
):
    torch.manual_seed(0)
    model = torch.nn.Sequential(dq.Linear(32, 32), dq.Linear(32, 32))
    dq.apply_recipe(model, dq.NVFP4BlockScaling(backward_override="high_precision"))
    policy = PrecisionGuard(saturation_intervals=1, fallback="mxfp8")
    (payload,) = _requested(tmp_path, model, policy, [Observation(3, saturation=(("0", 0.5),))])
    recipe = recipe_from_dict(payload)
    assert recipe.backward_override == "high_precision"
    assert recipe.to_dict() == payload and recipe_from_dict(recipe.to_dict()).key() == recipe.key()

    dq.apply_recipe(model, recipe)
    assert isinstance(model[0].quant_binding.runtime.fwd_quantizers[0], dq.MXFP8Quantizer)
    seen = {}
    model[1].register_forward_pre_hook(lambda m, args: seen.update(x=args[0].detach()))
    x, dy = torch.randn(16, 32), torch.randn(16, 32)
    with dq.autocast():
        model(x).backward(dy)
    # the layer left on NVFP4 runs the unconverted backward: dW = dy^T x, exactly F.linear's
    w = model[1].weight.detach().clone().requires_grad_(True)
    torch.nn.functional.linear(seen["x"], w).backward(dy)
    assert torch.equal(model[1].weight.grad, w.grad)


def test_a_whole_model_fallback_carries_the_overrides_and_names_a_plain_builtin(tmp_path):
    # a loss spike with no saturated layer moves the whole model to the policy's fallback
    window = [Observation(i, loss=2.0 + 0.01 * (i % 2)) for i in range(4)]
    spike = [Observation(4, loss=50.0)]
    policy = PrecisionGuard(loss_window=4, spike_sigma=3.0, fallback="current")
    sent = []
    for base in (dq.NVFP4BlockScaling(backward_override="dequantized"), dq.NVFP4BlockScaling()):
        model = torch.nn.Sequential(dq.Linear(16, 16))
        dq.apply_recipe(model, base)
        sent += _requested(tmp_path, model, policy, window + spike)
    assert sent == [dq.Float8CurrentScaling(backward_override="dequantized").to_dict(), "current"]
