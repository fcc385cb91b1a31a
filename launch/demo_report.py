"""The demo's results: per-rank step logs in, a summary, a table and a loss-curve PNG out.

Every rank appends one JSON line per optimizer step to `ranks/rank<r>.jsonl` in the run directory:
`{"step", "loss", "recipe", "t", "dt"}`, where `recipe` is the short key (`short_key`) of the
recipe that step ran with, `t` the time the step ended and `dt` how long it took. The phases in
the summary are cut where rank 0's recipe actually changed, not where the schedule asked, so the
table shows what happened (a switch that aborted shows as no cut; a switch made by hand from
another terminal shows as an extra phase, labelled with its recipe key).

Speed is reported in two parts per phase, because the first step under a new recipe compiles
and warms up its kernels (Triton on GPUs: seconds) while the rest run at the recipe's real speed:
`first_step_s` and `steps_per_s` (steady state, the steps after the first). Loss "first -> last"
are means of up to 5 steps at each end of the phase (`_EDGE`), as is the progress bar's loss.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

_EDGE = 5  # steps averaged for a phase's first/last loss: one step is too noisy to read


def _edge(n: int) -> int:
    """Steps to average at each end of an n-step phase: up to _EDGE, and no overlap."""
    return max(1, min(_EDGE, n // 2))


def short_key(recipe: Any) -> str:
    """`name:8 hex digits` of a recipe's digest (equal keys print equal); a recipe without
    fields is its name alone (`bf16`)."""
    name, fields = recipe.key()
    return f"{name}:{recipe.digest()[:8]}" if fields else name


def rank_log_path(run_dir: str | Path, rank: int) -> Path:
    return Path(run_dir) / "ranks" / f"rank{rank}.jsonl"


def read_rank_log(path: str | Path) -> list[dict[str, Any]]:
    """The complete lines of one rank's step log (a line still being written is skipped)."""
    out = []
    try:
        text = Path(path).read_text()
    except FileNotFoundError:
        return out
    for line in text.splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return out


def _mean(xs: Sequence[float]) -> float:
    return sum(xs) / len(xs) if xs else float("nan")


def recent_loss(records: Sequence[Mapping[str, Any]]) -> float:
    """The mean loss of the last `_EDGE` steps: what the progress bar shows, the same average the
    phase table's "last" column takes."""
    return _mean([r["loss"] for r in records[-_EDGE:]])


def guard_label(record: Mapping[str, Any]) -> str:
    """A guard switch as the tables and plots name it: what it moved and why, e.g.
    `guard: layers.1.self_attention.proj -> current (saturation)`."""
    trigger = str(record.get("trigger", "?")).replace("_", " ")
    layers = record.get("layers") or []
    if record.get("action") == "undo":
        what = "back to the base recipe"
    elif layers:
        what = f"{', '.join(layers)} -> {record.get('target')}"
    else:
        what = f"model -> {record.get('target')}"
    return f"guard: {what} ({trigger})"


