"""dist-quant inside torchtitan 0.3 on CPU: its llama3 debug model built as its trainer builds it
(config converters, meta device, `to_empty`, `init_weights`), trained with torchtitan's own model
code, checkpointed with its AC policies, exported with its HF state-dict adapter.

References are torchtitan's unconverted model (same seed, same code) and torch's own checkpoint;
flex attention has no CPU backward, so the model uses torchtitan's own SDPA inner attention, and
2 of its 6 layers.
"""

from __future__ import annotations

import pytest
import torch

titan = pytest.importorskip(
    "torchtitan", reason="needs torchtitan 0.3 (pip install 'dist-quant[frameworks]')"
)

from torchtitan.distributed.activation_checkpoint import FullAC, SelectiveAC  # noqa: E402
from torchtitan.models.common.attention import ScaledDotProductAttention  # noqa: E402
from torchtitan.models.llama3 import model_registry  # noqa: E402
from torchtitan.models.llama3.state_dict_adapter import Llama3StateDictAdapter  # noqa: E402

import dist_quant as dq  # noqa: E402
from dist_quant.integrations.torchtitan import (  # noqa: E402
    DistQuantConverter,
    DistQuantFullAC,
    DistQuantLinear,
    DistQuantSelectiveAC,
    exact_ac_config,
    extra_state_adapter,
)

LAYERS = 2  # of the debug model's 6, to keep CPU emulation quick
LINEARS = LAYERS * 5 + 1  # per layer wqkv, wo, w1, w2, w3; the output head
VOCAB, BATCH, SEQ = 2048, 2, 16


def model_config(converters=None):
    cfg = model_registry("debugmodel", converters=converters).model
    cfg.layers = cfg.layers[:LAYERS]
    for layer in cfg.layers:
        layer.attention.inner_attention = ScaledDotProductAttention.Config()
    return cfg


def build(cfg, seed: int = 0) -> torch.nn.Module:
    """As torchtitan's Trainer: build on meta, check the protocol, materialise, initialise."""
    with torch.device("meta"):
        model = cfg.build()
    model.verify_module_protocol()
    model.to_empty(device="cpu")
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(float("nan"))  # what to_empty may leave: init must overwrite all of it
    torch.manual_seed(seed)
    model.init_weights(buffer_device=None)
    return model


def tokens(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    t = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=g)
    return t[:, :-1], t[:, 1:]


def train(model, steps: int, *, switch=None) -> list[torch.Tensor]:
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    losses = []
    for step in range(steps):
        if switch is not None and step == switch[0]:
            dq.apply_recipe(model, switch[1])
        x, y = tokens(step)
        opt.zero_grad()
        logits = model(x)
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), y.flatten())
        loss.backward()
        opt.step()
        losses.append(loss.detach())
    return losses


def converted(recipe: str = "delayed", **kwargs) -> torch.nn.Module:
    return build(model_config([DistQuantConverter.Config(recipe=recipe, **kwargs)]))


def test_converter_builds_initialised_dist_quant_linears_with_torchtitans_init():
    model = converted()
    reference = build(model_config())
    names = [n for n, m in model.named_modules() if isinstance(m, DistQuantLinear)]
    assert len(names) == LINEARS
    ref_params = dict(reference.named_parameters())
    for name, p in model.named_parameters():
        assert torch.equal(p, ref_params[name]), name  # each config's param_init ran, in order


def test_filter_fqns_keeps_those_linears_and_a_bad_recipe_is_refused_at_conversion():
    model = converted(filter_fqns=["lm_head", "feed_forward.w2"])
    kept = [n for n, m in model.named_modules() if type(m).__name__ == "Linear"]
    assert sorted(kept) == sorted(
        ["lm_head"] + [f"layers.{i}.feed_forward.w2" for i in range(LAYERS)]
    )
    with pytest.raises(ValueError, match="recipe 'fp9'.*unknown built-in"):
        model_config([DistQuantConverter.Config(recipe="fp9")])


def test_convert_model_on_torchtitans_meta_model_before_init_weights():
    cfg = model_config()
    with torch.device("meta"):
        model = cfg.build()
    report = dq.convert_model_with_report(model)
    assert len(report.converted) == LINEARS and not report.skipped
    model.verify_module_protocol()
    model.to_empty(device="cpu")
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(float("nan"))
    torch.manual_seed(0)
    model.init_weights(buffer_device=None)
    reference = dict(build(model_config()).named_parameters())
    for name, p in model.named_parameters():
        assert torch.equal(p, reference[name]), name


def test_bf16_recipe_trains_bit_identical_to_the_unconverted_model():
    want = train(build(model_config()), 3)
    got = train(converted("bf16"), 3)
    assert [float(x) for x in got] == [float(x) for x in want]


def test_debug_model_trains_under_delayed_then_switches_to_current():
    model = converted("delayed")
    losses = train(model, 4, switch=(2, dq.Float8CurrentScaling()))
    assert all(torch.isfinite(x) for x in losses)
    assert isinstance(dq.current_recipe(model), dq.Float8CurrentScaling)
    hp = train(build(model_config()), 4)
    assert float(losses[1]) != float(hp[1])  # FP8 ran: not the high-precision losses


