"""What a client gets back: `SwitchResult` from `request_switch`, `CancelResult` from
`cancel_switch` (carried in a `Reply`'s body as plain JSON)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from dist_quant.coordinator.schema import decode_fields, fields_of


@dataclass(frozen=True)
class CancelResult:
    """What `cancel_switch` returns: whether the switch was cancelled on every rank."""

    switch_id: int
    cancelled: bool
    step: int  # the commit step it was booked for
    reasons: dict[int, str]  # rank -> why it could not cancel (empty when cancelled)
    summary: str

    def to_dict(self) -> dict[str, Any]:
        return fields_of(self)

    @staticmethod
    def from_dict(d: Mapping[str, Any]) -> CancelResult:
        return decode_fields(CancelResult, d, "cancel result", strict=False)


@dataclass(frozen=True)
class SwitchResult:
    """What `request_switch` returns. An aborted switch is a result too (`committed=False`)."""

    switch_id: int
    committed: bool
    step: int | None  # the step at whose boundary every rank publishes (None if aborted)
    reasons: dict[int, str]  # rank -> why it could not switch (empty on commit)
    timings: dict[str, float]  # "votes_s" (open -> decided), "log_s" (fsync), "total_s"
    prepare_s: dict[int, float] = field(default_factory=dict)  # rank -> its plan + validate time
    summary: str = ""  # one line: "commit at step 12", or why it aborted
    # "first-last" -> the slowest plan + validate time of those ranks, for the ranks whose node's
    # relay summarized their votes (`VoteSummary`); the others are in `prepare_s`
    prepare_s_ranges: dict[str, float] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return fields_of(self)

    @staticmethod
    def from_dict(d: Mapping[str, Any]) -> SwitchResult:
        return decode_fields(SwitchResult, d, "switch result", strict=False)
