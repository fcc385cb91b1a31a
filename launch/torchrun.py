"""Launch N local ranks with `torch.distributed.run` (torchrun), as a supervised child process.

`dist-quant run --nproc N script.py ARGS` runs
`python -m torch.distributed.run --standalone --nnodes 1 --nproc-per-node N script.py ARGS`
with `DIST_QUANT_RUN_DIR` exported, so that `attach()` in the script and `dist-quant switch` in
another terminal find the same coordinator. Plain `torchrun` works just as well; this wrapper only
adds the run directory, a banner once the job's coordinator is up, and a clean shutdown: torchrun
runs in its own session (a terminal's Ctrl-C reaches the launcher only), and stopping the job
sends it SIGTERM (torchrun then stops its workers) and, if it has not exited within the grace
period, SIGKILL to the whole group, so no worker outlives the launcher. A stop signal to the
launcher (launch/stop_signals.py) is such a stop.

The child is torch's own `torch.distributed.run` main, run by this file's `__main__` only to end
quietly with 128 + N when torchrun is stopped by signal N: torch lets its `SignalException` escape
as a 35-line traceback, which reads like a crash of a job that was merely told to stop.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import IO, TextIO

from dist_quant.coordinator.endpoint import read_endpoint, remove_endpoint, resolve_run_dir
from dist_quant.launch.stop_signals import deferred


def torchrun_command(
    nproc: int, target: Sequence[str], *, module: bool = False, python: str | None = None
) -> list[str]:
    """The argv that runs `target` (a script and its arguments, or a module with `module=True`)
    on `nproc` local ranks."""
    if isinstance(nproc, bool) or not isinstance(nproc, int) or nproc < 1:
        raise ValueError(f"--nproc must be an integer >= 1, got {nproc!r}")
    if not target:
        raise ValueError("torchrun needs a script (or module) to run")
    return [
        python or sys.executable,
        "-m",
        "dist_quant.launch.torchrun",  # torch.distributed.run, quiet when stopped (see above)
        # --standalone: a private c10d rendezvous on a free local port, so two jobs on one
        # machine never collide on MASTER_PORT.
        "--standalone",
        "--nnodes",
        "1",
        "--nproc-per-node",
        str(nproc),
        *(["-m"] if module else []),
        *target,
    ]


class TorchrunJob:
    """One torchrun process group: start it, poll it, stop it without leaving orphans."""

    def __init__(
        self,
        nproc: int,
        target: Sequence[str],
        *,
        module: bool = False,
        env: Mapping[str, str] | None = None,
        run_dir: str | Path | None = None,
        stdout: IO[str] | int | None = None,
    ) -> None:
        self.argv = torchrun_command(nproc, target, module=module)
        child_env = dict(os.environ)
        child_env.update(env or {})
        if run_dir is not None:
            child_env["DIST_QUANT_RUN_DIR"] = str(Path(run_dir).resolve())
        # One BLAS thread per rank: N ranks on N cores otherwise oversubscribe and crawl.
        child_env.setdefault("OMP_NUM_THREADS", "1")
        self._env = child_env
        self._stdout = stdout
        self._proc: subprocess.Popen[bytes] | None = None

    def start(self) -> TorchrunJob:
        if self._proc is not None:
            raise RuntimeError("this torchrun job was already started")
        stderr = subprocess.STDOUT if self._stdout is not None else None
        with deferred():  # a stop signal now must find the handle stored, to stop the job
            self._proc = subprocess.Popen(
                self.argv, env=self._env, stdout=self._stdout, stderr=stderr, start_new_session=True
            )
        return self

    @property
    def pid(self) -> int | None:
        return None if self._proc is None else self._proc.pid

    def poll(self) -> int | None:
        """The exit code, or None while the job runs."""
        return None if self._proc is None else self._proc.poll()

    def wait(self, timeout: float | None = None) -> int:
        if self._proc is None:
            raise RuntimeError("this torchrun job was never started")
        return self._proc.wait(timeout)

    def stop(self, grace_s: float = 10.0) -> int | None:
        """SIGTERM torchrun (it forwards the stop to its workers), then SIGKILL the whole process
        group after `grace_s`. Returns the exit code, or None if it was never started."""
        proc = self._proc
        if proc is None:
            return None
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(grace_s)
            except subprocess.TimeoutExpired:
                pass
        # Workers that ignored the agent's SIGTERM are still in torchrun's group (its session).
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        return proc.wait()


def run_script(
    nproc: int,
    script: str,
    args: Sequence[str],
    *,
    module: bool = False,
    run_dir: str | Path | None = None,
    announce: TextIO | None = None,
) -> int:
    """`dist-quant run`: run `script` under torchrun in the foreground; returns its exit code.

    Once the job's coordinator is up (its `coordinator.json` appears) a banner naming the run
    directory and the switch command goes to `announce`. Whatever ends this call (the job, or a
    stop signal raised as `StopRequested`) stops every rank before it returns, and a
    `coordinator.json` the job wrote and could not remove itself (its ranks were stopped by a
    signal) is removed then, so that no client is sent to a job that is gone.
    """
    if not module and not Path(script).is_file():
        raise FileNotFoundError(f"script {script!r} does not exist")
    directory = resolve_run_dir(run_dir)

    def token() -> str | None:
        try:
            return read_endpoint(directory)["token"]
        except (OSError, ValueError):
            return None

    before = token()
    job = TorchrunJob(nproc, [script, *args], module=module, run_dir=directory)
    try:
        job.start()
        announced = announce is None
        while True:
            try:
                return job.wait(timeout=0.1)
            except subprocess.TimeoutExpired:
                pass
            if not announced and token() not in (None, before):
                announced = True
                print(_banner(directory), file=announce, flush=True)
    finally:
        with deferred():  # a second signal must not cut the stop short
            job.stop()
            left = token()
            if left is not None and left != before:  # this job's, and the job has ended
                remove_endpoint(directory, left)


def _banner(directory: Path) -> str:
    return (
        f"dist-quant run: the job's coordinator is up; run dir {directory}\n"
        f"  switch every rank:  dist-quant switch current --run-dir {directory}"
        "   (or bf16, delayed, mxfp8, block, a recipe file)\n"
        f"  watch it:           dist-quant status --run-dir {directory}\n"
        "  stop it:            Ctrl-C here (or SIGTERM to this process): every rank stops"
    )


if __name__ == "__main__":
    # The child that TorchrunJob starts: torch's torchrun main, ended quietly by a stop signal.
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.run import main as _torchrun_main

    try:
        _torchrun_main()
    except SignalException as _stop:
        sys.exit(128 + int(_stop.sigval))
