"""The demo's two launchers behind one interface: start, `started()`, `finished()`, `stop()`.

Until the ranks are up (`started()`, called once their coordinator has written its endpoint),
nothing a previous run left in the run directory is replaced: the torchrun runner's config and
log live under names of this launcher's own, and take their final names only then.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any

from dist_quant.launch.errors import CliError
from dist_quant.launch.ray import RankFailedError, RayJob
from dist_quant.launch.torchrun import TorchrunJob

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


def adopt_run_dir(out: Path, cfg: dict[str, Any]) -> None:
    """A Ray run's config replaces whatever a previous (torchrun) demo left; that demo's launch log
    does not describe this run."""
    tmp = out / f".demo_config.{os.getpid()}.json"
    tmp.write_text(json.dumps(cfg, indent=1))
    os.replace(tmp, out / "demo_config.json")
    (out / "torchrun.log").unlink(missing_ok=True)


class TorchrunRunner:
    """The ranks read their config from a file; it and torchrun's log live under names of this
    launcher's own until the ranks are up (`started`), so a run that fails to start replaces
    nothing of the previous one."""

    def __init__(self, cfg: dict[str, Any], out: Path) -> None:
        self.out = out
        self._config_path = out / f".demo_config.{os.getpid()}.json"
        self._config_path.write_text(json.dumps(cfg, indent=1))
        self.log_path = out / f".torchrun.{os.getpid()}.log"
        self._log = open(self.log_path, "w")  # noqa: SIM115 - closed in stop()
        self._started = False
        self.job = TorchrunJob(
            cfg["nproc"],
            ["dist_quant.launch.demo_train", str(self._config_path)],
            module=True,
            run_dir=out,
            stdout=self._log,
        ).start()

    def started(self) -> None:
        """The ranks are up (they read the config before attaching): take the final names."""
        os.replace(self._config_path, self.out / "demo_config.json")
        os.replace(self.log_path, self.out / "torchrun.log")
        self.log_path = self.out / "torchrun.log"
        self._started = True

    def finished(self) -> bool:
        rc = self.job.poll()
        if rc is None:
            return False
        if rc != 0:
            if not self._started:  # never came up: keep its log beside, not over, the last one
                self._log.flush()
                os.replace(self.log_path, self.out / "torchrun-failed.log")
                self.log_path = self.out / "torchrun-failed.log"
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
        if not self._started:
            self._config_path.unlink(missing_ok=True)


class RayRunner:
    def __init__(self, cfg: dict[str, Any], out: Path) -> None:
        # the training stack (torch, the kernels) only where the ranks run: not in this launcher
        from dist_quant.launch.demo_train import train_rank

        self.out, self.cfg = out, cfg
        self.job = RayJob(cfg["nproc"], use_gpu=cfg["device"] == "cuda", run_dir=out)
        self.job.start(train_rank, cfg)

    def started(self) -> None:
        adopt_run_dir(self.out, self.cfg)

    def finished(self) -> bool:
        try:
            return self.job.poll()
        except RankFailedError as e:
            raise CliError(f"demo job failed: {e}", 1) from e

    def stop(self) -> None:
        self.job.shutdown()
