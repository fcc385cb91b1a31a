"""`dist-quant stats`: the worst FP8 slots of a run, from `<run dir>/fp8_stats.jsonl`.

Reads the files only (the telemetry's records and the decision log's guard records), so it works
on a finished run, or on a running one from any machine that sees its run directory. Nothing here
imports torch: the command line stays quick to start.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from dist_quant.jsonl import read_jsonl

# The file names of dist_quant.telemetry.STATS_FILE and coordinator.endpoint.LOG_FILE, repeated
# here because importing those modules imports torch (tests/launch/test_stats_cli.py pins them).
STATS_FILE = "fp8_stats.jsonl"
LOG_FILE = "decisions.jsonl"
GUARD_RECORD = "guard"


def add_stats_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "stats",
        help="print the worst FP8 slots of a run (saturation, underflow) and the guard's last "
        "decision",
        description="Rank the quantized slots (module, tensor, direction) of a run's last stats "
        "step, or of every stats step with --all, by saturated fraction, then underflow fraction. "
        "Exit 2 if the run has no fp8_stats.jsonl (start it with stats_interval > 0).",
    )
    p.add_argument(
        "--run-dir",
        metavar="DIR",
        help="the run directory; default $DIST_QUANT_RUN_DIR, else ./dist_quant_run",
    )
    p.add_argument("--top", metavar="K", type=_positive_int, default=10, help="rows (default 10)")
    p.add_argument("--all", action="store_true", help="rank slots over every stats step")
    p.add_argument("--json", action="store_true", help="print the rows as JSON")


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be an integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def run_dir_of(arg: str | None) -> Path:
    """The same rule as the coordinator's: the argument, $DIST_QUANT_RUN_DIR, ./dist_quant_run."""
    return Path(arg or os.environ.get("DIST_QUANT_RUN_DIR") or "dist_quant_run").absolute()


def worst_slots(records: list[dict[str, Any]], top: int, every_step: bool) -> list[dict[str, Any]]:
    """Slot rows (each with its step), worst first: saturated fraction, then underflow fraction."""
    chosen = records if every_step else records[-1:]
    rows = [{**slot, "step": rec.get("step")} for rec in chosen for slot in rec.get("slots", [])]
    rows.sort(key=lambda r: (-r.get("saturated_fraction", 0.0), -r.get("underflow_fraction", 0.0)))
    return rows[:top]


def last_guard_decision(run_dir: Path) -> dict[str, Any] | None:
    """The newest guard record of the run's decision log, or None."""
    path = run_dir / LOG_FILE
    if not path.is_file():
        return None
    guards = [r for r in read_jsonl(path) if r.get("event") == GUARD_RECORD]
    return guards[-1] if guards else None


def describe_guard(record: dict[str, Any]) -> str:
    """One line: step, trigger, action and target, outcome, and the statistic that fired it."""
    target = ", ".join(record.get("layers") or []) or record.get("target", "")
    line = (
        f"step {record.get('step')}: {record.get('trigger')} -> {record.get('action')} "
        f"({target}): {record.get('outcome')}"
    )
    if record.get("commit_step") is not None:
        line += f" at step {record['commit_step']}"
    if record.get("reason"):
        line += f" ({record['reason']})"
    return f"{line}; statistic {json.dumps(record.get('statistic', {}), sort_keys=True)}"


def _percent(v: float) -> str:
    return f"{100 * v:.4g}%"


def _number(v: Any) -> str:
    return f"{v:.4g}" if isinstance(v, float) and math.isfinite(v) else str(v)


def run_stats(args: argparse.Namespace) -> int:
    run_dir = run_dir_of(args.run_dir)
    path = run_dir / STATS_FILE
    if not path.is_file():
        print(
            f"dist-quant: no {STATS_FILE} in {run_dir}; run with stats_interval > 0 "
            "(attach(..., stats_interval=N) or Telemetry)",
            file=sys.stderr,
        )
        return 2
    records = read_jsonl(path)
    rows = worst_slots(records, args.top, args.all)
    guard = last_guard_decision(run_dir)
    if args.json:
        print(json.dumps({"rows": rows, "last_guard_decision": guard}, indent=1))
        return 0
    steps = [r.get("step") for r in records]
    title = f"worst FP8 slots, {'all stats steps' if args.all else f'step {steps[-1]}'}"
    table = Table(title=title if records else "no stats step recorded yet")
    for column in ("step", "module", "tensor", "direction", "amax", "scale", "saturated",
                   "underflow"):  # fmt: skip
        table.add_column(column, justify="right" if column in ("step", "amax", "scale") else "left")
    for r in rows:
        table.add_row(
            str(r.get("step")), r.get("module", ""), r.get("tensor_type", ""),
            r.get("direction", ""), _number(r.get("amax")), _number(r.get("scale")),
            _percent(r.get("saturated_fraction", 0.0)), _percent(r.get("underflow_fraction", 0.0)),
        )  # fmt: skip
    console = Console()
    console.print(table)
    console.print(f"{len(records)} stats steps in {path}")
    console.print(
        f"last guard decision: {describe_guard(guard)}" if guard else "last guard decision: none"
    )
    return 0
