"""A machine without Triton (a CPU-only install: it is no dependency there) imports the package
and trains on the reference paths, bit for bit as with Triton installed; a Triton kernel asked
to launch there says what is missing.

Absence is simulated in a fresh interpreter (`sys.modules["triton"] = None`, before torch is
imported), so no test depends on what this machine has installed.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys

import torch

import dist_quant as dq

RECIPES = ["delayed", "current", "mxfp8", "block", "nvfp4", "bf16"]

# None in sys.modules is Python's own "not importable": `import triton` raises
# ModuleNotFoundError and `importlib.util.find_spec("triton")` answers None, as without the package
# (torch itself probes Triton both ways when it is imported).
BLOCK_TRITON = """
import sys
sys.modules["triton"] = None
"""

TRAIN = """
import hashlib, json, os
import torch
import dist_quant as dq
from dist_quant.kernels import cast
from dist_quant.kernels._triton import HAVE_TRITON

def digests(recipe):
    torch.manual_seed(0)
    model = torch.nn.Sequential(dq.Linear(32, 48), dq.LayerNormMLP(48, 64))
    dq.apply_recipe(model, dq.recipe_from_dict(recipe))
    x = torch.randn(16, 32, generator=torch.Generator().manual_seed(1), requires_grad=True)
    with dq.autocast():
        y = model(x)
    y.float().square().sum().backward()
    tensors = [y.detach(), x.grad] + [p.grad for p in model.parameters()]
    return [hashlib.sha256(t.contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()
            for t in (t.float() for t in tensors)]

out = {"have_triton": HAVE_TRITON, "digests": {r: digests(r) for r in RECIPES}}
try:
    cast.cast_to_fp8_triton(torch.ones(4, 4), torch.ones(1), torch.float8_e4m3fn)
    out["launch"] = "launched"
except RuntimeError as e:
    out["launch"] = str(e)
out["triton_modules"] = sorted(
    m for m, mod in sys.modules.items() if m.split(".")[0] == "triton" and mod is not None
)
print(json.dumps(out))
"""


def _digests(recipe: str) -> list[str]:
    """The same step in this process (whatever it has installed): CPU tensors take the
    reference paths either way."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(dq.Linear(32, 48), dq.LayerNormMLP(48, 64))
    dq.apply_recipe(model, dq.recipe_from_dict(recipe))
    x = torch.randn(16, 32, generator=torch.Generator().manual_seed(1), requires_grad=True)
    with dq.autocast():
        y = model(x)
    y.float().square().sum().backward()
    tensors = [y.detach(), x.grad] + [p.grad for p in model.parameters()]
    return [
        hashlib.sha256(t.float().contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()
        for t in tensors
    ]


def test_without_triton_the_package_imports_and_trains_bit_for_bit_as_with_it() -> None:
    code = BLOCK_TRITON + f"RECIPES = {RECIPES!r}\n" + TRAIN
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout.splitlines()[-1])
    assert got["have_triton"] is False and got["triton_modules"] == []
    assert "Triton is not installed" not in proc.stderr  # nothing warned on the CPU paths
    assert "Triton not available" not in proc.stderr  # torch's triton_op was not asked
    for recipe in RECIPES:
        assert got["digests"][recipe] == _digests(recipe), recipe
    assert got["launch"].startswith("kernel _cast_kernel: Triton is not installed: "), got
