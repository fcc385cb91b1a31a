"""A Llama-shaped model of dist-quant TransformerLayers under FSDP2, with per-block activation
checkpointing and live recipe switches. The same script runs on CPUs (gloo) and GPUs (NCCL).

    dist-quant run --nproc 2 examples/train_llama_fsdp.py --steps 50
    dist-quant switch current          # from another terminal: every rank switches at one step

Layout: `nproc < 4` shards every block over all ranks (FSDP2, 1D); `nproc >= 4` builds a (dp, tp)
DeviceMesh with tp=2, splits each block's heads and FFN over the TP pair (`tp_group=`) and shards
over dp. Each block is checkpointed with `dq.activation_checkpoint`, whose recompute quantizes as
the forward did. `--switch-at STEP --switch-to RECIPE` makes rank 0 request a switch itself, as
`dist-quant switch RECIPE --at-step STEP` would. `--fp8-all-gather` (per-tensor recipes: delayed
or current scaling, switches between those; 1D and with TP) makes FSDP2 all-gather the GEMM
weights in FP8. `--compile` compiles every block (`fullgraph=True`, one block at a time, as
torchtitan does): identical blocks share one graph (one more for the delayed-scaling recompute),
and a switch recompiles it once. With `--fp8-all-gather` the blocks compile over the FP8-gathered
weights. `--checkpoint-wrapper` checkpoints as torchtitan does instead, each block wrapped by
`checkpoint_wrapper(block, checkpoint_fn=dq.activation_checkpoint)` and the wrapper compiled (the
recompute is then part of the compiled backward).
"""

from __future__ import annotations

import argparse
import os
import threading

import torch
import torch.distributed as dist
import torch.nn.functional as F
from dist_quant.coordinator import SwitchBusyError, attach, request_switch
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

import dist_quant as dq
from dist_quant.fsdp import enable_fp8_all_gather, precompute_fp8_weight_scales


class Llama(nn.Module):
    """Token embedding, pre-norm blocks (RMSNorm, SwiGLU MLP, causal attention, no biases), final
    RMSNorm and an FP8 output head. Tokens (batch, seq) -> logits (batch, seq, vocab)."""

    def __init__(
        self,
        vocab: int,
        hidden: int,
        ffn: int,
        heads: int,
        layers: int,
        tp_group,
        checkpoint_wrapped: bool = False,
    ) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, hidden)
        self.layers = nn.ModuleList(
            dq.TransformerLayer(
                hidden,
                ffn,
                heads,
                normalization="RMSNorm",
                activation="swiglu",
                bias=False,
                tp_group=tp_group,
            )
            for _ in range(layers)
        )
        if checkpoint_wrapped:  # torchtitan's way: the wrapper checkpoints, forward just calls
            for i, layer in enumerate(self.layers):
                self.layers[i] = checkpoint_wrapper(layer, checkpoint_fn=dq.activation_checkpoint)
        self.checkpoint_wrapped = checkpoint_wrapped
        self.norm = nn.RMSNorm(hidden)
        self.head = dq.Linear(hidden, vocab, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens).transpose(0, 1)  # (seq, batch, hidden): the layers' "sbhd"
        for layer in self.layers:
            x = layer(x) if self.checkpoint_wrapped else dq.activation_checkpoint(layer, x)
        # contiguous: FSDP2 warns on a root output that is a view
        return self.head(self.norm(x)).transpose(0, 1).contiguous()


def batch(step: int, dp_rank: int, args, device) -> tuple[torch.Tensor, torch.Tensor]:
    """Synthetic next-token data with a learnable rule: target = (3 * token + 1) mod vocab."""
    g = torch.Generator().manual_seed(1000 * step + dp_rank)
    tokens = torch.randint(0, args.vocab, (args.batch, args.seq), generator=g)
    return tokens.to(device), ((3 * tokens + 1) % args.vocab).to(device)


