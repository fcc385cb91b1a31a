"""`dist-quant demo`: launch the demo job, drive its recipe schedule, show and save the results.

The launcher process starts N ranks (torchrun or Ray; each runs `demo_train.train_rank`), then acts
as an ordinary client of the job's coordinator: for every phase after the first it calls
`request_switch(recipe, at_step=phase.start)`, exactly what `dist-quant switch` does from another
terminal. It books each switch only shortly before its step (`BOOK_AHEAD_STEPS` steps, or
`BOOK_AHEAD_S` seconds of training, whichever is more), so between bookings no switch is open and
a hand switch from another terminal commits at once. A scheduled switch refused because another
one is open (a hand switch) is retried; one that arrives after its step has passed on some rank
is re-requested for the next possible step, and the table shows both steps. Meanwhile it follows
rank 0's step log for the progress bar.

Nothing of a previous run in the same `--out` is touched until this run's ranks are up (their
coordinator has written its endpoint): then the old results go and this run's config and launch
log take their names. At the end it prints the tables, writes `loss.png`, `summary.json` and
`summary.txt`, and exits 0 only if every scheduled switch committed and every rank ran the same
recipe at every step. A run that stops early (Ctrl-C, a failed rank) removes its
`coordinator.json`, so no client is sent to a job that is gone.
"""

from __future__ import annotations

import importlib.util
import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

# Imported here, not inside SwitchDriver's thread: a package imported for the first time from two
# threads at once can be seen half-initialised (an ImportError seen once on a GPU host).
from dist_quant.coordinator.endpoint import read_endpoint, remove_endpoint
from dist_quant.launch.demo_data import MarkovTask
from dist_quant.launch.demo_guard import (
    HEATMAP_FILE,
    committed_guard_switches,
    plot_stats_heatmap,
)
from dist_quant.launch.demo_model import parse_gpt_spec
from dist_quant.launch.demo_report import (
    plot_loss,
    rank_log_path,
    read_rank_log,
    recent_loss,
    render_tables,
    short_key,
    summarize,
)
from dist_quant.launch.demo_runners import RayRunner, TorchrunRunner
from dist_quant.launch.demo_schedule import Schedule, load_schedule_file, resolve_schedule
from dist_quant.launch.demo_switches import StepWatch, SwitchDriver
from dist_quant.launch.errors import CliError
from dist_quant.launch.ray import RAY_INSTALL_HINT
from dist_quant.launch.stop_signals import deferred
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from dist_quant.recipes import recipe_from_dict

# What a previous run left in the run directory that this run replaces once its ranks are up.
_RESULT_FILES = ("loss.png", "summary.json", "summary.txt", HEATMAP_FILE, "fp8_stats.jsonl")

LAUNCHERS = ("torchrun", "ray", "ray-train")


@dataclass(frozen=True)
class DemoOptions:
    nproc: int = 2
    tp: int | None = None
    """Tensor-parallel size; None: `default_tp(nproc)`."""
    steps: int = 200
    launcher: str = "torchrun"  # one of LAUNCHERS
    schedule_file: str | None = None
    out: str = "dist_quant_run"
    seed: int = 0
    model: str = "gpt"
    device: str = "auto"
    step_delay: float = 0.0
    batch_size: int = 16
    lr: float = 3e-3
    switch_timeout_s: float = 60.0
    """Vote deadline of each scheduled switch."""
    guard: bool = False
    """Run the precision guard (launch/demo_guard.py) with FP8 telemetry every step."""
    spike_at: int | None = None
    """Inject an activation outlier at this step (launch/demo_guard.py)."""


def default_tp(nproc: int) -> int:
    """Tensor parallel over pairs of ranks: 2 ranks are one TP=2 group, 4 are TP=2 x DP=2."""
    return 2 if nproc % 2 == 0 else 1


