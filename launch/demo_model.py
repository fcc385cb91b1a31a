"""The demo's model: a small GPT whose transformer layers are dist-quant `TransformerLayer`s.

Token and position embeddings, `layers` dist-quant `TransformerLayer`s (causal self-attention and
an MLP, tensor parallel over `tp_group`), a final LayerNorm and an LM head. The embeddings, final
norm and head stay plain high-precision PyTorch modules, the usual choice for the first and last
layers of an FP8 model; only the transformer layers' GEMMs follow the recipe.

Model specs (`dist-quant roles`, `dist-quant demo --model`): `gpt` with optional comma-separated
`key=value` overrides, e.g. `gpt:layers=2,hidden=64,heads=4`. Keys: layers, hidden, heads,
ffn (0: 4 * hidden), vocab, seq (the longest sequence, i.e. the position table's size).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn


@dataclass(frozen=True)
class GPTSpec:
    layers: int = 2
    """Number of dist-quant TransformerLayers."""
    hidden: int = 64
    """Model width; a multiple of `heads`."""
    heads: int = 4
    """Attention heads; a multiple of the tensor-parallel size."""
    ffn: int = 0
    """MLP width; 0 means 4 * hidden."""
    vocab: int = 64
    """Vocabulary size of the embedding and the LM head."""
    seq: int = 32
    """Longest sequence the position table covers."""

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            lowest = 0 if f.name == "ffn" else 1
            if isinstance(value, bool) or not isinstance(value, int) or value < lowest:
                raise ValueError(
                    f"model spec: {f.name} must be an integer >= {lowest}, got {value!r}"
                )
        if self.hidden % self.heads:
            raise ValueError(
                f"model spec: hidden={self.hidden} must be a multiple of heads={self.heads}"
            )

    @property
    def ffn_size(self) -> int:
        return self.ffn or 4 * self.hidden

    def check_tp(self, tp: int) -> None:
        """Raise ValueError unless heads and the MLP width split evenly over `tp` ranks."""
        if self.heads % tp or self.ffn_size % tp:
            raise ValueError(
                f"model spec: heads={self.heads} and ffn={self.ffn_size} must be multiples of the "
                f"tensor-parallel size {tp}"
            )

    def to_spec(self) -> str:
        """The spec string, with the MLP width spelled out (`ffn=0` would hide it)."""
        values = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        values["ffn"] = self.ffn_size
        return "gpt:" + ",".join(f"{k}={v}" for k, v in values.items())


def parse_gpt_spec(spec: str) -> GPTSpec:
    """`gpt` or `gpt:key=value,...` -> GPTSpec; ValueError names the bad key or value."""
    kind, _, rest = spec.strip().partition(":")
    if kind != "gpt":
        raise ValueError(f"model spec {spec!r}: unknown kind {kind!r}; valid: gpt")
    fields = {f.name for f in dataclasses.fields(GPTSpec)}
    kwargs: dict[str, Any] = {}
    for item in filter(None, (s.strip() for s in rest.split(","))):
        key, eq, value = item.partition("=")
        key = key.strip()
        if not eq or key not in fields:
            raise ValueError(
                f"model spec {spec!r}: bad item {item!r}; use key=value with key in "
                f"{', '.join(sorted(fields))}"
            )
        try:
            kwargs[key] = int(value)
        except ValueError:
            raise ValueError(
                f"model spec {spec!r}: {key} must be an integer, got {value!r}"
            ) from None
    return GPTSpec(**kwargs)


class TinyGPT(nn.Module):
    """Embeddings -> dist-quant TransformerLayers -> LayerNorm -> LM head; input `(batch, seq)`."""

    def __init__(self, spec: GPTSpec, *, tp_group: Any = None) -> None:
        # the kernels load here, in the ranks, not in the launcher that only parses the spec
        from dist_quant.modules import TransformerLayer

        super().__init__()
        tp = 1 if tp_group is None else torch.distributed.get_world_size(tp_group)
        spec.check_tp(tp)
        self.spec = spec
        self.tok_emb = nn.Embedding(spec.vocab, spec.hidden)
        self.pos_emb = nn.Embedding(spec.seq, spec.hidden)
        self.layers = nn.ModuleList(
            TransformerLayer(
                spec.hidden,
                spec.ffn_size,
                spec.heads,
                name=f"layers.{i}",
                tp_group=tp_group,
            )
            for i in range(spec.layers)
        )
        self.norm = nn.LayerNorm(spec.hidden)
        self.head = nn.Linear(spec.hidden, spec.vocab, bias=False)
        nn.init.normal_(self.tok_emb.weight, std=0.02)
        nn.init.normal_(self.pos_emb.weight, std=0.02)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        seq = tokens.shape[1]
        if seq > self.spec.seq:
            raise ValueError(
                f"TinyGPT: sequence length {seq} exceeds the model's seq={self.spec.seq}"
            )
        pos = torch.arange(seq, device=tokens.device)
        x = self.tok_emb(tokens) + self.pos_emb(pos)  # (batch, seq, hidden)
        x = x.transpose(0, 1).contiguous()  # (seq, batch, hidden): TransformerLayer's layout
        for layer in self.layers:
            x = layer(x)
        x = self.norm(x.transpose(0, 1))  # (batch, seq, hidden)
        return self.head(x)  # (batch, seq, vocab)
