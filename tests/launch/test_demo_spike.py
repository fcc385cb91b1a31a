"""`demo --spike-at`: the documented example spikes where the guard can see it, and a step where
it cannot is said so before the run (past the end: refused)."""

import re
from pathlib import Path

import pytest
from dist_quant.launch.demo import spike_note
from dist_quant.launch.demo_schedule import resolve_schedule
from dist_quant.launch.errors import CliError

ROOT = Path(__file__).resolve().parents[2]


def test_the_documented_guard_example_spikes_inside_an_fp8_phase() -> None:
    """README and docs/guard.md: `dist-quant demo --guard --spike-at N` with the default 200 steps
    and schedule: N must fall in an FP8 phase (delayed 50-109, current 110-169)."""
    schedule = resolve_schedule(None, 200)
    for doc in ("README.md", "docs/guard.md"):
        found = re.findall(r"dist-quant demo --guard --spike-at (\d+)", (ROOT / doc).read_text())
        assert found, f"{doc} shows no guard example"
        for n in map(int, found):
            assert 50 <= n < 170, f"{doc}: --spike-at {n}"
            assert spike_note(schedule, n, 200) is None


def test_a_spike_in_the_bf16_warm_up_is_noted_with_the_fp8_steps() -> None:
    note = spike_note(resolve_schedule(None, 200), 15, 200)
    assert note == (
        "note: --spike-at 15 lands in 'bf16 warm-up' (steps 0-49), which casts nothing to FP8: "
        "the guard will see no saturation; FP8 runs at steps 50-109, 110-169"
    )
    assert "'bf16 tail' (steps 170-199)" in spike_note(resolve_schedule(None, 200), 199, 200)


def test_a_spike_past_the_last_step_is_refused() -> None:
    with pytest.raises(CliError, match=r"--spike-at 200 is past the last step \(199\)") as e:
        spike_note(resolve_schedule(None, 200), 200, 200)
    assert e.value.code == 2
