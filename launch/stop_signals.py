"""How the long-running commands (`dist-quant run`, `dist-quant demo`) take a stop signal.

SIGINT (Ctrl-C), SIGTERM (`kill`, `timeout`, `docker stop`, Slurm's preemption) and SIGHUP (the
terminal went away) all mean the same: stop every rank, clean up, exit 128 + the signal number.
The launchers run torchrun in a session of its own, so a signal to the launcher reaches no rank by
itself: the launcher has to live long enough to stop the job. Python's defaults do not allow that
(SIGTERM and SIGHUP end the process at once), so `stop_on_signals` installs one handler for the
three, which raises `StopRequested` in the main thread and lets every `finally` run.

Two ways a stop could be lost, both closed here:
- A process started in the background by a non-interactive shell (`cmd &` in a script, as a test
  runner may be) inherits SIGINT ignored, and Python keeps it ignored: `kill -INT` then did
  nothing at all. The handler is installed whatever the inherited disposition was.
- A signal that lands between spawning torchrun and remembering its handle unwinds past the code
  that would stop it. Inside `deferred()` a signal is only recorded; it is raised when the block
  ends, by which time the handle is stored where the cleanup finds it.

Only the first signal raises: a second one while the job is being stopped must not abort the
cleanup half way (the stop is bounded: torchrun gets a grace period, then SIGKILL).
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from types import FrameType

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


class StopRequested(BaseException):  # noqa: N818 - it is a request, like KeyboardInterrupt
    """A stop signal arrived. A BaseException, as KeyboardInterrupt is: `except Exception` in the
    code it unwinds must not swallow it."""

    def __init__(self, signum: int) -> None:
        self.signum = signum
        super().__init__(f"stopped by {signal.Signals(signum).name}")

    @property
    def exit_code(self) -> int:
        """The shell's convention for a process ended by a signal: 128 + its number."""
        return 128 + self.signum


class _Stopper:
    """The process's handler state (signal dispositions are per process, hence one instance)."""

    def __init__(self) -> None:
        self.received: int | None = None
        self.raised = False
        self.depth = 0  # nesting of deferred() blocks

    def handle(self, signum: int, frame: FrameType | None) -> None:
        if self.received is None:
            self.received = signum
        if self.depth == 0:
            self.raise_pending()

    def raise_pending(self) -> None:
        if self.received is not None and not self.raised:
            self.raised = True
            raise StopRequested(self.received)


_active: _Stopper | None = None


@contextmanager
def stop_on_signals() -> Iterator[None]:
    """Within the block, SIGINT/SIGTERM/SIGHUP raise `StopRequested` in the main thread (once);
    the previous handlers come back afterwards. Main thread only (Python's rule for handlers)."""
    global _active
    if threading.current_thread() is not threading.main_thread():
        raise RuntimeError("stop_on_signals() must be entered in the main thread")
    if _active is not None:
        raise RuntimeError("stop_on_signals() is already active in this process")
    stopper = _Stopper()
    previous = {sig: signal.getsignal(sig) for sig in STOP_SIGNALS}
    _active = stopper
    try:
        for sig in STOP_SIGNALS:
            signal.signal(sig, stopper.handle)
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        _active = None


@contextmanager
def deferred() -> Iterator[None]:
    """A stop signal that arrives inside the block is raised when it ends (not in the middle of
    it). Without `stop_on_signals` active this does nothing."""
    stopper = _active
    if stopper is None:
        yield
        return
    stopper.depth += 1
    try:
        yield
    finally:
        stopper.depth -= 1
        if stopper.depth == 0:
            stopper.raise_pending()
