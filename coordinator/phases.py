"""The coordinator's phases and the transitions allowed between them.

`coordinator_state.py` gives each phase its state class and payload; `Coordinator._set_state`
refuses any change that `TRANSITIONS` does not list.
"""

from __future__ import annotations

from enum import Enum


class Phase(Enum):
    """Phases of the coordinator; the current switch's phase, or IDLE before the first switch."""

    IDLE = "idle"
    PREPARING = "preparing"  # Prepare sent; collecting votes until all voted or the deadline
    DECIDING = "deciding"  # outcome known; being written to the decision log
    COMMITTED = "committed"  # COMMIT logged and sent; ranks publish at step S and ack
    PUBLISHED = "published"  # every rank acked the publish
    ABORTED = "aborted"  # ABORT sent (or logging failed); every rank dropped its candidate
    CANCELLING = "cancelling"  # COMMITTED, and a cancel is being voted on before step S
    CANCELLED = "cancelled"  # the cancel was logged and sent; every rank dropped its candidate

    @property
    def terminal(self) -> bool:
        """A terminal phase closes its switch: a new request may open the next one."""
        return self in (Phase.PUBLISHED, Phase.ABORTED, Phase.CANCELLED)

    @property
    def open(self) -> bool:
        return self in (Phase.PREPARING, Phase.DECIDING, Phase.COMMITTED, Phase.CANCELLING)

    def describe(self, switch_id: int | None, step: int | None) -> str:
        """The phase in words, for `dist-quant status` and refusals."""
        at = "" if step is None else f" at step {step}"
        return {
            Phase.IDLE: "idle: no switch requested yet",
            Phase.PREPARING: f"switch {switch_id}: ranks are voting",
            Phase.DECIDING: f"switch {switch_id}: the decision is being logged",
            Phase.COMMITTED: f"switch {switch_id}: committed, ranks publish{at}",
            Phase.PUBLISHED: f"switch {switch_id}: published{at} on every rank",
            Phase.ABORTED: f"switch {switch_id}: aborted, every rank kept its recipe",
            Phase.CANCELLING: f"switch {switch_id}: committed{at}, a cancel is being voted",
            Phase.CANCELLED: f"switch {switch_id}: cancelled before step {step}",
        }[self]


# Allowed transitions; anything else is a bug in the coordinator and raises.
TRANSITIONS: dict[Phase, frozenset[Phase]] = {
    Phase.IDLE: frozenset({Phase.PREPARING}),
    Phase.PREPARING: frozenset({Phase.DECIDING}),
    Phase.DECIDING: frozenset({Phase.COMMITTED, Phase.ABORTED}),
    Phase.COMMITTED: frozenset({Phase.PUBLISHED, Phase.CANCELLING}),
    Phase.CANCELLING: frozenset({Phase.CANCELLED, Phase.COMMITTED}),
    Phase.PUBLISHED: frozenset({Phase.PREPARING}),
    Phase.ABORTED: frozenset({Phase.PREPARING}),
    Phase.CANCELLED: frozenset({Phase.PREPARING}),
}
