"""torchtitan 0.3's llama3 debug model with `DistQuantConverter` on one GPU: built as its trainer
builds it (meta device, to_empty, init_weights), trained a few steps per recipe with torchtitan's
own model code (flex attention), step time and losses per recipe, against the unconverted model.

    python bench/torchtitan_debugmodel.py --steps 20 --out result.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
from torchtitan.models.llama3 import model_registry

import dist_quant as dq
from dist_quant.integrations.torchtitan import DistQuantConverter


def build(recipe: str | None, device: torch.device) -> torch.nn.Module:
    converters = None if recipe is None else [DistQuantConverter.Config(recipe=recipe)]
    with torch.device("meta"):
        model = model_registry("debugmodel", converters=converters).model.build()
    model.verify_module_protocol()
    model.to_empty(device=device)
    torch.manual_seed(0)
    model.init_weights(buffer_device=device)
    return model.to(torch.bfloat16)


def run(recipe: str | None, steps: int, batch: int, seq: int) -> dict:
    device = torch.device("cuda")
    model = build(recipe, device)
    opt = torch.optim.AdamW(model.parameters(), lr=8e-4)
    pos = torch.arange(seq, device=device).expand(batch, seq)
    masks = model.get_attention_masks(pos)
    losses, times = [], []
    for step in range(steps):
        g = torch.Generator(device="cpu").manual_seed(step)
        tokens = torch.randint(0, 2048, (batch, seq + 1), generator=g).to(device)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        logits = model(tokens[:, :-1], pos, masks)
        loss = torch.nn.functional.cross_entropy(
            logits.flatten(0, 1).float(), tokens[:, 1:].flatten()
        )
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
        losses.append(float(loss))
    current = dq.current_recipe(model) if recipe is not None else None
    return {
        "recipe": recipe or "unconverted",
        "published": None if current is None else type(current).__name__,
        "dist_quant_linears": sum(isinstance(m, dq.Linear) for m in model.modules()),
        "losses": losses,
        "median_step_ms_after_3": 1e3 * statistics.median(times[3:]),
    }


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--out", default="torchtitan_debugmodel.json")
    a = p.parse_args()
    results = [run(r, a.steps, a.batch, a.seq) for r in (None, "bf16", "delayed", "current")]
    for r in results:
        print(
            json.dumps({k: v for k, v in r.items() if k != "losses"}),
            "first/last loss",
            r["losses"][0],
            r["losses"][-1],
        )
    with open(a.out, "w") as f:
        json.dump(
            {
                "device": torch.cuda.get_device_name(),
                "torch": torch.__version__,
                "args": vars(a),
                "results": results,
            },
            f,
            indent=1,
        )


if __name__ == "__main__":
    main()
