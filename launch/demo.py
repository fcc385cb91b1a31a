"""`dist-quant demo`: launch the demo job, drive its recipe schedule, show and save the results.

The launcher process starts N ranks (torchrun or Ray; each runs `demo_train.train_rank`), then acts
as an ordinary client of the job's coordinator: for every phase after the first it calls
`request_switch(recipe, at_step=phase.start)`, exactly what `dist-quant switch` does from another
terminal. A switch refused because another one is still open (the previous one publishing, or
one typed by hand) is retried; one that arrives after its step has passed on some rank is
re-requested for the next possible step, and the table shows both steps. Meanwhile it follows
rank 0's step log for the progress bar. At the end it prints the tables, writes `loss.png`,
`summary.json` and `summary.txt` into the run directory (`--out`), and exits 0 only if every
scheduled switch committed and every rank ran the same recipe at every step.
"""

from __future__ import annotations

import json
import re
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# Imported here, not inside SwitchDriver's thread: a package imported for the first time from two
# threads at once can be seen half-initialised (an ImportError seen once on a GPU host).
from dist_quant.coordinator import SwitchBusyError, SwitchRequestError, request_switch
from dist_quant.coordinator.endpoint import read_endpoint
from dist_quant.launch.cli import CliError
from dist_quant.launch.demo_schedule import Phase, Schedule, load_schedule_file, resolve_schedule

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


def default_tp(nproc: int) -> int:
    """Tensor parallel over pairs of ranks: 2 ranks are one TP=2 group, 4 are TP=2 x DP=2."""
    return 2 if nproc % 2 == 0 else 1


def _resolve(opts: DemoOptions) -> tuple[dict[str, Any], Schedule]:
    """Validate the options (CliError 2 on any problem) -> (rank config, schedule)."""
    import torch
    from dist_quant.launch.demo_model import parse_gpt_spec

    tp = opts.tp if opts.tp is not None else default_tp(opts.nproc)
    if opts.nproc % tp:
        raise CliError(f"demo: --tp {tp} must divide --nproc {opts.nproc}", 2)
    if opts.launcher not in LAUNCHERS:
        raise CliError(f"demo: --launcher must be one of {LAUNCHERS}, got {opts.launcher!r}", 2)
    if opts.step_delay < 0:
        raise CliError(f"demo: --step-delay must be >= 0, got {opts.step_delay}", 2)
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
    }
    return cfg, schedule


# ---- the launcher's switch requests ----------------------------------------------------------
class SwitchDriver(threading.Thread):
    """Requests each scheduled switch in turn, as a client of the coordinator."""

    def __init__(
        self, phases: tuple[Phase, ...], run_dir: Path, stale_token: str | None, timeout_s: float
    ) -> None:
        super().__init__(name="dist_quant.demo.switches", daemon=True)
        self.phases = phases
        self.run_dir = run_dir
        self.stale_token = stale_token
        self.timeout_s = timeout_s
        self.records: list[dict[str, Any]] = []
        self.stop_event = threading.Event()

    def run(self) -> None:
        if not self._wait_for_coordinator():
            return
        for phase in self.phases:
            if self.stop_event.is_set():
                return
            self.records.append(self._request(phase))

    def _wait_for_coordinator(self) -> bool:
        while not self.stop_event.wait(0.05):
            try:
                if read_endpoint(self.run_dir)["token"] != self.stale_token:
                    return True
            except (OSError, ValueError):
                continue  # not written yet (or being replaced)
        return False

    def _request(self, phase: Phase) -> dict[str, Any]:
        rec: dict[str, Any] = {
            "label": phase.label,
            "requested_step": phase.start,
            "committed": False,
            "step": None,
            "latency_s": None,
            "reasons": {},
            "error": None,
        }
        at_step: int | None = phase.start
        while not self.stop_event.is_set():
            t0 = time.monotonic()
            try:
                result = request_switch(
                    phase.recipe, at_step=at_step, timeout_s=self.timeout_s, run_dir=self.run_dir
                )
            except SwitchBusyError:
                self.stop_event.wait(0.05)  # the previous switch is still publishing: retry
                continue
            except SwitchRequestError as e:
                rec["error"] = str(e)
                return rec
            rec.update(
                committed=result.committed,
                step=result.step,
                latency_s=time.monotonic() - t0,
                switch_id=result.switch_id,
                reasons={str(r): why for r, why in result.reasons.items()},
            )
            passed = result.reasons and all("already passed" in r for r in result.reasons.values())
            if result.committed or at_step is None or not passed:
                return rec
            at_step = None  # too late for the asked step (a slow start): take the next one
        rec["error"] = "the job ended before this switch was requested"
        return rec


