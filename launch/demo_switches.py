"""The demo launcher's scheduled switches: booked shortly before their step, as a client.

`SwitchDriver` requests each scheduled switch with `request_switch(recipe, at_step=start)`, like
`dist-quant switch` from another terminal, but only once rank 0 is `booking_lead` steps before
`start` (`StepWatch` follows rank 0's step log). Until then no switch is open, so a hand switch
commits at once; a scheduled switch that finds a hand switch open retries, and one that arrives
after its step has passed on some rank is re-requested for the next possible step.
"""

from __future__ import annotations

import math
import threading
import time
from pathlib import Path
from typing import Any

from dist_quant.coordinator.endpoint import read_endpoint
from dist_quant.coordinator.errors import SwitchBusyError, SwitchRequestError
from dist_quant.coordinator.switch_requests import request_switch
from dist_quant.launch.demo_report import read_rank_log
from dist_quant.launch.demo_schedule import Phase

# A scheduled switch is requested this many steps (or seconds of training, if that is more)
# before its step: enough for the vote (milliseconds) on a fast GPU, short enough that the job is
# free for hand switches the rest of the time.
BOOK_AHEAD_STEPS = 3
BOOK_AHEAD_S = 1.0


class StepWatch:
    """Rank 0's progress from its step log: the last step and the recent step rate. Records
    older than `since` (a previous run's log, before rank 0 truncates it) are ignored."""

    def __init__(self, log_path: Path, since: float) -> None:
        self.log_path = log_path
        self.since = since

    def records(self) -> list[dict[str, Any]]:
        return [r for r in read_rank_log(self.log_path) if r.get("t", 0.0) >= self.since]

    def last_and_rate(self) -> tuple[int | None, float | None]:
        recs = self.records()
        if not recs:
            return None, None
        recent = recs[-10:]
        span = recent[-1]["t"] - recent[0]["t"]
        rate = (len(recent) - 1) / span if len(recent) > 1 and span > 0 else None
        return recs[-1]["step"], rate


def booking_lead(rate: float | None) -> int:
    """How many steps before its step a scheduled switch is requested, at `rate` steps/s."""
    if rate is None:
        return BOOK_AHEAD_STEPS
    return max(BOOK_AHEAD_STEPS, math.ceil(BOOK_AHEAD_S * rate))


class SwitchDriver(threading.Thread):
    """Requests each scheduled switch shortly before its step, as a client of the coordinator."""

    def __init__(
        self,
        phases: tuple[Phase, ...],
        run_dir: Path,
        stale_token: str | None,
        timeout_s: float,
        watch: StepWatch,
    ) -> None:
        super().__init__(name="dist_quant.demo.switches", daemon=True)
        self.phases = phases
        self.run_dir = run_dir
        self.stale_token = stale_token
        self.timeout_s = timeout_s
        self.watch = watch
        self.records: list[dict[str, Any]] = []
        self.stop_event = threading.Event()
        self.token: str | None = None  # this run's coordinator token, once it is up

    def run(self) -> None:
        if not self._wait_for_coordinator():
            return
        for phase in self.phases:
            if not self._wait_until_due(phase):
                return
            self.records.append(self._request(phase))

    def _wait_for_coordinator(self) -> bool:
        while not self.stop_event.wait(0.05):
            try:
                token = read_endpoint(self.run_dir)["token"]
            except (OSError, ValueError):
                continue  # not written yet (or being replaced)
            if token != self.stale_token:
                self.token = token
                return True
        return False

    def _wait_until_due(self, phase: Phase) -> bool:
        while not self.stop_event.is_set():
            last, rate = self.watch.last_and_rate()
            if last is not None and phase.start - last <= booking_lead(rate):
                return True
            self.stop_event.wait(0.05)
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
