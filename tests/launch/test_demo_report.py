"""The demo's summary: phases cut where the recipe really changed, checks, table and PNG."""

import io

import pytest
from dist_quant.launch.demo_report import (
    _label_tiers,
    plot_loss,
    recent_loss,
    render_tables,
    short_key,
    summarize,
)
from dist_quant.launch.switch_commands import short_recipe_key
from rich.console import Console

from dist_quant import DelayedScaling, Float8CurrentScaling, recipe_from_dict


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
    assert [p["label"] for p in s["phases"]] == ["warm-up", "by hand: C"]
    assert s["phases"][1]["requested_step"] is None


def test_a_hand_switch_to_a_scheduled_recipe_is_not_taken_for_the_scheduled_phase() -> None:
    """Rank 0 ran A, then B by hand at step 3, then B -> A at the scheduled step 12: the hand
    phase is labelled as such even though B is the next scheduled recipe."""
    keys = ["A"] * 3 + ["B"] * 9 + ["A"] * 6
    s = summarize({0: _log(keys, LOSSES)}, SWITCHES[1:], schedule_keys=SCHEDULE, entropy_floor=0.5)
    assert [(p["label"], p["start"]) for p in s["phases"]] == [
        ("warm-up", 0),
        ("by hand: B", 3),
        ("tail", 12),
    ]


def test_a_guard_switch_is_labelled_with_the_layers_it_moved_and_why() -> None:
    """A guard's switch (its decisions.jsonl record) is not mistaken for a switch by hand."""
    keys = ["A"] * 6 + ["C"] * 6
    guard = {
        "event": "guard",
        "trigger": "saturation",
        "action": "layers",
        "layers": ["layers.1.self_attention.proj"],
        "target": "current",
        "outcome": "committed",
        "commit_step": 6,
    }
    s = summarize(
        {0: _log(keys, LOSSES[:12])},
        [],
        schedule_keys=[("A", "warm-up")],
        entropy_floor=0.5,
        guard_switches=[guard],
    )
    label = "guard: layers.1.self_attention.proj -> current (saturation)"
    assert [p["label"] for p in s["phases"]] == ["warm-up", label]
    assert s["guard_switches"] == [guard | {"label": label}]
    out = io.StringIO()
    for table in render_tables(s):
        Console(file=out, width=200, color_system=None).print(table)
    assert label in out.getvalue() and "by hand" not in out.getvalue()


def test_steps_per_second_count_training_time_not_the_step_delay() -> None:
    """--step-delay sleeps after each step: the gaps between step ends hold it, `dt` does not."""
    log = _log(KEYS, LOSSES, dt=1.5)  # steps end 1.5 s apart...
    for rec in log:
        rec["dt"] = 0.5  # ...of which 0.5 s is training and 1.0 s the delay
    s = summarize({0: log}, SWITCHES, schedule_keys=SCHEDULE, entropy_floor=0.5)
    assert [p["steps_per_s"] for p in s["phases"]] == pytest.approx([2.0, 2.0, 2.0])
    assert s["steady_steps_per_s"] == pytest.approx(2.0)
    assert s["steps_per_s"] == pytest.approx(2.0)


def test_the_first_step_of_each_phase_is_reported_apart_from_the_steady_state_rate() -> None:
    log = _log(KEYS, LOSSES)
    for rec in log:
        rec["dt"] = 0.5
    log[6]["dt"] = 3.0  # the first FP8 step compiles its kernels
    for rec in log[6:]:
        rec["t"] += 2.5
    s = summarize({0: log}, SWITCHES, schedule_keys=SCHEDULE, entropy_floor=0.5)
    fp8 = s["phases"][1]
    assert fp8["first_step_s"] == 3.0
    assert fp8["steps_per_s"] == pytest.approx(5 / 2.5)  # steps 7..11 after step 6 ended
    assert s["steady_steps_per_s"] == pytest.approx(15 / 7.5)
    assert s["warmup_s"] == pytest.approx(0.5 + 3.0 + 0.5)
    assert s["steps_per_s"] == pytest.approx(17 / 11.0)  # step 0's end to step 17's end


def test_progress_loss_is_the_same_mean_as_the_tables_last_column() -> None:
    s = summarize({0: _log(KEYS, LOSSES)}, SWITCHES, schedule_keys=SCHEDULE, entropy_floor=0.5)
    assert recent_loss(_log(KEYS, LOSSES)) == pytest.approx(s["loss_end"])
    assert s["loss_end"] == pytest.approx(sum(LOSSES[-5:]) / 5)


def test_phase_precision_comes_from_the_given_classifier() -> None:
    s = summarize(
        {0: _log(KEYS, LOSSES)},
        SWITCHES,
        schedule_keys=SCHEDULE,
        entropy_floor=0.5,
        precision_of={"A": "bf16", "B": "fp8"}.get,
    )
    assert [p["precision"] for p in s["phases"]] == ["bf16", "fp8", "bf16"]


def test_close_labels_go_to_separate_rows_and_far_ones_share_the_first() -> None:
    # 1 step per character: "abcd" at 0 covers [0, 5); at 3 it would overlap, at 10 it does not
    assert _label_tiers([0, 3, 10, 12], ["abcd", "abcd", "abcd", "ab"], 1.0) == [0, 1, 0, 1]
    assert _label_tiers([0, 50, 100], ["x" * 10] * 3, 1.0) == [0, 0, 0]


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


def test_the_bf16_recipe_prints_as_bf16_in_the_tables_and_in_status() -> None:
    """The all-identity recipe is its own name everywhere a short key is shown: the demo's
    tables (`short_key`) and `dist-quant status` (`short_recipe_key`, from the key's repr)."""
    bf16 = recipe_from_dict("bf16")
    assert short_key(bf16) == short_recipe_key(repr(bf16.key())) == "bf16"
    delayed = DelayedScaling()
    assert short_recipe_key(repr(delayed.key())) == short_key(delayed)
    assert short_key(delayed) == f"DelayedScaling:{delayed.digest()[:8]}"
