"""Shared by the fuzz suites: a small model holding every module family, twin training, and the
state snapshot that a refused change must leave exactly as it was.

`Zoo` runs a Linear, a LayerNormLinear, a GroupedLinear (ragged splits) and a DotProductAttention
in one forward, so every module family's roles and states are in play. Two Zoos built with the
same seed and trained on the same batches are bit-identical; a case damages a model, its twin
stays clean, and the next step of both must agree bit for bit.

`Snapshot` records what a refused recipe change must not touch (API.md: "the model is then exactly
as before (same quantizers, same buffers, same cached weights)"): every module's runtime object,
its quantizer objects, its persistent buffers (the tensor objects and their bytes), its cached FP8
weights and its pinned recipe, plus the parameters' bytes. Every comparison is recorded in the
reliability tally through `check_state`.
"""

from __future__ import annotations

import os

import torch
from hypothesis import settings
from reliability import check_state
from torch import nn

import dist_quant as dq
from dist_quant.modules.base import QuantizedModule

WIDTH, HEADS, SEQ, BATCH = 16, 2, 5, 2
_CI_EXAMPLES = 10  # max_examples of the "ci" profile (tests/fuzz/conftest.py)


def fuzz_budget(ci_examples: int) -> settings:
    """The selected profile (tests/fuzz/conftest.py) with `ci_examples` cases under "ci",
    proportionally more under "slow"."""
    profile = settings.get_profile(os.environ.get("DIST_QUANT_FUZZ_PROFILE", "ci"))
    scale = profile.max_examples / _CI_EXAMPLES
    return settings(profile, max_examples=max(1, round(ci_examples * scale)))


class Zoo(nn.Module):
    """(seq, batch, WIDTH) -> (seq, batch, WIDTH) through one module of every family."""

    def __init__(self, seed: int) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.fc = dq.Linear(WIDTH, WIDTH)
        self.norm_fc = dq.LayerNormLinear(WIDTH, WIDTH)
        self.experts = dq.GroupedLinear(2, WIDTH, WIDTH)
        self.attn = dq.DotProductAttention(HEADS, WIDTH // HEADS)

    def forward(self, x: torch.Tensor, is_first_microbatch: bool | None = None) -> torch.Tensor:
        h = self.fc(x, is_first_microbatch=is_first_microbatch)
        h = self.norm_fc(h, is_first_microbatch=is_first_microbatch)
        tokens = h.shape[0] * h.shape[1]
        split = [tokens // 2 + 1, tokens - tokens // 2 - 1]  # ragged for every alignment
        h = self.experts(h.reshape(tokens, WIDTH), split, is_first_microbatch=is_first_microbatch)
        qkv = h.reshape(SEQ, BATCH, HEADS, WIDTH // HEADS)
        return self.attn(qkv, qkv, qkv)


def quantized_modules(model: nn.Module) -> list[QuantizedModule]:
    return [m for m in model.modules() if isinstance(m, QuantizedModule) and m.owns_quantizers]


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(7000 + step)
    return torch.randn(SEQ, BATCH, WIDTH, generator=g), torch.randn(SEQ, BATCH, WIDTH, generator=g)


def train_step(
    model: nn.Module, opt: torch.optim.Optimizer, step: int, recipe: dq.recipes.Recipe | None = None
) -> torch.Tensor:
    """One optimizer step on batch `step` (weights cached as first microbatch); returns the loss."""
    x, target = batch(step)
    opt.zero_grad(set_to_none=True)
    with dq.autocast(recipe=recipe):
        y = model(x, is_first_microbatch=True)
    loss = (y - target).square().mean()
    loss.backward()
    opt.step()
    return loss.detach()


class Snapshot:
    """Identity and bytes of everything a refused recipe change must leave alone."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self.entries = []
        for m in quantized_modules(model):
            rt = m.quant_binding.runtime
            buffers = {}
            if rt is not None:
                for direction, state in (("fwd", rt.fwd_state), ("bwd", rt.bwd_state)):
                    for name, t in state.persistent_buffers().items():
                        buffers[(direction, name)] = (t, t.clone())
            self.entries.append(
                (
                    m,
                    rt,
                    None if rt is None else list(rt.fwd_quantizers),
                    None if rt is None else list(rt.bwd_quantizers),
                    buffers,
                    m.quant_binding.cached_weights(),
                    m.quant_binding.pinned_recipe,
                )
            )
        self.params = [(p, p.detach().clone()) for p in model.parameters()]

    def differences(self) -> list[str]:
        out = []
        for m, rt, fq, bq, buffers, cache, pinned in self.entries:
            name = m.role_name
            now = m.quant_binding.runtime
            if now is not rt:
                out.append(f"{name}: runtime replaced")
                continue
            if rt is not None:
                if any(a is not b for a, b in zip(rt.fwd_quantizers, fq, strict=True)):
                    out.append(f"{name}: forward quantizers replaced")
                if any(a is not b for a, b in zip(rt.bwd_quantizers, bq, strict=True)):
                    out.append(f"{name}: backward quantizers replaced")
                current = {}
                for direction, state in (("fwd", rt.fwd_state), ("bwd", rt.bwd_state)):
                    for key, t in state.persistent_buffers().items():
                        current[(direction, key)] = t
                for key, (t, saved) in buffers.items():
                    if current.get(key) is not t:
                        out.append(f"{name}: buffer {key} replaced")
                    elif not _same_bits(t, saved):
                        out.append(f"{name}: buffer {key} bytes changed")
            now_cache = m.quant_binding.cached_weights()
            if now_cache.keys() != cache.keys() or any(now_cache[k] is not cache[k] for k in cache):
                out.append(f"{name}: cached weights changed")
            if m.quant_binding.pinned_recipe is not pinned:
                out.append(f"{name}: pinned recipe changed")
        for i, (p, saved) in enumerate(self.params):
            if not _same_bits(p.detach(), saved):
                out.append(f"parameter {i} changed")
        return out

    def check(self, what: str) -> None:
        diffs = self.differences()
        check_state(not diffs, f"{what}: {'; '.join(diffs)}")


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal bytes (so NaN equals the same NaN, and -0.0 differs from 0.0)."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    return torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))


def state_tensors(model: nn.Module) -> list[torch.Tensor]:
    """Parameters, their gradients and every persistent quantization buffer, in a fixed order."""
    out = []
    for p in model.parameters():
        out.append(p.detach())
        if p.grad is not None:
            out.append(p.grad)
    for m in quantized_modules(model):
        rt = m.quant_binding.runtime
        if rt is not None:
            for state in (rt.fwd_state, rt.bwd_state):
                for _, t in sorted(state.persistent_buffers().items()):
                    out.append(t)
    return out


def check_twins(a: nn.Module, b: nn.Module, loss_a: torch.Tensor, loss_b: torch.Tensor, what: str):
    """`a` and its twin `b` took the same step: losses, weights, gradients and buffers equal bits."""
    ta, tb = state_tensors(a), state_tensors(b)
    same = _same_bits(loss_a, loss_b) and len(ta) == len(tb)
    same = same and all(_same_bits(x, y) for x, y in zip(ta, tb))
    check_state(same, f"{what}: the next step differs from the twin's")
