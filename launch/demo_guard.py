"""The demo's precision guard: `--guard`, `--spike-at STEP`, and the FP8 heat map.

- `attach_options(cfg)`: what `demo_train` passes to `attach` (telemetry every step when the guard
  or a spike is asked for; the guard with its defaults);
- `ActivationSpike`: multiplies the input of one layer's attention output projection by
  `SPIKE_FACTOR` at one step (forward only: the gradient passes unscaled), the outlier a real run
  sees when one layer's activations blow up;
- `plot_stats_heatmap(run_dir, path, unquantized=...)`: modules x steps, saturated and
  underflowed fractions (the worst slot of each module), with each committed guard switch marked
  and the steps that ran without FP8 (bf16) shaded, not drawn as "0 saturated"; beside loss.png;
- `committed_guard_switches(run_dir)`: the guard's committed switches from `decisions.jsonl`.

The launcher process only plots: torch is imported where a rank needs it (`ActivationSpike`).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from dist_quant.coordinator.guard import PrecisionGuard
from dist_quant.launch.demo_report import guard_label
from dist_quant.launch.stats import GUARD_RECORD, LOG_FILE, STATS_FILE, read_jsonl

SPIKE_FACTOR = 1e4
HEATMAP_FILE = "fp8_heatmap.png"


def attach_options(cfg: dict[str, Any]) -> dict[str, Any]:
    """`stats_interval` and `guard` for `attach`, from the demo's rank config."""
    watch = bool(cfg.get("guard") or cfg.get("spike_at") is not None)
    return {
        "stats_interval": 1 if watch else 0,
        # one stats interval: under delayed scaling the step after a spike already has its scale
        "guard": PrecisionGuard(saturation_intervals=1, loss_window=10)
        if cfg.get("guard")
        else None,
    }


class ActivationSpike:
    """Scales one layer's attention-projection input at `at_step`; `step` is set by the loop."""

    def __init__(self, model: Any, at_step: int | None, layers: int) -> None:
        self.at_step = at_step
        self.step = -1
        self.layer = f"layers.{layers // 2}.self_attention.proj"
        if at_step is None:
            return
        from dist_quant.runtime import dist_quant_modules  # torch: on the ranks only

        targets = [m for m in dist_quant_modules(model) if m.role_name == self.layer]
        if not targets:
            raise ValueError(f"demo --spike-at: the model has no module {self.layer!r}")
        targets[0].register_forward_pre_hook(self._hook)

    def _hook(self, module: Any, args: tuple) -> tuple | None:
        if self.step != self.at_step:
            return None
        h = args[0]
        return (h + h.detach() * (SPIKE_FACTOR - 1), *args[1:])


def plot_stats_heatmap(
    run_dir: str | Path, path: str | Path, unquantized: Sequence[tuple[int, int]] = ()
) -> Path | None:
    """The heat map of `<run_dir>/fp8_stats.jsonl`; None (nothing written) without stats.
    `unquantized`: [first, end) step ranges that ran in bf16 (nothing cast, so nothing to count):
    shaded and labelled, where the colour scale alone would read "0 saturated"."""
    fig = stats_heatmap_figure(Path(run_dir), unquantized)
    if fig is None:
        return None
    out = Path(path)
    fig.savefig(out, dpi=110)
    return out


def stats_heatmap_figure(run_dir: Path, unquantized: Sequence[tuple[int, int]] = ()) -> Any:
    """The heat map's matplotlib Figure (see `plot_stats_heatmap`); None without stats."""
    stats_path = run_dir / STATS_FILE
    records = read_jsonl(stats_path) if stats_path.is_file() else []
    if not records:
        return None
    from matplotlib.colors import LogNorm
    from matplotlib.figure import Figure  # no pyplot: no global backend, no display needed

    steps = [r["step"] for r in records]
    modules = sorted({s["module"] for r in records for s in r.get("slots", [])})
    row = {m: i for i, m in enumerate(modules)}
    floor = 1e-6  # log colour scale: 0 is drawn as the floor
    grids = {"saturated_fraction": [], "underflow_fraction": []}
    for name, grid in grids.items():
        grid.extend([floor] * len(steps) for _ in modules)
        for j, rec in enumerate(records):
            for s in rec.get("slots", []):
                i = row[s["module"]]
                grid[i][j] = max(grid[i][j], s.get(name, 0.0), floor)
    switches = [(g["commit_step"], guard_label(g)) for g in committed_guard_switches(run_dir)]
    fig = Figure(figsize=(10, 1.5 + 0.45 * len(modules) * 2), layout="constrained")
    axes = fig.subplots(2, 1, sharex=True)
    bottom = len(modules) - 0.5  # the image's lowest edge, in data units (rows go downwards)
    for ax, (name, grid) in zip(axes, grids.items()):
        image = ax.imshow(
            grid, aspect="auto", interpolation="nearest", norm=LogNorm(floor, 1.0), cmap="magma",
            extent=(steps[0] - 0.5, steps[-1] + 0.5, bottom, -0.5),
        )  # fmt: skip
        ax.set_yticks(range(len(modules)), modules, fontsize=7)
        ax.set_title(name.replace("_", " ") + " (worst slot of each module)", fontsize=9)
        fig.colorbar(image, ax=ax, fraction=0.03)
        for first, end in unquantized:
            ax.axvspan(first - 0.5, end - 0.5, facecolor="#7f8c8d", alpha=0.85, hatch="//",
                       edgecolor="#bdc3c7", lw=0)  # fmt: skip
            ax.text((first + end - 1) / 2, (bottom - 0.5) / 2, "bf16: no FP8 casts",
                    ha="center", va="center", fontsize=7, color="white")  # fmt: skip
        for step, _ in switches:
            ax.axvline(step - 0.5, color="#2ecc71", ls="--", lw=1)
    # inside the lower axes, above its bottom edge: clear of both subplot titles
    for step, label in switches:
        axes[-1].text(step, bottom, f" {label}", color="#2ecc71", fontsize=7, va="bottom",
                      bbox={"facecolor": "black", "alpha": 0.6, "lw": 0, "pad": 1})  # fmt: skip
    axes[-1].set_xlabel("step")
    return fig


def committed_guard_switches(run_dir: Path) -> list[dict[str, Any]]:
    """The guard's committed switches, as it logged them in `decisions.jsonl`."""
    log = run_dir / LOG_FILE
    if not log.is_file():
        return []
    return [
        r
        for r in read_jsonl(log)
        if r.get("event") == GUARD_RECORD
        and r.get("outcome") == "committed"
        and isinstance(r.get("commit_step"), int)
    ]
