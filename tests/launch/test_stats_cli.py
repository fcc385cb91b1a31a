"""`dist-quant stats` on the files a real (one-process) run writes; `status`'s guard line."""

import json

import torch
from dist_quant.coordinator.decision_log import GUARD_RECORD, DecisionLog
from dist_quant.coordinator.endpoint import LOG_FILE
from dist_quant.coordinator.errors import SwitchRequestError
from dist_quant.coordinator.guard import Observation, PrecisionGuard
from dist_quant.coordinator.guard_runner import GuardRunner
from dist_quant.launch import stats as stats_cli
from dist_quant.launch.cli import main

import dist_quant as dq
from dist_quant.telemetry import STATS_FILE, Telemetry


def _run(run_dir, steps=3, outlier_at=2):
    torch.manual_seed(0)
    model = torch.nn.Sequential(dq.Linear(32, 32, name="fc1"), dq.Linear(32, 32, name="fc2"))
    dq.apply_recipe(model, dq.DelayedScaling(amax_history_len=1))
    t = Telemetry(model, stats_interval=1, run_dir=run_dir)
    for step in range(steps):
        t.begin_step(step)
        x = torch.randn(8, 32)
        with dq.autocast():
            h = model[0](x)
            # forward outlier, gradient unscaled: only fc2 input saturates
            y = model[1](h + h.detach() * (1e4 - 1) if step == outlier_at else h)
        y.sum().backward()
        t.end_step()


def test_file_names_match_the_writers():
    assert stats_cli.STATS_FILE == STATS_FILE
    assert stats_cli.LOG_FILE == LOG_FILE
    assert stats_cli.GUARD_RECORD == GUARD_RECORD


def test_stats_ranks_the_saturated_slot_first(tmp_path, capsys):
    _run(tmp_path)
    assert main(["stats", "--run-dir", str(tmp_path), "--top", "2", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    top = out["rows"][0]
    assert (top["module"], top["tensor_type"], top["step"]) == ("fc2", "input", 2)
    assert top["saturated_fraction"] > 0.5 and len(out["rows"]) == 2
    assert out["last_guard_decision"] is None
    assert main(["stats", "--run-dir", str(tmp_path)]) == 0
    text = capsys.readouterr().out
    assert "worst FP8 slots, step 2" in text and "fc2" in text
    assert "last guard decision: none" in text


def test_stats_all_ranks_over_every_step(tmp_path, capsys):
    _run(tmp_path, steps=4, outlier_at=1)
    main(["stats", "--run-dir", str(tmp_path), "--all", "--json", "--top", "1"])
    assert json.loads(capsys.readouterr().out)["rows"][0]["step"] == 1


def test_stats_without_a_stats_file_exits_2(tmp_path, capsys):
    assert main(["stats", "--run-dir", str(tmp_path)]) == 2
    assert "no fp8_stats.jsonl" in capsys.readouterr().err


def test_stats_shows_the_last_guard_decision(tmp_path, capsys):
    _run(tmp_path)

    def unreachable(recipe, timeout):
        raise SwitchRequestError("coordinator gone")

    model = torch.nn.Sequential(dq.Linear(4, 4))
    runner = GuardRunner(
        PrecisionGuard(), model, log=DecisionLog(tmp_path / LOG_FILE), request=unreachable
    )
    assert runner.observe(Observation(7, loss=float("nan"))) is not None
    runner.wait(5)
    assert main(["stats", "--run-dir", str(tmp_path)]) == 0
    text = capsys.readouterr().out
    assert "step 7: non_finite_loss -> model (bf16): unreachable" in text
    assert "coordinator gone" in text


def test_stats_help_and_bad_top(capsys):
    assert main(["stats", "--help"]) == 0
    assert capsys.readouterr().out.startswith("usage: dist-quant stats")
    assert main(["stats", "--top", "0"]) == 2
    assert "must be >= 1" in capsys.readouterr().err
