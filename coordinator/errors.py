"""Exceptions callers of the coordinator API handle."""

from __future__ import annotations


class SwitchRequestError(RuntimeError):
    """A switch or status request could not be made: no coordinator found, connection lost, wrong
    token, bad arguments. An aborted switch is not this: `request_switch` returns its result."""


class SwitchBusyError(SwitchRequestError):
    """Refused because another switch is open; `open_switch_id` names it."""

    def __init__(self, message: str, open_switch_id: int | None) -> None:
        super().__init__(message)
        self.open_switch_id = open_switch_id


class CancelRefusedError(SwitchRequestError):
    """The coordinator refused a cancel: no committed switch (or not the one named) is open."""


class SwitchError(RuntimeError):
    """Raised by `step_boundary` when this rank cannot stay consistent with the others (a COMMIT
    arrived after it gave up waiting, or publishing failed). The job must stop and restart from a
    checkpoint: continuing could run one step with two recipes."""
