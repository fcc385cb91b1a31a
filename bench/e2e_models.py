"""The models of `bench_e2e.py`: Llama-3 block stacks and the way each variant builds and runs them.

A block is what torchtitan's Llama-3 block computes minus the rotary embedding (which every variant
would pay alike): RMSNorm, grouped-query attention through SDPA (causal, `enable_gqa`), RMSNorm,
SwiGLU MLP, residual adds, no biases, bf16 weights, (batch, seq, dim) activations. Each variant
gets the stack from `build(variant, dims, device)` as a `Built`: the module to call, how to wrap
its forward (an FP8 autocast, or nothing), and whether the backward runs on the calling thread.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.util
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

import dist_quant as dq


@dataclass(frozen=True)
class Dims:
    dim: int
    ffn: int
    heads: int
    kv_heads: int
    head_dim: int
    layers: int
    seq: int
    batch: int = 1

    def describe(self) -> str:
        return (
            f"d {self.dim}, ffn {self.ffn}, {self.heads}/{self.kv_heads} heads of {self.head_dim}, "
            f"{self.layers} layers, seq {self.seq}, batch {self.batch}"
        )


MODELS = {
    # Llama-3-8B layer dims, 2 layers
    "8b": Dims(dim=4096, ffn=14336, heads=32, kv_heads=8, head_dim=128, layers=2, seq=8192),
    # one TP=8 rank of a Llama-3-70B layer (64/8 query heads, 8/8 KV heads, 28672/8 ffn), 4 layers
    "70b-tp8": Dims(dim=8192, ffn=3584, heads=8, kv_heads=1, head_dim=128, layers=4, seq=8192),
}
TINY = Dims(dim=64, ffn=128, heads=4, kv_heads=2, head_dim=16, layers=2, seq=32)


@dataclass(frozen=True)
class Variant:
    family: str  # "torch" (Llama blocks, Linears maybe swapped), "dq-layer", "te-layer"
    quant: str | None  # what quantizes the GEMMs: None (BF16), "torchao-*", "te", "dq-*"
    compiled: bool  # each block torch.compile'd (torchtitan's way); else eager
    requires: str | None = None  # an optional package the variant needs
    env: tuple[tuple[str, str], ...] = ()  # set in the variant's process before it imports us


DQ_RECIPES: dict[str, Callable[[], dq.Recipe]] = {
    "delayed": dq.DelayedScaling,
    "current": dq.Float8CurrentScaling,
    "mxfp8": dq.MXFP8BlockScaling,
    "block": dq.Float8BlockScaling,
}
FP8_ATTENTION = "-fp8attn"  # the quant suffix of a variant that also runs attention in FP8
VARIANTS: dict[str, Variant] = {
    "bf16-compiled": Variant("torch", None, True),
    "bf16-eager": Variant("torch", None, False),
    "torchao-tensorwise": Variant("torch", "torchao-tensorwise", True, "torchao"),
    "torchao-rowwise": Variant("torch", "torchao-rowwise", True, "torchao"),
    **{f"dq-{r}": Variant("torch", f"dq-{r}", True) for r in DQ_RECIPES},
    **{f"dq-{r}-eager": Variant("torch", f"dq-{r}", False) for r in DQ_RECIPES},
    "dq-layer-delayed": Variant("dq-layer", "dq-delayed", False),
    "dq-layer-delayed-fp8attn": Variant("dq-layer", "dq-delayed-fp8attn", False),
    # each GPU path of FP8 attention (kernels/attention_cudnn.py)
    **{
        f"dq-layer-delayed-fp8attn-{path}": Variant(
            "dq-layer", "dq-delayed-fp8attn", False, env=(("DIST_QUANT_FP8_ATTENTION", path),)
        )
        for path in ("cudnn", "triton")
    },
    "te-layer-delayed": Variant("te-layer", "te", False, "transformer_engine"),
    "te-layer-delayed-fp8dpa": Variant("te-layer", "te-fp8attn", False, "transformer_engine"),
    "te-linear-delayed": Variant("torch", "te", False, "transformer_engine"),
}


def _dq_recipe(quant: str) -> dq.Recipe:
    """The recipe of quant "dq-<recipe>[-fp8attn]", with FP8 attention (`fp8_dpa`) for the suffix."""
    name = quant.removeprefix("dq-").removesuffix(FP8_ATTENTION)
    recipe = DQ_RECIPES[name]()
    return dataclasses.replace(recipe, fp8_dpa=True) if quant.endswith(FP8_ATTENTION) else recipe


def missing(variant: Variant) -> str | None:
    """Why the variant cannot run here (checked without importing anything), or None."""
    if variant.requires and importlib.util.find_spec(variant.requires) is None:
        return f"{variant.requires} is not importable"
    return None


class LlamaBlock(nn.Module):
    def __init__(self, d: Dims) -> None:
        super().__init__()
        self.d = d
        q, kv = d.heads * d.head_dim, d.kv_heads * d.head_dim
        self.attention_norm, self.ffn_norm = nn.RMSNorm(d.dim), nn.RMSNorm(d.dim)
        self.wq, self.wk, self.wv = (nn.Linear(d.dim, n, bias=False) for n in (q, kv, kv))
        self.wo = nn.Linear(q, d.dim, bias=False)
        self.w1, self.w3 = (nn.Linear(d.dim, d.ffn, bias=False) for _ in range(2))
        self.w2 = nn.Linear(d.ffn, d.dim, bias=False)

    def attention(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        hd = self.d.head_dim
        q = self.wq(x).view(b, s, -1, hd).transpose(1, 2)  # (b, heads, s, hd)
        k = self.wk(x).view(b, s, -1, hd).transpose(1, 2)  # (b, kv_heads, s, hd)
        v = self.wv(x).view(b, s, -1, hd).transpose(1, 2)
        gqa = {"enable_gqa": True} if self.d.kv_heads != self.d.heads else {}
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, **gqa)
        return self.wo(out.transpose(1, 2).reshape(b, s, -1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x))
        y = self.ffn_norm(h)
        return h + self.w2(F.silu(self.w1(y)) * self.w3(y))


class Stack(nn.Module):
    """`layers` blocks; `blocks` is what the forward calls (the layers, or their compiled
    wrappers), kept apart so that the parameters and state dict stay the layers'."""

    def __init__(self, layers: list[nn.Module], compiled: bool, backend: str) -> None:
        super().__init__()
        self.layers = nn.ModuleList(layers)
        self.blocks = [torch.compile(b, backend=backend) if compiled else b for b in layers]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x


