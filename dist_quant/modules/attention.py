"""`DotProductAttention`: softmax(Q K^T / sqrt(d)) V, in FP8 when the recipe asks (`fp8_dpa`).

Slots (Transformer Engine's order):
    forward   0 qkv   1 s   2 o      roles dpa/qkv, dpa/s, output_quantizer_role or dpa/o
    backward  0 do    1 dp  2 dqkv   roles dpa/do, dpa/dp, grad_input_quantizer_role or dpa/dqkv

What each slot quantizes (as in cuDNN's FP8 attention): `qkv` each of q, k and v (one quantizer,
three tensors: per-tensor current scaling gives each its own scale, delayed scaling one shared
scale); `s` the softmax output P (the operand of P V and P^T dO); `o` the output; `do` the incoming
output gradient; `dp` the gradient of the scores (the operand of dS K and dS^T Q); `dqkv` the
gradients of q, k and v. `MultiheadAttention` gives the `o` / `dqkv` slots the roles of the linears
that consume them (`linear/input@<proj>`, `linear/grad_output@<qkv>`).

With per-tensor FP8 (delayed or current scaling) on the qkv, s, do and dp slots, FP8 attention is
`fp8_attention.flash_fp8_attention`: on CUDA (head dims 64 and 128) the Triton flash kernels of
`kernels/attention.py`, FP8 GEMMs with fp32 accumulation and no seq x seq buffer; on CPU their
float64 definition (`kernels/reference_attention.py`), which the kernels match within the tolerance
of docs/fp8_attention.md. Other kinds on those slots (MXFP8, identity) are emulated: fp32 math with
a quantize-dequantize on every slot's tensor (forward slots on the way in, backward slots on the
gradient's way back, through a straight-through autograd Function), on any device. Without
`fp8_dpa` (or with autocast off) attention is exactly
`torch.nn.functional.scaled_dot_product_attention`; the roles and their quantizers exist either
way, so a recipe switch never changes the slot layout.

FP8 attention supports per-tensor FP8 (delayed or current), MXFP8 and identity quantizers. The
check needs the recipe's `fp8_dpa`, which the planning hook does not see, so it runs once per new
runtime at the first FP8 forward, before anything is quantized: an attention slot holding another
kind raises ValueError naming the module and role. A boundary slot holding a neighbouring linear's
role (`o`, `dqkv` under MultiheadAttention) may hold any kind; when attention cannot produce that
kind, the tensor leaves in high precision and the consuming linear quantizes it with its own slot.

Grouped-query attention (`num_gqa_groups`, Transformer Engine's name: the number of key/value
heads, each shared by `num_attention_heads / num_gqa_groups` consecutive query heads): k and v keep
their KV heads through every slot (FP8 attention rounds k, v and their gradients at KV-head shape,
as a fused kernel reads and writes them) and are broadcast to the query heads only inside the
attention product. Tensor parallelism splits the KV heads over the ranks with their query groups.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
import torch.torch_version

from dist_quant.binding import ForwardPlan
from dist_quant.forward import delayed_anchor, forward_plan
from dist_quant.kinds import ScalingKind
from dist_quant.modules.base import QuantizedModule, check_sizes
from dist_quant.modules.fp8_attention import AttentionSlots, flash_fp8_attention, round_slots
from dist_quant.parallel import group_size, tp_amax_quantizer
from dist_quant.roles import QuantizerRole
from dist_quant.runtime import ModuleRuntime

MASK_TYPES = ("no_mask", "causal", "padding", "padding_causal")
QKV_FORMATS = ("sbhd", "bshd")
FWD_SLOTS = ("qkv", "s", "o")
BWD_SLOTS = ("do", "dp", "dqkv")
# SDPA broadcasts KV heads itself from torch 2.5 (`enable_gqa`); before, k and v are repeated
_SDPA_HAS_GQA = torch.torch_version.TorchVersion(torch.__version__) >= (2, 5)


def repeat_kv(t: torch.Tensor, num_heads: int) -> torch.Tensor:
    """(b, kv_heads, s, d) -> (b, num_heads, s, d): KV head j serves query heads
    [j * group, (j + 1) * group), group = num_heads / kv_heads; backward sums over each group."""
    group = num_heads // t.shape[1]
    return t if group == 1 else t.repeat_interleave(group, dim=1)


def fp8_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    masked: torch.Tensor | None,
    slots: AttentionSlots,
) -> torch.Tensor:
    """Emulated FP8 attention on (batch, heads, seq, head_dim) tensors, k and v with their own
    (KV) head count; fp32 math, output in q's dtype. `masked` (broadcast to (b, h, sq, sk)) is
    True where a query may not see a key. The path of slots `flash_fp8_attention` does not take
    (MXFP8, or identity on one of qkv/s/do/dp): P is rounded normalised, dS with its slot's own
    scale."""
    # contiguous: the layout permutes leave strided views, and cast kernels want dense rows
    q_, k_, v_ = (
        round_slots(t.float().contiguous(), slots.qkv, slots.dqkv, slots) for t in (q, k, v)
    )
    # after the rounding: dk and dv are rounded once summed over their query group
    k_, v_ = repeat_kv(k_, q.shape[1]), repeat_kv(v_, q.shape[1])
    scores = (q_ @ k_.transpose(-2, -1)) * (1.0 / math.sqrt(q.shape[-1]))  # (b, h, sq, sk)
    scores = round_slots(scores, None, slots.dp, slots)
    if masked is not None:
        scores = scores.masked_fill(masked, float("-inf"))
    p = round_slots(torch.softmax(scores, dim=-1), slots.s, None, slots)
    out = (p @ v_).to(q.dtype)  # (b, h, sq, d)
    return round_slots(out, slots.o, slots.do, slots)


def check_gqa_groups(
    owner: str, num_attention_heads: int, num_gqa_groups: int | None, tp_size: int
) -> int:
    """The number of KV heads (`num_gqa_groups`, None: one per query head), checked: it divides
    the query heads, and the tensor-parallel size divides both (each rank holds whole groups)."""
    kv_heads = num_attention_heads if num_gqa_groups is None else num_gqa_groups
    check_sizes(owner, num_gqa_groups=kv_heads)
    if num_attention_heads % kv_heads:
        raise ValueError(
            f"{owner}: num_gqa_groups={kv_heads} must divide "
            f"num_attention_heads={num_attention_heads}"
        )
    if kv_heads % tp_size:  # then num_attention_heads % tp_size == 0 too
        what = (
            f"num_attention_heads={num_attention_heads}"
            if num_gqa_groups is None
            else f"num_gqa_groups={kv_heads} (the key/value heads, which tensor parallelism splits)"
        )
        raise ValueError(f"{owner}: {what} must be divisible by the tensor-parallel size {tp_size}")
    return kv_heads


class DotProductAttention(QuantizedModule):
    """Scaled dot-product attention over (seq, batch, heads, head_dim) tensors ("sbhd", Transformer
    Engine's default) or (batch, seq, heads, head_dim) ("bshd"); returns (..., heads * head_dim)
    in the same layout. Masks: "causal" (top-left aligned), "padding" (`attention_mask` True where a
    key is masked out, broadcastable to (batch, 1, seq_q, seq_kv)), "padding_causal", "no_mask".

    `num_gqa_groups` (None: `num_attention_heads`, plain multi-head attention) is the number of
    key/value heads; it must divide `num_attention_heads`. Key and value then carry
    `num_gqa_groups` heads, query head h attending with KV head h // (heads / groups).

    It has no weights, hence no `params_dtype` / `parallel_mode`; `device` places its
    delayed-scaling buffers (they follow `.to()`). With a `tp_group` of more than one rank the
    inputs hold this rank's `num_attention_heads / tp` query heads and `num_gqa_groups / tp` KV
    heads, and its current-scaling quantizers reduce their amax over the group (every tensor here
    is a head shard), so each rank casts with the scale of the whole tensor.
    """

    module_type = "dpa"
    owns_quantizers = True

    def __init__(
        self,
        num_attention_heads: int,
        kv_channels: int,
        *,
        num_gqa_groups: int | None = None,
        attn_mask_type: str = "causal",
        qkv_format: str = "sbhd",
        name: str | None = None,
        tp_group=None,
        sequence_parallel: bool = False,
        device: torch.device | str | None = None,
    ) -> None:
        owner = f"DotProductAttention {name!r}"
        check_sizes(owner, num_attention_heads=num_attention_heads, kv_channels=kv_channels)
        tp_size = group_size(tp_group)
        kv_heads = check_gqa_groups(owner, num_attention_heads, num_gqa_groups, tp_size)
        super().__init__(name=name)
        if attn_mask_type not in MASK_TYPES:
            raise ValueError(
                f"{owner}: attn_mask_type must be one of {', '.join(MASK_TYPES)}, got {attn_mask_type!r}"
            )
        if qkv_format not in QKV_FORMATS:
            raise ValueError(
                f"{owner}: qkv_format must be one of {', '.join(QKV_FORMATS)}, got {qkv_format!r}"
            )
        if sequence_parallel:
            raise NotImplementedError(
                f"{owner}: attention does not shard the sequence (no context parallelism); under "
                "sequence parallelism MultiheadAttention's qkv GEMM hands it the whole sequence"
            )
        self.tp_group, self.tp_size = tp_group, tp_size
        self.num_attention_heads, self.kv_channels = num_attention_heads, kv_channels
        self.num_gqa_groups = kv_heads
        self.local_heads = num_attention_heads // tp_size  # the query heads this rank computes
        self.local_kv_heads = kv_heads // tp_size  # and the KV heads they attend with
        self.attn_mask_type, self.qkv_format = attn_mask_type, qkv_format
        # no parameters to take the device from: this empty buffer carries it through .to()
        self.register_buffer("_device_anchor", torch.empty(0, device=device), persistent=False)

    def quantizer_device(self) -> torch.device:
        return self._device_anchor.device

    def num_quantizers(self, *, fwd: bool) -> int:
        return len(FWD_SLOTS) if fwd else len(BWD_SLOTS)

    def get_quantizer_roles(self, *, fwd: bool, num_quantizers: int) -> list[QuantizerRole | None]:
        self._check_num_quantizers(fwd, num_quantizers)
        name, t = self.role_name, self.module_type
        if fwd:
            return [
                QuantizerRole(t, "qkv", name),
                QuantizerRole(t, "s", name),
                self.output_quantizer_role or QuantizerRole(t, "o", name),
            ]
        return [
            QuantizerRole(t, "do", name),
            QuantizerRole(t, "dp", name),
            self.grad_input_quantizer_role or QuantizerRole(t, "dqkv", name),
        ]

    # ---- FP8 slots --------------------------------------------------------------------------
    def validate_quantizers(
        self, quantizers: list, roles: tuple, *, fwd: bool, recipe: Any
    ) -> None:
        """ValueError naming the role if, under an `fp8_dpa` recipe, an attention slot holds a kind
        FP8 attention cannot use. Slots carrying a neighbouring linear's role are exempt (see the
        module docstring), and without `fp8_dpa` the slots are never applied, so anything goes."""
        super().validate_quantizers(quantizers, roles, fwd=fwd, recipe=recipe)
        if not getattr(recipe, "fp8_dpa", False):
            return
        for q, role in zip(quantizers, roles):
            if role.module_type == self.module_type and not q.scaling.fp8_attention:
                raise ValueError(
                    f"DotProductAttention {self.role_name!r}: role {role} got "
                    f"{type(q).__name__} ({q.scaling.value!r} scaling); FP8 attention supports "
                    "per-tensor FP8 (delayed or current), MXFP8 or identity"
                )

    def plan_forward(self, runtime: ModuleRuntime, reduction_group: Any) -> ForwardPlan:
        """The quantizers FP8 attention applies (the plan's one "GEMM"), or None when attention
        runs in high precision (no `fp8_dpa`, or every slot identity); then nothing is enrolled."""
        slots = self._fp8_slots(runtime, reduction_group)
        anchor = None if slots is None else delayed_anchor(runtime)
        return ForwardPlan(runtime, reduction_group, (slots,), anchor)

    def _fp8_slots(self, runtime: ModuleRuntime, reduction_group: Any) -> AttentionSlots | None:
        if not getattr(runtime.recipe, "fp8_dpa", False):
            return None
        # identity: nothing to round; an unsupported kind (only possible on a boundary slot
        # carrying a linear's role): the tensor leaves in high precision, its consumer rounds it
        applied = [
            None if q.scaling is ScalingKind.IDENTITY or not q.scaling.fp8_attention else q
            for q in (*runtime.fwd_quantizers, *runtime.bwd_quantizers)
        ]
        if self.tp_size > 1:  # copies reducing their amax over the heads' TP group
            applied = [None if q is None else tp_amax_quantizer(q, self.tp_group) for q in applied]
        if all(q is None for q in applied):
            return None
        return AttentionSlots(
            *applied,
            bwd_groups=tuple(runtime.delayed_groups(fwd=False)),
            reduction_group=reduction_group,
            enrol_key=self.quant_binding.plan_key(),
        )

    # ---- forward ----------------------------------------------------------------------------
    def _owner(self) -> str:
        # built only for an error: a traced forward that read the name would be specialised on it,
        # and identical blocks compiled one at a time could not share their graph
        return f"DotProductAttention {self.role_name!r}"

    def _checked_padding(self, attention_mask: torch.Tensor | None) -> torch.Tensor | None:
        """`attention_mask` (True = masked out) checked against the mask type: the padding types
        need a bool one, the others take none."""
        padding = self.attn_mask_type.startswith("padding")
        if padding != (attention_mask is not None):
            raise ValueError(
                f"{self._owner()}: attn_mask_type={self.attn_mask_type!r} "
                + ("needs an attention_mask" if padding else "takes no attention_mask")
            )
        if padding and attention_mask.dtype != torch.bool:
            raise ValueError(
                f"{self._owner()}: attention_mask must be a bool tensor (True = masked out), "
                f"got {attention_mask.dtype}"
            )
        return attention_mask

    def _masked(
        self, padding: torch.Tensor | None, sq: int, sk: int, device: torch.device
    ) -> torch.Tensor | None:
        """Boolean mask, True where a query may not attend a key (padding, and the causal part,
        built here at (sq, sk)); None when nothing is masked. Built only by the paths that read
        it."""
        masked = padding
        if self.attn_mask_type.endswith("causal"):
            causal = torch.ones(sq, sk, dtype=torch.bool, device=device).triu(1)
            masked = causal if masked is None else masked | causal
        return masked

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        h, hkv, d = self.local_heads, self.local_kv_heads, self.kv_channels
        for label, t, heads in (("query", query, h), ("key", key, hkv), ("value", value, hkv)):
            if t.dim() != 4 or t.shape[-2:] != (heads, d):
                raise ValueError(
                    f"{self._owner()}: {label} must be 4D {self.qkv_format} with {heads} heads of "
                    f"{d} channels, got shape {tuple(t.shape)}"
                )
        sbhd = self.qkv_format == "sbhd"
        # (seq, batch, h, d) or (batch, seq, h, d) -> (batch, h, seq, d)
        q, k, v = (
            t.permute(1, 2, 0, 3) if sbhd else t.transpose(1, 2) for t in (query, key, value)
        )
        sq, sk = q.shape[2], k.shape[2]
        padding = self._checked_padding(attention_mask)
        plan = forward_plan(self)
        slots = None if plan is None else plan.gemms[0]
        if slots is None:
            # causal alone is SDPA's own flag: no (sq, sk) mask is built (64 MB at seq 8192)
            causal_only = self.attn_mask_type == "causal"
            keep = None if padding is None else ~self._masked(padding, sq, sk, q.device)
            gqa = {}
            if hkv != h and _SDPA_HAS_GQA:
                gqa = {"enable_gqa": True}  # broadcast inside SDPA, no repeated copy of k and v
            elif hkv != h:
                k, v = repeat_kv(k, h), repeat_kv(v, h)
            out = F.scaled_dot_product_attention(
                q, k, v, attn_mask=keep, is_causal=causal_only, **gqa
            )
        elif slots.flash:  # masks applied tile by tile: nothing of size (sq, sk) is built
            causal = self.attn_mask_type.endswith("causal")
            out = flash_fp8_attention(q, k, v, padding, causal, slots)
        else:
            masked = self._masked(padding, sq, sk, q.device)
            out = fp8_attention(q, k, v, masked, slots)
        # (batch, h, sq, d) -> the input's layout, heads flattened
        out = out.permute(2, 0, 1, 3) if sbhd else out.transpose(1, 2)
        return out.reshape(*out.shape[:2], h * d)

    def extra_repr(self) -> str:
        return (
            f"num_attention_heads={self.num_attention_heads}, kv_channels={self.kv_channels}, "
            f"num_gqa_groups={self.num_gqa_groups}, attn_mask_type={self.attn_mask_type}, "
            f"qkv_format={self.qkv_format}, name={self.role_name!r}"
        )