def summarize(
    logs: Mapping[int, list[dict[str, Any]]],
    switches: Sequence[Mapping[str, Any]],
    *,
    schedule_keys: Sequence[tuple[str, str]],
    entropy_floor: float,
    precision_of: Callable[[str], str] | None = None,
    guard_switches: Sequence[Mapping[str, Any]] = (),
) -> dict[str, Any]:
    """Phases, switch outcomes and consistency checks from every rank's step log.

    `switches`: the launcher's record of each requested switch (`label`, `requested_step`,
    `committed`, `step`, `latency_s`, `reasons`). `schedule_keys`: (short key, label) of each
    scheduled phase in order. A phase that starts at a scheduled switch's commit step takes that
    switch's label, the first phase the first scheduled label. `guard_switches`: the precision
    guard's committed switches (its `decisions.jsonl` records); a phase starting at one's commit
    step is the guard's, labelled with what it moved and why (`guard_label`). Any other recipe
    change was made by hand and is labelled `by hand: <recipe key>`. `precision_of(key)` names a
    phase's precision ("bf16", "fp8", ...) for the plot's shading.
    """
    rank0 = logs.get(0, [])
    if not rank0:
        raise ValueError("rank 0 logged no step: the job did not train")
    committed_at = {s["step"]: s for s in switches if s.get("committed")}
    guard_at = {g["commit_step"]: g for g in guard_switches}
    phases: list[dict[str, Any]] = []
    for rec in rank0:
        if not phases or phases[-1]["recipe"] != rec["recipe"]:
            start = rec["step"]
            sw = committed_at.get(start)
            if not phases and schedule_keys:
                label = schedule_keys[0][1]
            elif sw is not None:
                label = sw["label"]
            elif start in guard_at:
                label = guard_label(guard_at[start])
            else:
                label = f"by hand: {rec['recipe']}"
            phases.append(
                {
                    "label": label,
                    "recipe": rec["recipe"],
                    "start": start,
                    "losses": [],
                    "times": [],
                    "durations": [],
                    "precision": None if precision_of is None else precision_of(rec["recipe"]),
                    "requested_step": None if sw is None else sw.get("requested_step"),
                    "latency_s": None if sw is None else sw.get("latency_s"),
                }
            )
        phases[-1]["losses"].append(rec["loss"])
        phases[-1]["times"].append(rec["t"])
        phases[-1]["durations"].append(rec.get("dt"))
    prev_end_t = None
    for ph in phases:
        losses, times, durations = ph.pop("losses"), ph.pop("times"), ph.pop("durations")
        ph["steps"] = len(losses)
        edge = _edge(len(losses))
        ph["loss_first"] = _mean(losses[:edge])
        ph["loss_last"] = _mean(losses[-edge:])
        ph["loss_mean"] = _mean(losses)
        # the first step (compile / warm-up), from its own duration or the previous step's end
        if durations[0] is not None:
            ph["first_step_s"] = durations[0]
        else:
            ph["first_step_s"] = None if prev_end_t is None else times[0] - prev_end_t
        n = len(times) - 1  # steady state: the steps after the first
        # training time only: a step's `dt` excludes the launcher's --step-delay sleep, which
        # the gaps between step ends include (older logs have no `dt`: the gaps then)
        if all(d is not None for d in durations):
            ph["steady_s"] = math.fsum(durations[1:])
        else:
            ph["steady_s"] = times[-1] - times[0]
        ph["steps_per_s"] = n / ph["steady_s"] if n > 0 and ph["steady_s"] > 0 else None
        ph["keys_by_rank"] = {
            r: sorted(
                {
                    rec["recipe"]
                    for rec in log
                    if ph["start"] <= rec["step"] < ph["start"] + len(losses)
                }
            )
            for r, log in sorted(logs.items())
        }
        prev_end_t = times[-1]
    by_step: dict[int, dict[int, str]] = {}
    for r, log in logs.items():
        for rec in log:
            by_step.setdefault(rec["step"], {})[r] = rec["recipe"]
    mismatched = sorted(s for s, keys in by_step.items() if len(set(keys.values())) > 1)
    losses = [rec["loss"] for rec in rank0]
    if all(rec.get("dt") is not None for rec in rank0):
        total_s = math.fsum(rec["dt"] for rec in rank0[1:])
    else:
        total_s = rank0[-1]["t"] - rank0[0]["t"]
    steady_steps = sum(ph["steps"] - 1 for ph in phases)
    steady_s = sum(ph["steady_s"] for ph in phases)
    return {
        "phases": phases,
        "switches": [dict(s) for s in switches],
        "guard_switches": [dict(g) | {"label": guard_label(g)} for g in guard_switches],
        "steps": len(rank0),
        "ranks": sorted(logs),
        "steps_logged_by_rank": {r: len(log) for r, log in sorted(logs.items())},
        "mismatched_steps": mismatched,
        "loss_start": _mean(losses[: _edge(len(losses))]),
        "loss_end": _mean(losses[-_edge(len(losses)) :]),
        "entropy_floor": entropy_floor,
        "steps_per_s": (len(rank0) - 1) / total_s if total_s > 0 else None,
        "steady_steps_per_s": steady_steps / steady_s if steady_s > 0 else None,
        "warmup_s": sum(ph["first_step_s"] or 0.0 for ph in phases),
        "losses": losses,
    }


def _fmt(x: float | None, spec: str, empty: str = "-") -> str:
    return empty if x is None else format(x, spec)


def render_tables(summary: Mapping[str, Any]) -> list[Any]:
    """Two rich tables: phases (loss, speed, switch latency) and the recipe key each rank ran."""
    from rich.table import Table

    phases = Table(title="dist-quant demo: phases", title_justify="left")
    for col in (
        "phase",
        "steps",
        "commit step (asked)",
        f"loss first -> last\n(mean of {_EDGE} steps)",
        "first step\n(warm-up)",
        "steps/s\n(after it)",
        "switch latency",
    ):
        phases.add_column(col, justify="left" if col == "phase" else "right")
    for ph in summary["phases"]:
        asked = ph["requested_step"]
        commit = f"{ph['start']}" + ("" if asked is None else f" ({asked})")
        phases.add_row(
            ph["label"],
            str(ph["steps"]),
            commit if ph["start"] > 0 else "0 (start)",
            f"{ph['loss_first']:.3f} -> {ph['loss_last']:.3f}",
            _fmt(ph["first_step_s"], ".2f") + (" s" if ph["first_step_s"] is not None else ""),
            _fmt(ph["steps_per_s"], ".1f"),
            _fmt(ph["latency_s"], ".3f") + (" s" if ph["latency_s"] is not None else ""),
        )
    phases.caption = (
        f"loss {summary['loss_start']:.3f} -> {summary['loss_end']:.3f} ({_EDGE}-step means; "
        f"best possible {summary['entropy_floor']:.3f}); "
        f"{_fmt(summary['steady_steps_per_s'], '.1f')} steps/s after warm-up, "
        f"{_fmt(summary['steps_per_s'], '.1f')} overall with "
        f"{summary['warmup_s']:.1f} s in first steps (kernel compilation, caches); "
        "steps/s count training time only, --step-delay excluded"
    )
    keys = Table(title="recipe key per rank and phase", title_justify="left")
    keys.add_column("rank", justify="right")
    for ph in summary["phases"]:
        keys.add_column(ph["label"])
    for r in summary["ranks"]:
        keys.add_row(
            str(r), *(", ".join(ph["keys_by_rank"].get(r, [])) for ph in summary["phases"])
        )
    if summary["mismatched_steps"]:
        keys.caption = f"ranks disagreed at steps {summary['mismatched_steps'][:10]}"
    else:
        keys.caption = "every rank ran the same recipe at every step"
    failed = [s for s in summary["switches"] if not s.get("committed")]
    out: list[Any] = [phases, keys]
    if failed:
        notes = Table(title="switches that did not commit", title_justify="left")
        notes.add_column("switch")
        notes.add_column("asked at step", justify="right")
        notes.add_column("reason")
        for s in failed:
            notes.add_row(
                s["label"],
                str(s["requested_step"]),
                s.get("error")
                or "; ".join(f"rank {r}: {why}" for r, why in sorted(s.get("reasons", {}).items())),
            )
        out.append(notes)
    return out


