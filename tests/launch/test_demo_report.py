"""The demo's summary: phases cut where the recipe really changed, checks, table and PNG."""

import io

import pytest
from dist_quant.launch.demo_report import plot_loss, render_tables, short_key, summarize
from rich.console import Console

from dist_quant import DelayedScaling, Float8CurrentScaling


def _log(keys: list[str], losses: list[float], t0: float = 100.0, dt: float = 0.5) -> list[dict]:
    return [
        {"step": i, "loss": loss, "recipe": k, "t": t0 + i * dt}
        for i, (k, loss) in enumerate(zip(keys, losses, strict=True))
    ]


KEYS = ["A"] * 6 + ["B"] * 6 + ["A"] * 6
LOSSES = [4.0 - 0.2 * i for i in range(18)]
SCHEDULE = [("A", "warm-up"), ("B", "fp8"), ("A", "tail")]
SWITCHES = [
    {"label": "fp8", "requested_step": 6, "committed": True, "step": 6, "latency_s": 0.1},
    {"label": "tail", "requested_step": 12, "committed": True, "step": 12, "latency_s": 0.2},
]


def test_phases_follow_the_recipe_changes_and_reuse_labels_in_schedule_order() -> None:
    logs = {0: _log(KEYS, LOSSES), 1: _log(KEYS, LOSSES)}
    s = summarize(logs, SWITCHES, schedule_keys=SCHEDULE, entropy_floor=0.5)
    assert [(p["label"], p["start"], p["steps"]) for p in s["phases"]] == [
        ("warm-up", 0, 6),
        ("fp8", 6, 6),
        ("tail", 12, 6),
    ]
    fp8 = s["phases"][1]
    # A 6-step phase averages 3 steps at each end, so the two ends never overlap.
    assert fp8["loss_first"] == pytest.approx(sum(LOSSES[6:9]) / 3)
    assert fp8["loss_last"] == pytest.approx(sum(LOSSES[9:12]) / 3)
    assert fp8["requested_step"] == 6 and fp8["latency_s"] == 0.1
    # Six steps ran between the end of step 5 (t=102.5) and the end of step 11 (t=105.5).
    assert fp8["steps_per_s"] == pytest.approx(6 / 3.0)
    assert s["phases"][0]["steps_per_s"] == pytest.approx(5 / 2.5)
    assert fp8["keys_by_rank"] == {0: ["B"], 1: ["B"]}
    assert s["mismatched_steps"] == []
    assert s["loss_start"] == pytest.approx(sum(LOSSES[:5]) / 5)
    assert s["loss_end"] == pytest.approx(sum(LOSSES[-5:]) / 5)


def test_a_rank_on_another_recipe_is_reported_at_that_step() -> None:
    other = list(KEYS)
    other[6] = "A"  # rank 1 switched one step late
    s = summarize(
        {0: _log(KEYS, LOSSES), 1: _log(other, LOSSES)},
        SWITCHES,
        schedule_keys=SCHEDULE,
        entropy_floor=0.5,
    )
    assert s["mismatched_steps"] == [6]
    assert s["phases"][1]["keys_by_rank"][1] == ["A", "B"]


def test_a_switch_made_by_hand_shows_as_its_own_phase() -> None:
    keys = ["A"] * 6 + ["C"] * 6
    s = summarize(
        {0: _log(keys, LOSSES[:12])}, [], schedule_keys=[("A", "warm-up")], entropy_floor=0.5
    )
    assert [p["label"] for p in s["phases"]] == ["warm-up", "switched by hand"]
    assert s["phases"][1]["requested_step"] is None


def test_no_steps_from_rank_0_is_an_error() -> None:
    with pytest.raises(ValueError, match="rank 0 logged no step"):
        summarize({0: []}, [], schedule_keys=SCHEDULE, entropy_floor=0.5)


def test_tables_show_every_phase_rank_key_and_failed_switch() -> None:
    failed = SWITCHES + [
        {
            "label": "late",
            "requested_step": 14,
            "committed": False,
            "step": None,
            "reasons": {"1": "already passed step 15"},
            "error": None,
        }
    ]
    s = summarize(
        {0: _log(KEYS, LOSSES), 1: _log(KEYS, LOSSES)},
        failed,
        schedule_keys=SCHEDULE,
        entropy_floor=0.5,
    )
    buf = io.StringIO()
    console = Console(file=buf, width=160, color_system=None)
    for table in render_tables(s):
        console.print(table)
    text = buf.getvalue()
    for expected in (
        "warm-up",
        "fp8",
        "tail",
        "0.100 s",
        "6 (6)",
        "every rank ran the same recipe",
        "late",
        "rank 1: already passed step 15",
    ):
        assert expected in text


def test_loss_plot_is_a_png(tmp_path) -> None:
    s = summarize({0: _log(KEYS, LOSSES)}, SWITCHES, schedule_keys=SCHEDULE, entropy_floor=0.5)
    path = plot_loss(s, tmp_path / "loss.png")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_short_key_is_equal_exactly_for_equal_recipe_keys() -> None:
    assert short_key(DelayedScaling()) == short_key(DelayedScaling(margin=0))
    assert short_key(DelayedScaling()) != short_key(DelayedScaling(margin=1))
    key = short_key(Float8CurrentScaling())
    name, digest = key.split(":")
    assert name == "Float8CurrentScaling" and len(digest) == 8 and int(digest, 16) >= 0
