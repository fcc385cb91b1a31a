"""apply_recipe / lazy autocast switches: atomic, state-preserving, bit-identical where promised."""

import copy

import pytest
import torch
from torch import nn

import dist_quant as dq
from dist_quant import factories
from dist_quant.roles import QuantizerRole

N_LAYERS = 12


def mlp(seed: int = 0, n: int = N_LAYERS, width: int = 32) -> nn.Sequential:
    torch.manual_seed(seed)
    layers = []
    for i in range(n):
        layers += [dq.Linear(width, width, name=f"layers.{i}"), nn.Tanh()]
    return nn.Sequential(*layers)


def batch(step: int, width: int = 32) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 + step)
    return torch.randn(16, width, generator=g)


def train_step(model, opt, step, recipe=None):
    opt.zero_grad(set_to_none=True)
    with dq.autocast(recipe=recipe):
        loss = model(batch(step)).square().mean()
    loss.backward()
    opt.step()
    return loss.detach()


def snapshot(model):
    """Identity and bytes of everything a failed switch must leave alone."""
    out = []
    for m in model.modules():
        if isinstance(m, dq.Linear):
            rt = m.quant_binding.runtime
            bufs = []
            for d, st in (("fwd", rt.fwd_state), ("bwd", rt.bwd_state)):
                for name, t in sorted(st.persistent_buffers().items()):
                    bufs.append(((d, name), t, t.clone()))
            cache = m.quant_binding.cached_weights()
            out.append((m, rt, list(rt.fwd_quantizers), list(rt.bwd_quantizers), bufs, cache))
    return out


def assert_unchanged(snap):
    for m, rt, fq, bq, bufs, cache in snap:
        assert m.quant_binding.runtime is rt, m.role_name
        assert all(a is b for a, b in zip(m.quant_binding.runtime.fwd_quantizers, fq))
        assert all(a is b for a, b in zip(m.quant_binding.runtime.bwd_quantizers, bq))
        now = {}
        for d, st in (("fwd", rt.fwd_state), ("bwd", rt.bwd_state)):
            now.update({(d, k): v for k, v in st.persistent_buffers().items()})
        for name, t, saved in bufs:
            assert now[name] is t and torch.equal(t, saved), (m.role_name, name)
        assert m.quant_binding.cached_weights() == cache


def test_round_trip_current_custom_current_is_bit_identical_to_uninterrupted():
    a, b = mlp(), mlp()
    opt_a = torch.optim.Adam(a.parameters(), lr=1e-3)
    opt_b = torch.optim.Adam(b.parameters(), lr=1e-3)
    dq.apply_recipe(a, dq.Float8CurrentScaling())
    dq.apply_recipe(b, dq.Float8CurrentScaling())
    for step in range(12):
        if step == 4:
            report = dq.apply_recipe(b, dq.CustomRecipe(factories.current_scaling))
            assert len(report.changed) == N_LAYERS
        if step == 8:
            dq.apply_recipe(b, dq.Float8CurrentScaling())
        assert torch.equal(train_step(a, opt_a, step), train_step(b, opt_b, step)), step
    for pa, pb in zip(a.parameters(), b.parameters()):
        assert torch.equal(pa, pb)
    for sa, sb in zip(opt_a.state.values(), opt_b.state.values()):
        assert all(torch.equal(sa[k], sb[k]) for k in ("exp_avg", "exp_avg_sq"))


def test_transition_gives_same_numerics_as_fresh_model_under_new_recipe():
    a = mlp(1, n=3)
    opt = torch.optim.SGD(a.parameters(), lr=1e-2)
    dq.apply_recipe(a, dq.DelayedScaling(amax_history_len=4))
    for step in range(3):
        train_step(a, opt, step)
    dq.apply_recipe(a, dq.MXFP8BlockScaling())
    fresh = copy.deepcopy(a)
    for m in fresh.modules():
        if isinstance(m, dq.Linear):
            m.quant_binding.clear()
    dq.apply_recipe(fresh, dq.MXFP8BlockScaling())
    x = batch(7).requires_grad_(True)
    x2 = x.detach().clone().requires_grad_(True)
    with dq.autocast():
        ya, yb = a(x), fresh(x2)
    ya.sum().backward()
    yb.sum().backward()
    assert torch.equal(ya, yb) and torch.equal(x.grad, x2.grad)