_PRECISION_SHADES = {"bf16": "#ececec", "fp8": "#fde3c8", "custom": "#e4dcf2"}
_PRECISION_NAMES = {
    "bf16": "BF16 (no quantization)",
    "fp8": "FP8 (quantized GEMMs)",
    "custom": "custom recipe",
}


def _label_tiers(starts: Sequence[int], labels: Sequence[str], char_steps: float) -> list[int]:
    """A row for each phase label such that no two labels in one row overlap: a label of n
    characters at step x covers [x, x + n * char_steps]; each takes the first row free there."""
    row_ends: list[float] = []
    tiers = []
    for x, text in zip(starts, labels, strict=True):
        end = x + (len(text) + 1) * char_steps
        for row, busy_until in enumerate(row_ends):
            if busy_until <= x:
                row_ends[row] = end
                tiers.append(row)
                break
        else:
            row_ends.append(end)
            tiers.append(len(row_ends) - 1)
    return tiers


def plot_loss(summary: Mapping[str, Any], path: str | Path) -> Path:
    """Loss per step (and its running mean) with each phase shaded by its precision and each
    committed switch marked; written as PNG."""
    from matplotlib.figure import Figure  # no pyplot: no global backend, no display needed
    from matplotlib.patches import Patch

    losses = summary["losses"]
    fig = Figure(figsize=(9, 4.8), layout="constrained")
    ax = fig.subplots()
    ax.plot(range(len(losses)), losses, lw=0.8, color="#9db6d3", label="loss per step (rank 0)")
    mean = [_mean(losses[max(0, i - _EDGE + 1) : i + 1]) for i in range(len(losses))]
    ax.plot(range(len(losses)), mean, lw=1.4, color="#1f4e79", label=f"{_EDGE}-step mean")
    ax.axhline(summary["entropy_floor"], color="grey", ls=":", lw=1, label="best possible loss")
    phases = summary["phases"]
    seen: dict[str, str] = {}
    for ph in phases:
        precision = ph.get("precision") or "custom"
        shade = _PRECISION_SHADES.get(precision, _PRECISION_SHADES["custom"])
        seen.setdefault(precision, shade)
        ax.axvspan(ph["start"] - 0.5, ph["start"] + ph["steps"] - 0.5, color=shade, zorder=0)
        if ph["start"] > 0:
            ax.axvline(ph["start"] - 0.5, color="#c0392b", ls="--", lw=1)
    # ~115 characters of fontsize 8 span the axes' width: labels closer than that share no row
    char_steps = max(len(losses), 1) / 115
    labels = [f" {ph['label']}" for ph in phases]
    tiers = _label_tiers([ph["start"] for ph in phases], labels, char_steps)
    top = ax.get_ylim()[1]
    for ph, text, tier in zip(phases, labels, tiers, strict=True):
        ax.annotate(
            text,
            (ph["start"], top),
            xytext=(0, -10 * tier),
            textcoords="offset points",
            va="top",
            fontsize=8,
        )
    ax.plot([], [], color="#c0392b", ls="--", lw=1, label="switch committed (all ranks)")
    ax.set_xlabel("step")
    ax.set_ylabel("cross-entropy (nats/token)")
    ax.set_title("dist-quant demo: one job, recipes switched mid-run through the coordinator")
    handles = ax.get_legend_handles_labels()[0] + [
        Patch(color=shade, label=_PRECISION_NAMES.get(precision, precision))
        for precision, shade in seen.items()
    ]
    fig.legend(handles=handles, loc="outside lower center", ncols=3, fontsize=8, frameon=False)
    out = Path(path)
    fig.savefig(out, dpi=110)
    return out
