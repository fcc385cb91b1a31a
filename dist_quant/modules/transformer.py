"""`TransformerLayer`: pre-norm self-attention and MLP blocks with residual connections.

    h   = x + self_attention(x)     # MultiheadAttention with its input LayerNorm (LayerNormLinear qkv)
    out = h + mlp(h)                # LayerNormMLP

Residual adds run in high precision. Held in an `nn.ModuleList` called `layers`, layer N's roles
are named `layers.N.self_attention.{qkv,core_attention,proj}` and `layers.N.mlp.{fc1,fc2}`.
"""

from __future__ import annotations

import torch

from dist_quant.modules.attention import check_gqa_groups
from dist_quant.modules.base import QuantizedModule, check_sizes
from dist_quant.modules.layernorm_mlp import LayerNormMLP
from dist_quant.modules.multihead_attention import MultiheadAttention
from dist_quant.parallel import group_size


class TransformerLayer(QuantizedModule):
    """One transformer layer on (seq, batch, hidden) ("sbhd", Transformer Engine's default) or
    (batch, seq, hidden) ("bshd") input. `num_gqa_groups` key/value heads (None: one per query
    head) make its attention grouped-query, and `kv_channels` (None: hidden / heads) sets the head
    width (see `MultiheadAttention`)."""

    def __init__(
        self,
        hidden_size: int,
        ffn_hidden_size: int,
        num_attention_heads: int,
        *,
        num_gqa_groups: int | None = None,
        kv_channels: int | None = None,
        self_attn_mask_type: str = "causal",
        attn_input_format: str = "sbhd",
        normalization: str = "LayerNorm",
        activation: str = "gelu",
        eps: float = 1e-5,
        bias: bool = True,
        name: str | None = None,
        tp_group=None,
        sequence_parallel: bool = False,
        params_dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
    ) -> None:
        owner = f"TransformerLayer {name!r}"
        check_sizes(
            owner,
            hidden_size=hidden_size,
            ffn_hidden_size=ffn_hidden_size,
            num_attention_heads=num_attention_heads,
        )
        if kv_channels is not None:
            check_sizes(owner, kv_channels=kv_channels)
        check_gqa_groups(owner, num_attention_heads, num_gqa_groups, group_size(tp_group))
        super().__init__(name=name)
        common = {
            "normalization": normalization,
            "eps": eps,
            "bias": bias,
            "tp_group": tp_group,
            "sequence_parallel": sequence_parallel,
            "params_dtype": params_dtype,
            "device": device,
        }
        self.self_attention = MultiheadAttention(
            hidden_size,
            num_attention_heads,
            num_gqa_groups=num_gqa_groups,
            kv_channels=kv_channels,
            attn_mask_type=self_attn_mask_type,
            qkv_format=attn_input_format,
            input_layernorm=True,
            **common,
        )
        # Tensor parallelism of the MLP (fc1 column, fc2 row) is wired inside LayerNormMLP.
        self.mlp = LayerNormMLP(hidden_size, ffn_hidden_size, activation=activation, **common)

    def forward(
        self,
        hidden_states: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        *,
        is_first_microbatch: bool | None = None,
    ) -> torch.Tensor:
        attn = self.self_attention(
            hidden_states, attention_mask, is_first_microbatch=is_first_microbatch
        )
        h = hidden_states + attn
        return h + self.mlp(h, is_first_microbatch=is_first_microbatch)