def request_switch_at(recipe: str, step: int, run_dir: str) -> None:
    """Rank 0's own switch request (a client of the job's coordinator, like `dist-quant switch`)."""
    while True:
        try:
            result = request_switch(recipe, at_step=step, timeout_s=60.0, run_dir=run_dir)
        except SwitchBusyError:
            continue  # a previous switch is still publishing
        outcome = f"committed=True at step {result.step}" if result.committed else result.summary
        print(f"switch to {recipe}: {outcome}", flush=True)
        return


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--log-every", type=int, default=1)
    p.add_argument("--recipe", default="bf16", help="starting recipe (a built-in name)")
    p.add_argument("--switch-at", type=int, default=None, metavar="STEP")
    p.add_argument("--switch-to", default="current", metavar="RECIPE")
    p.add_argument("--vocab", type=int, default=64)
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--ffn", type=int, default=128)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--batch", type=int, default=4, help="sequences per data-parallel rank")
    p.add_argument("--seq", type=int, default=16)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument(
        "--fp8-all-gather",
        action="store_true",
        help="all-gather the GEMM weights in FP8 (delayed or current scaling; with or without TP)",
    )
    p.add_argument(
        "--compile",
        action="store_true",
        help="torch.compile every block (fullgraph, per block)",
    )
    p.add_argument(
        "--checkpoint-wrapper",
        action="store_true",
        help="checkpoint each block with checkpoint_wrapper (then compile it: torchtitan's order)",
    )
    p.add_argument("--run-dir", default=os.environ.get("DIST_QUANT_RUN_DIR", "dist_quant_run"))
    args = p.parse_args()
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    tp = 2 if world >= 4 and world % 2 == 0 else 1
    mesh = init_device_mesh(device.type, (world // tp, tp), mesh_dim_names=("dp", "tp"))
    dp_mesh, tp_group = mesh["dp"], (mesh["tp"].get_group() if tp > 1 else None)

    # The same seed everywhere: replicated weights (embedding, norms, head) start equal on the TP
    # ranks and stay equal (every TP rank sees the same batch and the same full activations).
    torch.manual_seed(0)
    model = Llama(
        args.vocab,
        args.hidden,
        args.ffn,
        args.heads,
        args.layers,
        tp_group,
        checkpoint_wrapped=args.checkpoint_wrapper,
    ).to(device)
    dq.apply_recipe(model, dq.recipe_from_dict(args.recipe))
    participant = attach(model, tp_group=tp_group, run_dir=args.run_dir)
    if args.fp8_all_gather:
        enable_fp8_all_gather(model)  # before fully_shard; TP blocks gather their TP shards
    for layer in model.layers:
        if args.compile:
            layer.compile(fullgraph=True)  # in place: parameter names and checkpoints unchanged
        fully_shard(layer, mesh=dp_mesh)
    fully_shard(model, mesh=dp_mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
    if rank == 0:
        print(f"world {world}: dp {world // tp} x tp {tp} on {device.type}", flush=True)
        if args.switch_at is not None:
            threading.Thread(
                target=request_switch_at,
                args=(args.switch_to, args.switch_at, args.run_dir),
                daemon=True,
            ).start()
    try:
        for step in range(args.steps):
            participant.step_boundary(step)  # a committed switch takes effect here, on every rank
            tokens, targets = batch(step, mesh["dp"].get_local_rank(), args, device)
            # delayed-scaling amaxes reduced over the whole job: every replica keeps one scale
            with dq.autocast(amax_reduction_group=dist.group.WORLD):
                logits = model(tokens)
            loss = F.cross_entropy(logits.float().reshape(-1, args.vocab), targets.reshape(-1))
            opt.zero_grad(set_to_none=True)
            # outside autocast (the blocks' recompute replays their forward), on this thread
            # rather than the engine's CUDA worker thread (docs/performance.md)
            with torch.autograd.set_multithreading_enabled(False):
                loss.backward()
            opt.step()
            if args.fp8_all_gather:
                precompute_fp8_weight_scales(model)  # current scaling: one all-reduce for all
            reported = loss.detach().clone()
            dist.all_reduce(reported)
            if rank == 0 and step % args.log_every == 0:
                recipe = dq.current_recipe(model).name
                print(f"step {step} loss {reported.item() / world:.4f} recipe {recipe}", flush=True)
        dist.barrier()  # rank 0 hosts the coordinator: nobody stops it while a peer still runs
    finally:
        participant.close()
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