def failing_in_backward_of_layer_6(role: QuantizerRole | None):
    if role is not None and role.name == "layers.6" and role.tensor_type == "grad_output":
        raise RuntimeError("no quantizer for you")
    return factories.current_scaling(role)


def test_factory_failure_in_one_module_leaves_whole_model_unchanged_and_training_identical():
    a, b = mlp(2), mlp(2)
    opt_a = torch.optim.SGD(a.parameters(), lr=1e-2)
    opt_b = torch.optim.SGD(b.parameters(), lr=1e-2)
    for m in (a, b):
        dq.apply_recipe(m, dq.DelayedScaling(amax_history_len=8))
    for step in range(3):
        train_step(a, opt_a, step)
        train_step(b, opt_b, step)
    snap = snapshot(b)
    with pytest.raises(dq.RecipeUpdateError, match=r"layers\.6.*grad_output"):
        dq.apply_recipe(b, dq.CustomRecipe(failing_in_backward_of_layer_6))
    assert_unchanged(snap)
    for step in range(3, 8):
        assert torch.equal(train_step(a, opt_a, step), train_step(b, opt_b, step))


def test_weight_cache_survives_equal_key_and_failed_candidate_and_drops_on_commit():
    model = mlp(3, n=2)
    dq.apply_recipe(model, dq.Float8CurrentScaling())
    with dq.autocast():
        model[0](batch(0), is_first_microbatch=True)
    cached = model[0].quant_binding.cached_weight("weight")
    report = dq.apply_recipe(model, dq.Float8CurrentScaling())
    assert report.changed == [] and model[0].quant_binding.cached_weight("weight") is cached
    bad = dq.CustomRecipe(lambda role: None)
    with pytest.raises(dq.RecipeUpdateError):
        dq.apply_recipe(model, bad)
    assert model[0].quant_binding.cached_weight("weight") is cached
    dq.apply_recipe(model, dq.Float8CurrentScaling(use_power_2_scales=True))
    assert model[0].quant_binding.cached_weight("weight") is None


def _delayed_steps(model, n, start=0):
    opt = torch.optim.SGD(model.parameters(), lr=0.0)  # lr 0: weights fixed, amaxes reproducible
    for step in range(start, start + n):
        train_step(model, opt, step)


def test_delayed_history_length_change_keeps_newest_entries():
    model = mlp(4, n=1)
    dq.apply_recipe(model, dq.DelayedScaling(amax_history_len=8))
    _delayed_steps(model, 5)
    old = model[0].quant_binding.runtime.fwd_state.delayed_groups()[0]
    old_hist, old_scale = old.amax_history.clone(), old.scale.clone()
    report = dq.apply_recipe(model, dq.DelayedScaling(amax_history_len=4))
    new = model[0].quant_binding.runtime.fwd_state.delayed_groups()[0]
    assert new.amax_history.shape[0] == 4 and any("resized" in n for n in report.inherited)
    assert torch.equal(new.amax_history[1:], old_hist[-3:])  # the 3 newest past steps
    assert torch.equal(new.scale, old_scale)


def test_delayed_margin_change_recomputes_scale_from_kept_history():
    model = mlp(5, n=1)
    dq.apply_recipe(model, dq.DelayedScaling(amax_history_len=6))
    _delayed_steps(model, 4)
    group = model[0].quant_binding.runtime.fwd_state.delayed_groups()[0]
    hist_before, scale_before = group.amax_history.clone(), group.scale.clone()
    dq.apply_recipe(model, dq.DelayedScaling(amax_history_len=6, margin=2))
    g = model[0].quant_binding.runtime.fwd_state.delayed_groups()[0]
    assert g.amax_history is group.amax_history, "same slots and length: buffers are re-bound"
    assert torch.equal(g.amax_history, hist_before)
    amax = hist_before.max(dim=0).values
    for i in range(amax.numel()):  # fp32 arithmetic, as the numerics contract says
        a = amax[i].item()
        want = (torch.tensor(448.0) / torch.tensor(a)) / 4.0 if a > 0 else scale_before[i]
        assert g.scale[i].item() == float(want), i
    assert amax[0] > 0 and amax[1] > 0, "input and weight slots saw data"


