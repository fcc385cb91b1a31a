"""Which GPU path FP8 attention takes (`kernels/attention_cudnn.py`): the choice a user sets with
DIST_QUANT_FP8_ATTENTION, refused when misspelt, and never cuDNN off the GPU."""

import os
import subprocess
import sys

import torch
from dist_quant.kernels.attention_cudnn import cudnn_runs


def test_an_unknown_fp8_attention_path_is_refused_naming_the_variable():
    env = {**os.environ, "DIST_QUANT_FP8_ATTENTION": "cudn"}
    proc = subprocess.run(
        [sys.executable, "-c", "import dist_quant.kernels.attention_cudnn"],
        env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode != 0
    assert "DIST_QUANT_FP8_ATTENTION='cudn': expected one of ('cudnn', 'triton')" in proc.stderr


def test_cudnn_never_takes_cpu_tensors():
    x = torch.zeros(1, 2, 16, 128, dtype=torch.float8_e4m3fn)
    assert not cudnn_runs(x, x, None, torch.float8_e4m3fn)
