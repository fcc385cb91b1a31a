"""Telemetry per slot in one process: counts equal a float64 re-derivation from the inputs."""

import json

import numpy as np
import pytest
import torch

import dist_quant as dq
from dist_quant.telemetry import STATS_FILE, Telemetry, read_stats


def _step(model, telemetry, step, x, recipe):
    telemetry.begin_step(step)
    with dq.autocast(recipe=recipe):
        y = model(x)
    y.float().sum().backward()
    return telemetry.end_step()


def _by_slot(record):
    return {(s.module, s.tensor_type, s.direction): s for s in record.slots}


def test_delayed_input_saturation_equals_a_float64_count_with_the_scale_of_the_last_step(tmp_path):
    torch.manual_seed(0)
    model = dq.Linear(64, 16, name="fc")
    recipe = dq.DelayedScaling(amax_history_len=1)
    t = Telemetry(model, stats_interval=1, run_dir=tmp_path)
    x0 = torch.randn(8, 64)
    _step(model, t, 0, x0, recipe)
    x1 = torch.randn(8, 64) * 4  # past the scale that step 0's amax set
    x1[3, 5] = float("inf")
    x1[0, :10] = 1e-30  # underflows
    rec = _step(model, t, 1, x1, recipe)
    s = _by_slot(rec)[("fc", "input", "forward")]
    scale = np.float32(448.0) / np.float32(x0.abs().max().item())  # fp32 IEEE division
    v = (x1.numpy() * scale).astype(np.float64)
    assert s.scale == float(scale)
    assert s.numel == x1.numel()
    assert s.saturated == int(np.sum(np.abs(v) > 448.0)) > 1
    assert s.underflowed == int(np.sum((x1.numpy() != 0) & (np.abs(v) <= 2.0**-10))) >= 10
    assert s.amax == float("inf")
    assert s.saturated_fraction == s.saturated / x1.numel()


def test_only_stats_steps_are_counted_and_written_by_rank_zero(tmp_path):
    model = dq.Linear(32, 32, name="fc")
    t = Telemetry(model, stats_interval=3, run_dir=tmp_path)
    steps = [r.step for i in range(7) if (r := _step(model, t, i, torch.randn(4, 32), None))]
    assert steps == [0, 3, 6]
    lines = (tmp_path / STATS_FILE).read_text().splitlines()
    assert [json.loads(line)["step"] for line in lines] == [0, 3, 6]
    assert [r["step"] for r in read_stats(tmp_path)] == [0, 3, 6]
    slots = {
        (s["module"], s["tensor_type"], s["direction"]) for s in read_stats(tmp_path)[0]["slots"]
    }
    assert slots == {
        ("fc", "input", "forward"),
        ("fc", "weight", "forward"),
        ("fc", "grad_output", "backward"),
    }


def test_interval_zero_counts_nothing_and_writes_nothing(tmp_path):
    model = dq.Linear(32, 32, name="fc")
    t = Telemetry(model, run_dir=tmp_path)
    assert all(_step(model, t, i, torch.randn(4, 32), None) is None for i in range(3))
    assert not (tmp_path / STATS_FILE).exists()


def test_microbatches_of_a_stats_step_are_summed(tmp_path):
    model = dq.Linear(32, 32, name="fc")
    t = Telemetry(model, stats_interval=1, run_dir=tmp_path)
    t.begin_step(0)
    for _ in range(3):
        with dq.autocast(recipe=dq.Float8CurrentScaling()):
            model(torch.randn(4, 32)).sum().backward()
    s = _by_slot(t.end_step())[("fc", "input", "forward")]
    assert s.numel == 3 * 4 * 32


def test_block_scaled_slots_are_not_counted_and_say_so(tmp_path):
    model = dq.Linear(128, 128, name="fc")
    t = Telemetry(model, stats_interval=1, run_dir=tmp_path)
    with pytest.warns(UserWarning, match="per-block scales .* not counted.*fc/input/forward"):
        rec = _step(model, t, 0, torch.randn(32, 128), dq.MXFP8BlockScaling())
    assert rec.slots == ()


@pytest.mark.parametrize("bad", [-1, 1.5, True, "10"])
def test_bad_stats_interval_is_refused_naming_the_field(bad):
    with pytest.raises(ValueError, match="stats_interval must be an int >= 0"):
        Telemetry(dq.Linear(4, 4), stats_interval=bad)


def test_begin_without_end_is_refused():
    t = Telemetry(dq.Linear(4, 4), stats_interval=1)
    t.begin_step(0)
    with pytest.raises(RuntimeError, match="stats step 0 is open"):
        t.begin_step(1)
    t.close()


def test_slots_report_under_their_role_names_inside_a_fused_module(tmp_path):
    # LayerNormMLP "mlp" owns both GEMMs: fc1's and fc2's inputs are separate slots
    model = dq.LayerNormMLP(32, 64, name="mlp")
    t = Telemetry(model, stats_interval=1, run_dir=tmp_path)
    slots = _by_slot(_step(model, t, 0, torch.randn(6, 32), dq.Float8CurrentScaling()))
    assert slots[("mlp.fc1", "input", "forward")].numel == 6 * 32
    assert slots[("mlp.fc2", "input", "forward")].numel == 6 * 64
    assert slots[("mlp.fc2", "weight", "forward")].numel == 32 * 64