def _resolve(opts: DemoOptions) -> tuple[dict[str, Any], Schedule]:
    """Validate the options (CliError 2 on any problem) -> (rank config, schedule)."""
    tp = opts.tp if opts.tp is not None else default_tp(opts.nproc)
    if opts.nproc % tp:
        raise CliError(f"demo: --tp {tp} must divide --nproc {opts.nproc}", 2)
    if opts.launcher not in LAUNCHERS:
        raise CliError(f"demo: --launcher must be one of {LAUNCHERS}, got {opts.launcher!r}", 2)
    if opts.step_delay < 0:
        raise CliError(f"demo: --step-delay must be >= 0, got {opts.step_delay}", 2)
    if opts.launcher != "torchrun" and importlib.util.find_spec("ray") is None:
        raise CliError(
            f"demo: --launcher {opts.launcher} needs Ray, which is not installed: "
            f"{RAY_INSTALL_HINT}"
        )
    try:
        spec = parse_gpt_spec(opts.model)
        spec.check_tp(tp)
        raw = None if opts.schedule_file is None else load_schedule_file(opts.schedule_file)
        schedule = resolve_schedule(raw, opts.steps)
    except ValueError as e:
        raise CliError(f"demo: {e}", 2) from e
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    device = opts.device
    if device == "auto":
        device = "cuda" if gpus >= opts.nproc else "cpu"
    elif device == "cuda" and gpus < opts.nproc:
        raise CliError(f"demo: --device cuda needs {opts.nproc} GPUs, this machine has {gpus}", 2)
    out = Path(opts.out).resolve()
    cfg = {
        "run_dir": str(out),
        "steps": opts.steps,
        "seed": opts.seed,
        "model": spec.to_spec(),
        "tp": tp,
        "batch_size": opts.batch_size,
        "lr": opts.lr,
        "first_recipe": schedule.phases[0].recipe,
        "step_delay": opts.step_delay,
        "device": device,
        "guard": opts.guard,
        "spike_at": opts.spike_at,
    }
    return cfg, schedule


def spike_note(schedule: Schedule, spike_at: int | None, steps: int) -> str | None:
    """Why `--spike-at` will show the guard nothing, if it will not: a step past the run (a
    usage error, CliError 2), or one in a bf16 phase, where nothing is cast to FP8, so nothing
    saturates (a note: a loss spike there is still the user's to try)."""
    if spike_at is None:
        return None
    if spike_at >= steps:
        raise CliError(f"demo: --spike-at {spike_at} is past the last step ({steps - 1})", 2)
    precision_of = _precision_classifier()
    ends = [p.start for p in schedule.phases[1:]] + [steps]
    spans = list(zip(schedule.phases, ends, strict=True))
    phase, end = next((p, e) for p, e in reversed(spans) if p.start <= spike_at)
    if precision_of(short_key(recipe_from_dict(phase.recipe))) != "bf16":
        return None
    fp8 = ", ".join(
        f"{p.start}-{e - 1}"
        for p, e in spans
        if e > p.start and precision_of(short_key(recipe_from_dict(p.recipe))) != "bf16"
    )
    return (
        f"note: --spike-at {spike_at} lands in '{phase.label}' (steps {phase.start}-{end - 1}), "
        "which casts nothing to FP8: the guard will see no saturation"
        + (f"; FP8 runs at steps {fp8}" if fp8 else "")
    )


def _runner_class(launcher: str) -> Any:
    if launcher == "ray-train":
        from dist_quant.launch.ray_train import DemoRunner  # Ray Train is imported only here

        return DemoRunner
    return RayRunner if launcher == "ray" else TorchrunRunner


# ---- the whole demo --------------------------------------------------------------------------
def _stale_token(out: Path) -> str | None:
    try:
        return read_endpoint(out)["token"]
    except (OSError, ValueError):
        return None


def _clear_previous_results(out: Path, nproc: int) -> None:
    """Called once this run's ranks are up. Ranks below `nproc` truncate their own step logs
    (removing them here could race with a rank opening its new one); logs of ranks this run
    does not have, and the previous summary and plot, go."""
    for name in _RESULT_FILES:
        (out / name).unlink(missing_ok=True)
    for path in out.glob("ranks/rank*.jsonl"):
        rank = path.stem.removeprefix("rank")
        if not rank.isdigit() or int(rank) >= nproc:
            path.unlink(missing_ok=True)


def _precision_classifier() -> Any:
    """Short recipe key -> "bf16" (the built-in bf16 recipe), "fp8" (an FP8 recipe type) or
    "custom" (any other CustomRecipe), for the plot's shading."""
    bf16 = short_key(recipe_from_dict("bf16"))
    fp8_types = {
        "DelayedScaling",
        "Float8CurrentScaling",
        "Float8BlockScaling",
        "MXFP8BlockScaling",
    }

    def precision_of(key: str) -> str:
        if key == bf16:
            return "bf16"
        return "fp8" if key.split(":")[0] in fp8_types else "custom"

    return precision_of


def _console() -> Any:
    return Console(width=None if sys.stdout.isatty() else 120)