@dataclass
class Built:
    model: nn.Module
    context: Callable[[], contextlib.AbstractContextManager]  # around each forward
    sbhd: bool = False  # the model takes (seq, batch, dim): the layer modules' default layout


def _te_linears(block: nn.Module) -> None:
    import transformer_engine.pytorch as te

    for name, lin in list(block.named_children()):
        if type(lin) is nn.Linear:
            new = te.Linear(lin.in_features, lin.out_features, bias=False,
                            params_dtype=lin.weight.dtype, device=lin.weight.device)  # fmt: skip
            with torch.no_grad():
                new.weight.copy_(lin.weight)
            setattr(block, name, new)


def _te_context(fp8_attention: bool) -> Callable[[], contextlib.AbstractContextManager]:
    import transformer_engine.pytorch as te
    from transformer_engine.common.recipe import DelayedScaling

    recipe = DelayedScaling(fp8_dpa=fp8_attention)
    return lambda: te.fp8_autocast(enabled=True, fp8_recipe=recipe)


def _te_layer(d: Dims, device: str) -> nn.Module:
    import transformer_engine.pytorch as te

    return te.TransformerLayer(
        d.dim, d.ffn, d.heads, num_gqa_groups=d.kv_heads, kv_channels=d.head_dim,
        normalization="RMSNorm", activation="swiglu", bias=False, hidden_dropout=0.0,
        attention_dropout=0.0, self_attn_mask_type="causal", params_dtype=torch.bfloat16,
        device=device,
    )  # fmt: skip


def build(name: str, d: Dims, device: str, backend: str = "inductor") -> Built:
    v = VARIANTS[name]
    torch.manual_seed(0)
    none = contextlib.nullcontext
    if v.family == "te-layer":
        layers = [_te_layer(d, device) for _ in range(d.layers)]
        context = _te_context(fp8_attention=v.quant.endswith(FP8_ATTENTION))
        return Built(Stack(layers, v.compiled, backend), context, sbhd=True)
    if v.family == "dq-layer":
        layers = [
            dq.TransformerLayer(
                d.dim,
                d.ffn,
                d.heads,
                num_gqa_groups=d.kv_heads,
                kv_channels=d.head_dim,
                normalization="RMSNorm",
                activation="swiglu",
                bias=False,
                params_dtype=torch.bfloat16,
                device=device,
            )
            for _ in range(d.layers)
        ]
        recipe = _dq_recipe(v.quant)
        model = Stack(layers, v.compiled, backend)
        dq.apply_recipe(model, recipe)  # planned and pinned: a compiled block needs no planning
        return Built(model, lambda: dq.autocast(recipe=recipe), sbhd=True)
    layers = [LlamaBlock(d).to(device=device, dtype=torch.bfloat16) for _ in range(d.layers)]
    context = none
    if v.quant is not None and v.quant.startswith("torchao"):
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training

        config = Float8LinearConfig.from_recipe_name(v.quant.removeprefix("torchao-"))
        for block in layers:
            convert_to_float8_training(block, config=config)
    elif v.quant == "te":
        for block in layers:
            _te_linears(block)
        context = _te_context(fp8_attention=False)
    elif v.quant is not None:
        recipe = DQ_RECIPES[v.quant.removeprefix("dq-")]()
        for block in layers:
            dq.convert_model(block)
        model = Stack(layers, v.compiled, backend)
        dq.apply_recipe(model, recipe)
        return Built(model, lambda: dq.autocast(recipe=recipe))
    return Built(Stack(layers, v.compiled, backend), context)