# ---- launchers -------------------------------------------------------------------------------
# torchrun prefixes each line a rank prints with "[rank<r>]: ".
_ERROR_LINE = re.compile(r"^\s*(?:\[rank(\d+)\]:\s*)?(?:[\w.]+\.)?(\w*(?:Error|Exception)): (.+)$")


def _first_error(log_path: Path) -> str:
    """The first `SomethingError: message` line a rank printed (the first failure is the cause;
    peers that lose a collective partner fail after it), skipping torchrun's own."""
    try:
        lines = log_path.read_text(errors="replace").splitlines()
    except OSError:
        return ""
    for line in lines:
        m = _ERROR_LINE.match(line)
        if m and m.group(2) != "ChildFailedError":
            rank = f"rank {m.group(1)}: " if m.group(1) is not None else ""
            return f"{rank}{m.group(2)}: {m.group(3).strip()}"
    return ""


class _TorchrunRunner:
    def __init__(self, cfg: dict[str, Any], out: Path) -> None:
        from dist_quant.launch.torchrun import TorchrunJob

        config_path = out / "demo_config.json"
        config_path.write_text(json.dumps(cfg, indent=1))
        self.log_path = out / "torchrun.log"
        self._log = open(self.log_path, "w")  # noqa: SIM115 - closed in stop()
        self.job = TorchrunJob(
            cfg["nproc"],
            ["dist_quant.launch.demo_train", str(config_path)],
            module=True,
            run_dir=out,
            stdout=self._log,
        ).start()

    def finished(self) -> bool:
        rc = self.job.poll()
        if rc is None:
            return False
        if rc != 0:
            cause = _first_error(self.log_path)
            raise CliError(
                f"demo job failed (torchrun exit code {rc})"
                + (f": {cause}" if cause else "")
                + f"; full log: {self.log_path}",
                1,
            )
        return True

    def stop(self) -> None:
        self.job.stop()
        self._log.close()


class _RayRunner:
    def __init__(self, cfg: dict[str, Any], out: Path) -> None:
        from dist_quant.launch.demo_train import train_rank
        from dist_quant.launch.ray import RayJob

        self.job = RayJob(cfg["nproc"], use_gpu=cfg["device"] == "cuda", run_dir=out)
        self.job.start(train_rank, cfg)

    def finished(self) -> bool:
        from dist_quant.launch.ray import RankFailedError

        try:
            return self.job.poll()
        except RankFailedError as e:
            raise CliError(f"demo job failed: {e}", 1) from e

    def stop(self) -> None:
        self.job.shutdown()


def _runner(launcher: str) -> Any:
    if launcher == "ray-train":
        from dist_quant.launch.ray_train import DemoRunner

        return DemoRunner
    return _RayRunner if launcher == "ray" else _TorchrunRunner


# ---- the whole demo --------------------------------------------------------------------------
def _stale_token(out: Path) -> str | None:
    from dist_quant.coordinator.endpoint import read_endpoint

    try:
        return read_endpoint(out)["token"]
    except (OSError, ValueError):
        return None