def test_switching_between_unkeyed_closures_rebuilds_only_when_captured_value_differs():
    def make_factory(pow2: bool):
        def factory(role):
            return factories.current_scaling(role) if not pow2 else factories.current_scaling(role)

        return factory

    model = mlp(6, n=2)
    with pytest.warns(UserWarning):
        first = dq.apply_recipe(model, dq.CustomRecipe(make_factory(False)))
    assert len(first.changed) == 2
    again = dq.apply_recipe(model, dq.CustomRecipe(make_factory(False)))
    assert again.changed == [] and len(again.kept) == 2
    other = dq.apply_recipe(model, dq.CustomRecipe(make_factory(True)))
    assert len(other.changed) == 2


def test_apply_recipe_is_refused_inside_autocast():
    model = mlp(7, n=1)
    with dq.autocast(), pytest.raises(dq.RecipeUpdateError, match="inside autocast"):
        dq.apply_recipe(model, dq.Float8CurrentScaling())


def test_lazy_autocast_switch_failure_leaves_model_on_old_recipe_and_skips_amax_update():
    a, b = mlp(8, n=4), mlp(8, n=4)
    ds = dq.DelayedScaling(amax_history_len=4)
    opt_a = torch.optim.SGD(a.parameters(), lr=1e-2)
    opt_b = torch.optim.SGD(b.parameters(), lr=1e-2)
    for step in range(2):
        train_step(a, opt_a, step, recipe=ds)
        train_step(b, opt_b, step, recipe=ds)
    snap = snapshot(b)
    with pytest.raises(dq.RecipeUpdateError, match="layers.2"):
        with dq.autocast(recipe=dq.CustomRecipe(_fails_on_layer_2)):
            b(batch(2))
    assert_unchanged(snap)
    for step in range(2, 5):
        assert torch.equal(
            train_step(a, opt_a, step, recipe=ds), train_step(b, opt_b, step, recipe=ds)
        )


def _fails_on_layer_2(role):
    if role is not None and role.name == "layers.2":
        return None
    return factories.current_scaling(role)


def test_current_recipe_reports_the_published_recipe():
    model = mlp(9, n=2)
    assert dq.current_recipe(model) is None
    r = dq.Float8CurrentScaling()
    dq.apply_recipe(model, r)
    assert dq.current_recipe(model).key() == r.key()


def test_fp8_attention_slot_with_unsupported_quantizer_is_refused_at_plan_time():
    @dq.quantizer_factory(key="block-everywhere")
    def block_everywhere(role):
        return factories.float8_block_scaling(role)

    model = nn.Sequential(dq.MultiheadAttention(32, 4, name="attn"))
    with pytest.raises(dq.RecipeUpdateError, match=r"attn.*dpa/(qkv|s)"):
        dq.apply_recipe(model, dq.CustomRecipe(block_everywhere, fp8_dpa=True))
    assert model[0].core_attention.quant_binding.runtime is None, "nothing published"
    # without fp8_dpa the attention slots are never applied, so the same factory is accepted
    dq.apply_recipe(model, dq.CustomRecipe(block_everywhere))


def test_fp8_recipe_on_a_gpu_without_fp8_is_refused_unless_emulation_is_asked_for(monkeypatch):
    """An old GPU is simulated: the check is what matters, not the device it runs on."""
    from dist_quant import runtime

    model = mlp(10, n=2)
    monkeypatch.setattr(runtime, "_gpu_without_fp8", lambda device: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device: "Old GPU")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device: (8, 0))
    monkeypatch.delenv(runtime.EMULATION_ENV, raising=False)
    with pytest.raises(
        dq.RecipeUpdateError, match=r"layers\.0.*Old GPU.*8\.0.*DIST_QUANT_EMULATE_FP8"
    ):
        dq.apply_recipe(model, dq.Float8CurrentScaling())
    assert dq.current_recipe(model) is None, "nothing published"
    dq.apply_recipe(model, dq.recipe_from_dict("bf16"))  # identity-only recipes run anywhere
    monkeypatch.setenv(runtime.EMULATION_ENV, "1")
    dq.apply_recipe(model, dq.Float8CurrentScaling())
    assert isinstance(dq.current_recipe(model), dq.Float8CurrentScaling)