@pytest.mark.parametrize("ac", [FullAC.Config(), SelectiveAC.Config()], ids=["full", "selective"])
def test_torchtitans_ac_options_recompute_fp8_blocks_exactly(ac):
    plain = converted("delayed")
    checkpointed = converted("delayed")
    exact_ac_config(ac).build().apply(checkpointed)
    assert [float(x) for x in train(checkpointed, 2)] == [float(x) for x in train(plain, 2)]
    for (name, p), q in zip(plain.named_parameters(), checkpointed.parameters(), strict=True):
        assert torch.equal(p, q), name


def test_torchtitans_own_ac_wrapper_refuses_an_fp8_recompute_and_ours_are_subclasses():
    model = converted("delayed")
    FullAC.Config().build().apply(model)
    with pytest.raises(dq.RecomputeError):
        train(model, 1)
    assert type(exact_ac_config(FullAC.Config())) is DistQuantFullAC.Config
    assert type(exact_ac_config(SelectiveAC.Config())) is DistQuantSelectiveAC.Config


def test_hf_export_and_import_through_torchtitans_adapter():
    cfg = model_config([DistQuantConverter.Config(recipe="delayed")])
    model = build(cfg)
    train(model, 2)
    adapter = extra_state_adapter(Llama3StateDictAdapter)(cfg, None)
    hf = adapter.to_hf(model.state_dict())
    plain = Llama3StateDictAdapter(model_config(), None)
    weights = {k: v for k, v in model.state_dict().items() if not k.endswith("_extra_state")}
    want = plain.to_hf(weights)
    assert hf.keys() == want.keys() and all(torch.equal(hf[k], want[k]) for k in want)
    assert len(adapter.extra_state) == LINEARS

    x, _ = tokens(7)
    fresh = build(cfg, seed=1)
    fresh.load_state_dict(adapter.from_hf(hf), strict=True)  # the kept extra state comes back
    with torch.no_grad():
        assert torch.equal(fresh(x), model(x))

    bare = build(cfg, seed=1)
    result = bare.load_state_dict(
        extra_state_adapter(Llama3StateDictAdapter)(cfg, None).from_hf(hf), strict=False
    )
    assert len(result.missing_keys) == LINEARS and all(
        k.endswith("_extra_state") for k in result.missing_keys
    )
    assert not result.unexpected_keys
    for name, p in model.named_parameters():
        assert torch.equal(dict(bare.named_parameters())[name], p), name
    with torch.no_grad():
        bare(x)
    assert dq.current_recipe(bare) == dq.DelayedScaling()  # the converter's recipe, fresh scales


def test_enable_dist_quant_adapts_a_trainer_config_and_refuses_an_unconverted_one():
    from dist_quant.launch.torchtitan import enable_dist_quant
    from torchtitan.models.llama3.config_registry import llama3_debugmodel

    config = llama3_debugmodel()
    with pytest.raises(ValueError, match="not converted by DistQuantConverter"):
        enable_dist_quant(config)
    config.model_spec = model_registry(
        "debugmodel", converters=[DistQuantConverter.Config(recipe="current")]
    )
    assert enable_dist_quant(config) is config
    assert type(config.activation_checkpoint) is DistQuantSelectiveAC.Config
    assert issubclass(config.model_spec.state_dict_adapter, Llama3StateDictAdapter)
    assert config.model_spec.state_dict_adapter is extra_state_adapter(Llama3StateDictAdapter)


def test_attached_coordinator_switches_the_model_at_an_optimizer_step_boundary(tmp_path):
    from types import SimpleNamespace

    import torch.distributed as dist
    from dist_quant.coordinator import request_switch
    from dist_quant.launch.torchtitan import enable_dist_quant
    from torchtitan.models.llama3.config_registry import llama3_debugmodel

    run_dir = tmp_path / "run"
    config = llama3_debugmodel()
    converter = DistQuantConverter.Config(
        recipe="delayed", attach_coordinator=True, run_dir=str(run_dir)
    )
    config.model_spec = model_registry("debugmodel", converters=[converter])
    spec = config.model_spec
    spec.model.layers = spec.model.layers[:LAYERS]
    for layer in spec.model.layers:
        layer.attention.inner_attention = ScaledDotProductAttention.Config()
    enable_dist_quant(config)
    model = build(spec.model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'pg'}", rank=0, world_size=1)
    try:
        # the trainer calls this with its optimizers container (an Optimizer) once they exist
        spec.post_optimizer_build_fn(opt, [model], SimpleNamespace(tp_enabled=False))
        assert model._dist_quant_participant.state is not None

        def step(i: int) -> None:
            x, y = tokens(i)
            loss = torch.nn.functional.cross_entropy(model(x).flatten(0, 1), y.flatten())
            loss.backward()
            opt.step()  # the boundary of step i + 1 follows it
            opt.zero_grad()

        step(0)
        assert isinstance(dq.current_recipe(model), dq.DelayedScaling)
        result = request_switch("current", at_step=2, run_dir=run_dir, timeout_s=20)
        assert result.committed and result.step == 2
        step(1)
        assert isinstance(dq.current_recipe(model), dq.Float8CurrentScaling)
    finally:
        if getattr(model, "_dist_quant_participant", None) is not None:
            model._dist_quant_participant.close()
        dist.destroy_process_group()
