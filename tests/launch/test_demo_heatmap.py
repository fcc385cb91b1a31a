"""The demo's FP8 heat map: bf16 steps are shaded and labelled (not drawn as "0 saturated"), and
the guard's switch label sits inside the plot, clear of both subplot titles."""

import json
from pathlib import Path

from dist_quant.launch.demo_guard import plot_stats_heatmap, stats_heatmap_figure
from matplotlib.backends.backend_agg import FigureCanvasAgg

GUARD = {
    "event": "guard",
    "trigger": "saturation",
    "action": "layers",
    "layers": ["layers.1.self_attention.proj"],
    "target": "current",
    "outcome": "committed",
    "commit_step": 14,
}


def _run_dir(tmp_path: Path) -> Path:
    """Steps 0-9 bf16 (no slots), 10-19 FP8 with one saturating slot; the guard at 14."""
    lines = []
    for step in range(20):
        slots = []
        if step >= 10:
            for module in ("layers.0.mlp.fc1", "layers.1.self_attention.proj"):
                slots.append(
                    {"module": module, "saturated_fraction": 0.01, "underflow_fraction": 1e-4}
                )
        lines.append(json.dumps({"step": step, "slots": slots}))
    (tmp_path / "fp8_stats.jsonl").write_text("\n".join(lines) + "\n")
    (tmp_path / "decisions.jsonl").write_text(json.dumps(GUARD) + "\n")
    return tmp_path


def test_bf16_steps_are_shaded_and_labelled_on_both_maps(tmp_path) -> None:
    fig = stats_heatmap_figure(_run_dir(tmp_path), [(0, 10)])
    for ax in fig.axes[:2]:
        spans = [p for p in ax.patches if p.get_facecolor()[:3] != (0.0, 0.0, 0.0)]
        assert len(spans) == 1
        x0, _, width, _ = spans[0].get_bbox().bounds
        assert (x0, x0 + width) == (-0.5, 9.5)  # steps 0..9, edge to edge
        assert [t.get_text() for t in ax.texts if "bf16" in t.get_text()] == [
            "bf16: no FP8 casts"
        ]


def test_the_guard_label_overlaps_no_title(tmp_path) -> None:
    fig = stats_heatmap_figure(_run_dir(tmp_path), [(0, 10)])
    canvas = FigureCanvasAgg(fig)
    canvas.draw()
    renderer = canvas.get_renderer()
    labels = [t for ax in fig.axes for t in ax.texts if t.get_text().startswith(" guard:")]
    assert [t.get_text() for t in labels] == [
        " guard: layers.1.self_attention.proj -> current (saturation)"
    ]
    box = labels[0].get_window_extent(renderer)
    for ax in fig.axes[:2]:
        assert not box.overlaps(ax.title.get_window_extent(renderer)), ax.title.get_text()
    inside = fig.axes[1].get_window_extent(renderer)
    assert inside.y0 <= box.y0 and box.y1 <= inside.y1  # within the lower map


def test_the_heat_map_is_written_as_a_png(tmp_path) -> None:
    out = plot_stats_heatmap(_run_dir(tmp_path), tmp_path / "map.png", [(0, 10)])
    assert out == tmp_path / "map.png" and out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