def run_demo(opts: DemoOptions) -> int:
    """Run the demo end to end; returns the exit code (CliError for failures)."""
    cfg, schedule = _resolve(opts)
    note = spike_note(schedule, opts.spike_at, opts.steps)
    cfg["nproc"] = opts.nproc
    out = Path(cfg["run_dir"])
    out.mkdir(parents=True, exist_ok=True)
    launched_at = time.time()
    console = _console()
    tp, dp = cfg["tp"], opts.nproc // cfg["tp"]
    console.print(
        f"[bold]dist-quant demo[/]: {cfg['model']} on {opts.nproc} ranks (TP={tp} x DP={dp}, "
        f"{cfg['device']}, {opts.launcher}), {opts.steps} steps; run dir {out}"
    )
    console.print("schedule: " + ", ".join(f"{p.label} @ {p.start}" for p in schedule.phases))
    if note is not None:
        console.print(f"[yellow]{note}[/]")
    watch = StepWatch(rank_log_path(out, 0), since=launched_at)
    stale = _stale_token(out)
    driver = SwitchDriver(schedule.switches, out, stale, opts.switch_timeout_s, watch)
    runner: Any = None
    finished = False
    try:
        with console.status(f"starting {opts.nproc} ranks with {opts.launcher}..."):
            with deferred():  # a stop signal during the spawn must find `runner` to stop
                runner = _runner_class(opts.launcher)(cfg, out)
            driver.start()
            while driver.token is None and driver.is_alive():
                if runner.finished():  # raises CliError naming the failure
                    break
                time.sleep(0.05)
        if driver.token is not None:
            runner.started()
            _clear_previous_results(out, opts.nproc)
        _follow(
            runner,
            driver,
            schedule,
            watch,
            opts.steps,
            console,
            Progress(
                TextColumn("{task.description:<14}"),
                BarColumn(),
                MofNCompleteColumn(),
                TextColumn("loss (5-step mean) {task.fields[loss]}"),
                TimeElapsedColumn(),
                console=console,
            ),
        )
        finished = True
    finally:
        driver.stop_event.set()
        with deferred():  # a second stop signal must not cut the stop short
            if runner is not None:
                runner.stop()
            left = _stale_token(out)  # this run's, even if the driver has not seen it yet
            if not finished and left is not None and left != stale:
                remove_endpoint(out, left)  # the ranks are gone; clients must not wait
    driver.join(timeout=30)

    logs = {r: read_rank_log(rank_log_path(out, r)) for r in range(opts.nproc)}
    schedule_keys = [(short_key(recipe_from_dict(p.recipe)), p.label) for p in schedule.phases]
    task = MarkovTask(vocab=parse_gpt_spec(cfg["model"]).vocab, seed=opts.seed)
    summary = summarize(
        logs,
        driver.records,
        schedule_keys=schedule_keys,
        entropy_floor=task.entropy_rate(),
        precision_of=_precision_classifier(),
        guard_switches=committed_guard_switches(out),
    )
    summary["config"] = {k: v for k, v in cfg.items() if k != "run_dir"} | {
        "launcher": opts.launcher
    }
    tables = render_tables(summary)
    for table in tables:
        console.print(table)
    with open(out / "summary.txt", "w") as f:
        text_console = Console(file=f, width=120, color_system=None)
        for table in tables:
            text_console.print(table)
    plot_loss(summary, out / "loss.png")
    bf16_steps = [
        (ph["start"], ph["start"] + ph["steps"])
        for ph in summary["phases"]
        if ph["precision"] == "bf16"
    ]
    if plot_stats_heatmap(out, out / HEATMAP_FILE, bf16_steps):
        console.print(f"FP8 heat map: {out / HEATMAP_FILE}")
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    console.print(f"loss curve: {out / 'loss.png'}   summary: {out / 'summary.json'}")
    failed = [s for s in driver.records if not s["committed"]]
    if len(driver.records) < len(schedule.switches):
        failed.append({"label": "(not requested)"})
    if failed or summary["mismatched_steps"]:
        what = ", ".join(s["label"] for s in failed) or "recipe mismatch between ranks"
        raise CliError(f"demo: scheduled switches did not all commit: {what}", 1)
    return 0


def _follow(
    runner: Any,
    driver: SwitchDriver,
    schedule: Schedule,
    watch: StepWatch,
    steps: int,
    console: Any,
    progress: Any,
) -> None:
    """Show rank 0's progress until the job ends; raises CliError if it fails. The loss shown is
    the mean of the last steps, the same average as the phase table's columns."""
    with progress:
        task = progress.add_task(schedule.phases[0].label, total=steps, loss="-")
        while True:
            done = runner.finished()
            records = watch.records()
            if records:
                last = records[-1]
                label = schedule.phases[0].label
                for rec in list(driver.records):
                    if rec["committed"] and last["step"] >= rec["step"]:
                        label = rec["label"]
                progress.update(
                    task,
                    completed=last["step"] + 1,
                    description=label,
                    loss=f"{recent_loss(records):.3f}",
                )
            if done:
                return
            time.sleep(0.2)
