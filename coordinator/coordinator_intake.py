"""The messages the coordinator takes in: votes, acks, cancel votes and signs of life, one by one
or as a node relay's summary of a range of its ranks.

Each `take_*` adds a message to the tally (or lease) of the state that collects it and returns
the log line saying what became of it; none changes the phase, which only the step functions of
`coordinator_state.py` move on. Free of threads, clocks and I/O like them (the time `now` is
passed in). A summary goes in as one range, refused whole when its ranks are not consecutive
ranks of its leader's node or one of them is already counted.
"""

from __future__ import annotations

import bisect
from collections.abc import Mapping, Sequence

from dist_quant.coordinator.coordinator_state import (
    Cancelling,
    Committed,
    Preparing,
    State,
    describe_ranks,
)
from dist_quant.coordinator.protocol import (
    Ack,
    AckSummary,
    Alive,
    AliveSummary,
    CancelVote,
    Vote,
    VoteSummary,
)


def take_vote(state: State, vote: Vote) -> str:
    """Count a vote of the open round; the log line saying what became of it."""
    if not isinstance(state, Preparing) or vote.switch_id != state.opened.prepare.switch_id:
        return f"ignored vote of rank {vote.rank}: stale or too late"
    refused = state.votes.add(vote.rank, vote)
    if refused:
        return f"ignored vote: {refused}"
    return f"rank {vote.rank} votes {'yes' if vote.yes else 'no'}"


def take_vote_summary(
    state: State, summary: VoteSummary, nodes: Mapping[int, Sequence[int]]
) -> str:
    """Count a node's summarized YES votes of the open round as one range; the log line saying
    what became of it. `nodes`: each relayed node's ranks (sorted) by its leader. A summary that
    is not for ranks of its leader's node, or that overlaps a rank already counted, is refused
    whole, naming why: nothing of it is counted."""
    what = f"vote summary of node {summary.leader} (ranks {summary.first}-{summary.last})"
    if not isinstance(state, Preparing) or summary.switch_id != state.opened.prepare.switch_id:
        return f"ignored the {what}: stale or too late"
    problem = node_range_problem(summary, nodes)
    if problem:
        return f"refused the {what}: {problem}"
    refused = state.votes.add_range(summary.first, summary.last, summary)
    if refused:
        return f"refused the {what}: {refused}"
    return f"ranks {summary.first}-{summary.last} vote yes"


def take_ack_summary(state: State, summary: AckSummary, nodes: Mapping[int, Sequence[int]]) -> str:
    """Count a node's summarized acks (every one ok) of the committed switch as one range; as
    `take_ack`, acks of a switch that is over change nothing. Refused whole as a vote summary
    is."""
    committed = state.committed if isinstance(state, Cancelling) else state
    if not isinstance(committed, Committed) or summary.switch_id != committed.settled.switch_id:
        return ""
    what = f"ack summary of node {summary.leader} (ranks {summary.first}-{summary.last})"
    problem = node_range_problem(summary, nodes)
    if problem:
        return f"refused the {what}: {problem}"
    refused = committed.acks.add_range(summary.first, summary.last, summary)
    return f"refused the {what}: {refused}" if refused else ""


def node_range_problem(
    summary: VoteSummary | AckSummary | AliveSummary, nodes: Mapping[int, Sequence[int]]
) -> str:
    """Why `summary` cannot stand for its ranks ("" if it can): its leader runs no relay, or
    `first`..`last` are not consecutive ranks of that leader's node. O(log node size)."""
    ranks = nodes.get(summary.leader)
    if ranks is None:
        return f"rank {summary.leader} leads no relayed node"
    first, last = summary.first, summary.last
    if first > last:
        return f"first rank {first} is after last rank {last}"
    # sorted distinct ranks: first and last at positions last - first apart means every rank
    # between them is there too
    i = bisect.bisect_left(ranks, first)
    j = i + last - first
    if not (i < len(ranks) and ranks[i] == first and j < len(ranks) and ranks[j] == last):
        return f"not ranks of its node ({describe_ranks(ranks, (ranks,))})"
    return ""


def take_alive(state: State, alive: Alive, *, now: float) -> None:
    """Note that a rank still planning the open switch is alive."""
    if isinstance(state, Preparing) and alive.switch_id == state.opened.prepare.switch_id:
        if 0 <= alive.rank < state.votes.world_size:
            state.lease.heard[alive.rank] = now


def take_alive_summary(
    state: State, summary: AliveSummary, nodes: Mapping[int, Sequence[int]], *, now: float
) -> str:
    """Note that a node's ranks `first`..`last`, still planning the open switch, are alive; ""
    or why the summary was refused (as a vote summary is, for its ranks)."""
    if not isinstance(state, Preparing) or summary.switch_id != state.opened.prepare.switch_id:
        return ""
    problem = node_range_problem(summary, nodes)
    if problem:
        what = f"alive summary of node {summary.leader} (ranks {summary.first}-{summary.last})"
        return f"refused the {what}: {problem}"
    state.lease.heard.update(dict.fromkeys(range(summary.first, summary.last + 1), now))
    return ""


def take_cancel_vote(state: State, vote: CancelVote) -> str:
    if not isinstance(state, Cancelling) or vote.switch_id != state.prepare.switch_id:
        return f"ignored cancel vote of rank {vote.rank}: stale or too late"
    refused = state.votes.add(vote.rank, vote)
    if refused:
        return f"ignored cancel vote: {refused}"
    return f"rank {vote.rank} votes {'yes' if vote.yes else 'no'} to cancel"


def take_ack(state: State, ack: Ack) -> str:
    """Count an ack of the committed switch (also while a cancel of it is being voted)."""
    committed = state.committed if isinstance(state, Cancelling) else state
    if not isinstance(committed, Committed) or ack.switch_id != committed.settled.switch_id:
        return ""  # acks of a switch that is over (or a replay) change nothing
    refused = committed.acks.add(ack.rank, ack)
    if refused:
        return f"ignored ack: {refused}"
    return "" if ack.ok else f"rank {ack.rank} failed to publish: {ack.error}"