def _console() -> Any:
    from rich.console import Console

    return Console(width=None if sys.stdout.isatty() else 120)


def run_demo(opts: DemoOptions) -> int:
    """Run the demo end to end; returns the exit code (CliError for failures)."""
    from dist_quant.launch.demo_data import MarkovTask
    from dist_quant.launch.demo_model import parse_gpt_spec
    from dist_quant.launch.demo_report import (
        plot_loss,
        rank_log_path,
        read_rank_log,
        render_tables,
        short_key,
        summarize,
    )
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from dist_quant.recipes import recipe_from_dict

    cfg, schedule = _resolve(opts)
    cfg["nproc"] = opts.nproc
    out = Path(cfg["run_dir"])
    out.mkdir(parents=True, exist_ok=True)
    for old in [
        *out.glob("ranks/rank*.jsonl"),
        out / "loss.png",
        out / "summary.json",
        out / "summary.txt",
    ]:
        old.unlink(missing_ok=True)
    console = _console()
    tp, dp = cfg["tp"], opts.nproc // cfg["tp"]
    console.print(
        f"[bold]dist-quant demo[/]: {cfg['model']} on {opts.nproc} ranks (TP={tp} x DP={dp}, "
        f"{cfg['device']}, {opts.launcher}), {opts.steps} steps; run dir {out}"
    )
    console.print("schedule: " + ", ".join(f"{p.label} @ {p.start}" for p in schedule.phases))
    driver = SwitchDriver(schedule.switches, out, _stale_token(out), opts.switch_timeout_s)
    runner: _TorchrunRunner | _RayRunner | None = None
    try:
        with console.status(f"starting {opts.nproc} ranks with {opts.launcher}..."):
            runner = _runner(opts.launcher)(cfg, out)
        driver.start()
        _follow(
            runner,
            driver,
            schedule,
            rank_log_path(out, 0),
            opts.steps,
            console,
            Progress(
                TextColumn("{task.description:<14}"),
                BarColumn(),
                MofNCompleteColumn(),
                TextColumn("loss {task.fields[loss]}"),
                TimeElapsedColumn(),
                console=console,
            ),
        )
    finally:
        driver.stop_event.set()
        if runner is not None:
            runner.stop()
    driver.join(timeout=30)

    logs = {r: read_rank_log(rank_log_path(out, r)) for r in range(opts.nproc)}
    schedule_keys = [(short_key(recipe_from_dict(p.recipe)), p.label) for p in schedule.phases]
    task = MarkovTask(vocab=parse_gpt_spec(cfg["model"]).vocab, seed=opts.seed)
    summary = summarize(
        logs, driver.records, schedule_keys=schedule_keys, entropy_floor=task.entropy_rate()
    )
    summary["config"] = {k: v for k, v in cfg.items() if k != "run_dir"} | {
        "launcher": opts.launcher
    }
    tables = render_tables(summary)
    for table in tables:
        console.print(table)
    with open(out / "summary.txt", "w") as f:
        from rich.console import Console

        text_console = Console(file=f, width=120, color_system=None)
        for table in tables:
            text_console.print(table)
    plot_loss(summary, out / "loss.png")
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
    log0: Path,
    steps: int,
    console: Any,
    progress: Any,
) -> None:
    """Show rank 0's progress until the job ends; raises CliError if it fails."""
    from dist_quant.launch.demo_report import read_rank_log

    with progress:
        task = progress.add_task(schedule.phases[0].label, total=steps, loss="-")
        while True:
            done = runner.finished()
            records = read_rank_log(log0)
            if records:
                last = records[-1]
                label = schedule.phases[0].label
                for rec in list(driver.records):
                    if rec["committed"] and last["step"] >= rec["step"]:
                        label = rec["label"]
                progress.update(
                    task, completed=last["step"] + 1, description=label, loss=f"{last['loss']:.3f}"
                )
            if done:
                return
            time.sleep(0.2)
