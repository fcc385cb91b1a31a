"""The demo's results: per-rank step logs in, a summary, a table and a loss-curve PNG out.

Every rank appends one JSON line per optimizer step to `ranks/rank<r>.jsonl` in the run directory:
`{"step", "loss", "recipe", "t"}`, where `recipe` is the short key (`short_key`) of the recipe that
step ran with. The phases in the summary are cut where rank 0's recipe actually changed, not where
the schedule asked, so the table shows what happened (a switch that aborted shows as no cut; a
switch made by hand from another terminal shows as an extra phase).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

_EDGE = 5  # steps averaged for a phase's first/last loss: one step is too noisy to read


def _edge(n: int) -> int:
    """Steps to average at each end of an n-step phase: up to _EDGE, and no overlap."""
    return max(1, min(_EDGE, n // 2))


def short_key(recipe: Any) -> str:
    """`TypeName:8 hex digits` of a recipe's semantic key: equal keys print equal."""
    digest = hashlib.sha256(repr(recipe.key()).encode()).hexdigest()[:8]
    return f"{type(recipe).__name__}:{digest}"


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


def summarize(
    logs: Mapping[int, list[dict[str, Any]]],
    switches: Sequence[Mapping[str, Any]],
    *,
    schedule_keys: Sequence[tuple[str, str]],
    entropy_floor: float,
) -> dict[str, Any]:
    """Phases, switch outcomes and consistency checks from every rank's step log.

    `switches`: the launcher's record of each requested switch (`label`, `requested_step`,
    `committed`, `step`, `latency_s`, `reasons`). `schedule_keys`: (short key, label) of each
    scheduled phase in order; a phase that ran is labelled by the next scheduled phase with its
    key (the same recipe may appear twice, e.g. bf16 warm-up and bf16 tail).
    """
    rank0 = logs.get(0, [])
    if not rank0:
        raise ValueError("rank 0 logged no step: the job did not train")
    committed_at = {s["step"]: s for s in switches if s.get("committed")}
    phases: list[dict[str, Any]] = []
    upcoming = list(schedule_keys)
    for rec in rank0:
        if not phases or phases[-1]["recipe"] != rec["recipe"]:
            start = rec["step"]
            sw = committed_at.get(start)
            label = "switched by hand"
            for i, (key, name) in enumerate(upcoming):
                if key == rec["recipe"]:
                    label, upcoming = name, upcoming[i + 1 :]
                    break
            phases.append(
                {
                    "label": label,
                    "recipe": rec["recipe"],
                    "start": start,
                    "losses": [],
                    "times": [],
                    "requested_step": None if sw is None else sw.get("requested_step"),
                    "latency_s": None if sw is None else sw.get("latency_s"),
                }
            )
        phases[-1]["losses"].append(rec["loss"])
        phases[-1]["times"].append(rec["t"])
    prev_end_t = None
    for ph in phases:
        losses, times = ph.pop("losses"), ph.pop("times")
        ph["steps"] = len(losses)
        edge = _edge(len(losses))
        ph["loss_first"] = _mean(losses[:edge])
        ph["loss_last"] = _mean(losses[-edge:])
        ph["loss_mean"] = _mean(losses)
        t0 = prev_end_t if prev_end_t is not None else times[0]
        n = len(times) if prev_end_t is not None else len(times) - 1
        ph["steps_per_s"] = n / (times[-1] - t0) if n > 0 and times[-1] > t0 else None
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
    total_s = rank0[-1]["t"] - rank0[0]["t"]
    return {
        "phases": phases,
        "switches": [dict(s) for s in switches],
        "steps": len(rank0),
        "ranks": sorted(logs),
        "steps_logged_by_rank": {r: len(log) for r, log in sorted(logs.items())},
        "mismatched_steps": mismatched,
        "loss_start": _mean(losses[: _edge(len(losses))]),
        "loss_end": _mean(losses[-_edge(len(losses)) :]),
        "entropy_floor": entropy_floor,
        "steps_per_s": (len(rank0) - 1) / total_s if total_s > 0 else None,
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
        "loss first -> last",
        "steps/s",
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
            _fmt(ph["steps_per_s"], ".1f"),
            _fmt(ph["latency_s"], ".3f") + (" s" if ph["latency_s"] is not None else ""),
        )
    phases.caption = (
        f"loss {summary['loss_start']:.3f} -> {summary['loss_end']:.3f} "
        f"(best possible {summary['entropy_floor']:.3f}); "
        f"{_fmt(summary['steps_per_s'], '.1f')} steps/s overall"
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


def plot_loss(summary: Mapping[str, Any], path: str | Path) -> Path:
    """Loss per step with each phase shaded and each committed switch marked; written as PNG."""
    from matplotlib.figure import Figure  # no pyplot: no global backend, no display needed

    losses = summary["losses"]
    fig = Figure(figsize=(9, 4.8), layout="constrained")
    ax = fig.subplots()
    ax.plot(range(len(losses)), losses, lw=1.2, color="#1f4e79", label="training loss (rank 0)")
    ax.axhline(summary["entropy_floor"], color="grey", ls=":", lw=1, label="best possible loss")
    shades = ("#f2f2f2", "#e3edf7")
    for i, ph in enumerate(summary["phases"]):
        end = ph["start"] + ph["steps"]
        ax.axvspan(ph["start"] - 0.5, end - 0.5, color=shades[i % 2], zorder=0)
        ax.text(ph["start"], ax.get_ylim()[1], f" {ph['label']}", va="top", fontsize=8)
        if ph["start"] > 0:
            ax.axvline(ph["start"] - 0.5, color="#c0392b", ls="--", lw=1)
    ax.plot([], [], color="#c0392b", ls="--", lw=1, label="switch committed (all ranks)")
    ax.set_xlabel("step")
    ax.set_ylabel("cross-entropy (nats/token)")
    ax.set_title("dist-quant demo: one job, recipes switched mid-run through the coordinator")
    fig.legend(loc="outside lower center", ncols=3, fontsize=8, frameon=False)
    out = Path(path)
    fig.savefig(out, dpi=110)
    return out
