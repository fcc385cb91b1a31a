"""`MultiheadAttention`: the qkv projection, `DotProductAttention` and the output projection,
with the FP8 boundary roles between them and grouped-query attention's fused qkv layout."""

from __future__ import annotations

import torch

from dist_quant.forward import active_runtime
from dist_quant.kinds import ParallelMode
from dist_quant.modules.attention import DotProductAttention, check_gqa_groups
from dist_quant.modules.base import QuantizedModule, check_sizes
from dist_quant.modules.layernorm_linear import LayerNormLinear
from dist_quant.modules.linear import Linear
from dist_quant.parallel import group_size, mark_tp_split
from dist_quant.roles import QuantizerRole


class MultiheadAttention(QuantizedModule):
    """Self-attention block: `qkv` (Linear, or LayerNormLinear with `input_layernorm=True`) ->
    `core_attention` (DotProductAttention) -> `proj` (Linear). Input and output are
    (seq, batch, hidden) ("sbhd", Transformer Engine's default) or (batch, seq, hidden) ("bshd").

    When the block is first planned (`apply_recipe`, the first autocast call, `attach`,
    `dq.checkpoint.load`, whichever comes first; its children are named by then) it wires the FP8
    boundary roles between the children, once; a forward never changes them, and a role set by
    hand afterwards stays:
        qkv.output_quantizer_role                = dpa/qkv@<core_attention>
        proj.grad_input_quantizer_role           = dpa/do@<core_attention>
        core_attention.output_quantizer_role     = linear/input@<proj>
        core_attention.grad_input_quantizer_role = linear/grad_output@<qkv>
    Under a recipe with `fp8_mha`, the qkv output and proj's input gradient are rounded through
    those slots (the FP8 hand-over into and out of attention, emulated by quantize-dequantize; the
    receiving side quantizes again with its own slot of the same role, which reproduces on-grid
    values exactly under current scaling and may round twice under delayed scaling).

    Heads have `kv_channels` channels each (None: `hidden_size / num_attention_heads`; Transformer
    Engine's name), so the attention width `num_attention_heads * kv_channels` may differ from
    `hidden_size` (a tensor-parallel rank's share of a larger model, run alone); proj maps it back.

    Grouped-query attention (`num_gqa_groups` KV heads, None: `num_attention_heads`): the qkv
    GEMM has `(num_attention_heads + 2 * num_gqa_groups) * kv_channels` outputs, laid out as Transformer
    Engine's `fuse_qkv_params=False` layout concatenates them, q rows (all query heads) then k rows
    then v rows (the KV heads): with one KV head per query head that is the `[q; k; v]` layout of
    plain multi-head attention, unchanged.

    Tensor parallel (`tp_group` of more than one rank): qkv is column-parallel with each rank
    holding its `num_attention_heads / tp` query heads and `num_gqa_groups / tp` KV heads (the
    weight rows of its chunk of each of q, k and v), attention runs on those heads, proj is
    row-parallel (its partial sums reduced once, bias added after). With `sequence_parallel` the
    input and output hold this rank's rows of dim 0 (the sequence, in "sbhd").
    """

    def __init__(
        self,
        hidden_size: int,
        num_attention_heads: int,
        *,
        num_gqa_groups: int | None = None,
        kv_channels: int | None = None,
        attn_mask_type: str = "causal",
        qkv_format: str = "sbhd",
        input_layernorm: bool = False,
        normalization: str = "LayerNorm",
        eps: float = 1e-5,
        bias: bool = True,
        name: str | None = None,
        tp_group=None,
        sequence_parallel: bool = False,
        params_dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
    ) -> None:
        owner = f"MultiheadAttention {name!r}"
        check_sizes(owner, hidden_size=hidden_size, num_attention_heads=num_attention_heads)
        if kv_channels is not None:
            check_sizes(owner, kv_channels=kv_channels)
        super().__init__(name=name)
        if kv_channels is None and hidden_size % num_attention_heads:
            raise ValueError(
                f"{owner}: hidden_size={hidden_size} must be a multiple of "
                f"num_attention_heads={num_attention_heads} (or give kv_channels)"
            )
        if not isinstance(input_layernorm, bool):
            raise ValueError(f"{owner}: input_layernorm must be a bool, got {input_layernorm!r}")
        tp_size = group_size(tp_group)
        kv_heads = check_gqa_groups(owner, num_attention_heads, num_gqa_groups, tp_size)
        self.hidden_size, self.num_attention_heads = hidden_size, num_attention_heads
        self.num_gqa_groups = kv_heads
        self.kv_channels = kv_channels or hidden_size // num_attention_heads
        width = num_attention_heads * self.kv_channels  # attention's output features
        self.local_heads = num_attention_heads // tp_size  # query heads computed on this rank
        self.local_kv_heads = kv_heads // tp_size
        qkv_size = (num_attention_heads + 2 * kv_heads) * self.kv_channels
        # Tensor parallelism, one place per GEMM: qkv splits heads (column), proj reduces (row).
        tp = tp_group is not None or sequence_parallel
        parallel = {"tp_group": tp_group, "sequence_parallel": sequence_parallel}
        common = {"bias": bias, "params_dtype": params_dtype, "device": device, **parallel}
        column, row = (ParallelMode.COLUMN, ParallelMode.ROW) if tp else (None, None)
        if input_layernorm:
            self.qkv = LayerNormLinear(
                hidden_size,
                qkv_size,
                normalization=normalization,
                eps=eps,
                parallel_mode=column,
                **common,
            )
        else:
            self.qkv = Linear(hidden_size, qkv_size, parallel_mode=column, **common)
        if tp_size > 1:
            # the qkv rows stack [q; k; v] (all heads each): a rank takes its heads of all three
            parts = (num_attention_heads // kv_heads, 1, 1)
            mark_tp_split(self.qkv, "weight", 0, parts=parts)
            if self.qkv.bias is not None:
                mark_tp_split(self.qkv, "bias", 0, parts=parts)
        self.core_attention = DotProductAttention(
            num_attention_heads,
            self.kv_channels,
            num_gqa_groups=kv_heads,
            attn_mask_type=attn_mask_type,
            qkv_format=qkv_format,
            device=device,
            tp_group=tp_group,  # the whole sequence arrives: qkv gathered it under SP
        )
        # the context's features are head-major, so this rank's heads are proj's input shard
        self.proj = Linear(width, hidden_size, parallel_mode=row, **common)

    def _wire_boundary_roles(self) -> None:
        dpa, qkv, proj = self.core_attention, self.qkv, self.proj
        qkv.output_quantizer_role = QuantizerRole(dpa.module_type, "qkv", dpa.role_name)
        proj.grad_input_quantizer_role = QuantizerRole(dpa.module_type, "do", dpa.role_name)
        dpa.output_quantizer_role = QuantizerRole(proj.module_type, "input", proj.role_name)
        dpa.grad_input_quantizer_role = QuantizerRole(qkv.module_type, "grad_output", qkv.role_name)

    def forward(
        self,
        hidden_states: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        *,
        is_first_microbatch: bool | None = None,
    ) -> torch.Tensor:
        runtime = active_runtime(self.core_attention)
        fp8_mha = runtime is not None and getattr(runtime.recipe, "fp8_mha", False)
        mixed = self.qkv(hidden_states, is_first_microbatch=is_first_microbatch, fp8_output=fp8_mha)
        # (s, b, (heads + 2 kv_heads) * d / tp) -> q (s, b, heads / tp, d), k and v
        # (s, b, kv_heads / tp, d); under SP the qkv GEMM has gathered the whole sequence
        h, hkv, d = self.local_heads, self.local_kv_heads, self.kv_channels
        q, k, v = mixed.split([h * d, hkv * d, hkv * d], dim=-1)
        q, k, v = (t.unflatten(-1, (-1, d)) for t in (q, k, v))
        context = self.core_attention(q, k, v, attention_mask)  # (s, b, heads * d / tp)
        return self.proj(context, is_first_microbatch=is_first_microbatch, fp8_grad_input=fp8_mha)

    def extra_repr(self) -> str:
        return (
            f"hidden_size={self.hidden_size}, num_attention_heads={self.num_attention_heads}, "
            f"num_gqa_groups={self.num_gqa_groups}, kv_channels={self.kv_channels}, "
            f"name={self.role_name!r}"
        )
