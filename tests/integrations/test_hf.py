"""A Hugging Face `LlamaForCausalLM` (built from a config, no downloaded weights) converted,
trained under delayed scaling, switched, saved and loaded into a fresh converted model."""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip(
    "transformers", reason="needs transformers (pip install 'dist-quant[frameworks]')"
)

import dist_quant as dq  # noqa: E402
from dist_quant.integrations import hf  # noqa: E402

VOCAB = 128


def config():
    return transformers.LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
    )


def batch(step: int) -> torch.Tensor:
    return torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(step))


def step(model, opt, i: int) -> torch.Tensor:
    with dq.autocast():
        loss = model(input_ids=batch(i), labels=batch(i)).loss
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss.detach()


def test_llama_trains_switches_and_round_trips_through_save_and_from_pretrained(tmp_path):
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config())
    report = dq.convert_model_with_report(model)
    assert len(report.converted) == 2 * 7 + 1 and not report.skipped  # q k v o gate up down, head
    dq.apply_recipe(model, dq.DelayedScaling(amax_history_len=4))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    losses = [step(model, opt, i) for i in range(3)]
    dq.apply_recipe(model, dq.DelayedScaling(amax_history_len=4, margin=1))  # the history carries
    losses += [step(model, opt, i) for i in range(3, 5)]
    assert all(torch.isfinite(x) for x in losses)

    hf.save_pretrained(model, tmp_path)
    plain = transformers.LlamaForCausalLM.from_pretrained(tmp_path)  # plain transformers reads it
    assert all(type(m) is not dq.Linear for m in plain.modules())
    fresh = hf.from_pretrained(transformers.LlamaForCausalLM, tmp_path)
    assert dq.current_recipe(fresh) == dq.DelayedScaling(amax_history_len=4, margin=1)
    for (name, p), q in zip(model.named_parameters(), fresh.parameters(), strict=True):
        assert torch.equal(p, q), name
    model.eval()
    fresh.eval()
    with dq.autocast(), torch.no_grad():
        want = model(input_ids=batch(9)).logits
        got = fresh(input_ids=batch(9)).logits
    assert torch.equal(got, want)  # same weights, recipe and delayed scales
    with dq.autocast(recipe=dq.HighPrecision()), torch.no_grad():
        assert not torch.equal(plain(input_ids=batch(9)).logits, want)  # scales mattered


def test_from_pretrained_refuses_extra_state_saved_under_another_filter(tmp_path):
    def not_head(module, fqn):
        return fqn != "lm_head"

    for saved_filter, loaded_filter, message in (
        (None, not_head, "for modules the converted model does not have"),
        (not_head, None, "saved with another module_filter_fn"),
    ):
        torch.manual_seed(0)
        model = transformers.LlamaForCausalLM(config())
        dq.convert_model(model, module_filter_fn=saved_filter)
        with dq.autocast(recipe=dq.Float8CurrentScaling()):
            model(input_ids=batch(0))
        hf.save_pretrained(model, tmp_path)
        with pytest.raises(ValueError, match=message):
            hf.from_pretrained(
                transformers.LlamaForCausalLM, tmp_path, module_filter_fn=loaded_filter
            )
