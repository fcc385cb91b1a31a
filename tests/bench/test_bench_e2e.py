"""bench/bench_e2e.py at tiny size on the CPU, so that the script cannot rot between GPU runs: the
driver starts one process per variant, a missing optional package skips its variant with a note,
and the JSON holds every number the table prints, the ratio's baseline included."""

import dataclasses
import importlib.util
import json
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench"
sys.path.insert(0, str(BENCH))

import bench_e2e  # noqa: E402
from e2e_models import TINY, VARIANTS, build  # noqa: E402


def test_tiny_cpu_run_measures_each_variant_in_its_own_process(tmp_path, capsys):
    out = tmp_path / "e2e.json"
    names = ["bf16-compiled", "dq-delayed-eager", "torchao-rowwise", "te-layer-delayed"]
    bench_e2e.main(
        ["--device", "cpu", "--tiny", "--compile-backend", "eager", "--steps", "1",
         "--variants", ",".join(names), "--json", str(out)]
    )  # fmt: skip
    got = json.loads(out.read_text())
    assert list(got["results"]) == names and got["baseline"] == "bf16-compiled"
    assert got["dims"]["kv_heads"] == TINY.kv_heads < TINY.heads  # grouped-query attention
    for name in names[:2]:
        r = got["results"][name]
        assert r["status"] == "ok", r
        assert r["ms_per_step"] > 0 and r["first_step_s"] > 0 and r["peak_mib"] > 0
        assert r["tokens_per_s"] == pytest.approx(TINY.seq / (r["ms_per_step"] / 1e3))
    for name, package in (
        ("torchao-rowwise", "torchao"),
        ("te-layer-delayed", "transformer_engine"),
    ):
        if importlib.util.find_spec(package) is None:
            assert got["results"][name] == {
                "status": "skipped",
                "note": f"{package} is not importable",
            }
    table = capsys.readouterr().out
    assert "| bf16-compiled |" in table and "| 1.00x |" in table


def test_layer_and_block_variants_hold_the_same_weights_for_a_tp_shard_shape():
    """A TP=8 rank of Llama-3-70B has heads * head_dim != dim: the dq TransformerLayer variant
    (kv_channels) and the torch blocks must hold the same GEMM shapes, so they time one model."""
    dims = dataclasses.replace(TINY, head_dim=TINY.head_dim * 2, layers=1)
    layer = build("dq-layer-delayed", dims, "cpu").model.layers[0]
    block = build("bf16-eager", dims, "cpu").model.layers[0]
    assert VARIANTS["dq-layer-delayed"].family == "dq-layer"
    qkv_rows = sum(block.get_submodule(n).weight.shape[0] for n in ("wq", "wk", "wv"))
    assert layer.self_attention.qkv.weight.shape == (qkv_rows, dims.dim)
    assert layer.self_attention.proj.weight.shape == block.wo.weight.shape
    assert layer.mlp.fc1_weight.shape == (2 * dims.ffn, dims.dim)
    assert layer.mlp.fc2_weight.shape == block.w2.weight.shape
