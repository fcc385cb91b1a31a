"""What the coordinator counts per rank, held by rank or by range of ranks.

A node leader's relay that holds a uniform run of its node's votes (acks) sends one summary for
the run (`protocol.VoteSummary`, `AckSummary`), so the coordinator takes in a range of ranks as
one item. These holders keep per-rank messages and ranges side by side, and answer "is every
rank counted" and "which rank is counted" without touching each rank of a range: a switch whose
nodes all answer in summaries costs O(nodes). Listing the ranks still missing is O(ranks); it is
done only for an abort, a liveness look (every `BEAT_S` at most) or `dist-quant status`.

Free of the protocol's types (`decide.py` builds on this), threads, clocks and I/O.
"""

from __future__ import annotations

import itertools
from typing import Any, Generic, TypeVar

M = TypeVar("M")


class Tally(Generic[M]):
    """The first message of each rank in one round (votes, cancel votes or acks), counted as they
    arrive: one message per rank (`by_rank`), or one summary per range of ranks (`ranges`, each
    `(first, last, summary)`). Append-only: the only mutable part of a state, written by
    `coordinator_intake.take_*` alone. No rank is in two entries: what overlaps a counted rank is refused whole."""

    def __init__(self, world_size: int) -> None:
        self.world_size = world_size
        self.by_rank: dict[int, M] = {}
        self.ranges: list[tuple[int, int, Any]] = []
        self.count = 0
        self._counted = bytearray(world_size)  # 1 where a rank's message (or range) is in

    def add(self, rank: int, msg: M) -> str:
        """Keep `msg` unless the rank is unknown or already counted; "" when kept, else why not."""
        if not 0 <= rank < self.world_size:
            return f"unknown rank {rank}"
        if self._counted[rank]:
            return f"repeated message of rank {rank}"
        self._counted[rank] = 1
        self.by_rank[rank] = msg
        self.count += 1
        return ""

    def add_range(self, first: int, last: int, summary: Any) -> str:
        """Keep `summary` for ranks `first`..`last` (inclusive) unless one of them is unknown or
        already counted; "" when kept, else why not (nothing of the range is counted then)."""
        if not 0 <= first <= last < self.world_size:
            return f"ranks {first}-{last} are not a range of the job's {self.world_size} ranks"
        # bytearray scans and slice writes run in C: a node's range costs O(1) Python steps
        seen = self._counted.find(1, first, last + 1)
        if seen != -1:
            return f"repeated message of rank {seen} (in ranks {first}-{last})"
        self._counted[first : last + 1] = b"\x01" * (last - first + 1)
        self.ranges.append((first, last, summary))
        self.count += last - first + 1
        return ""

    def has(self, rank: int) -> bool:
        return 0 <= rank < self.world_size and bool(self._counted[rank])

    @property
    def complete(self) -> bool:
        return self.count == self.world_size

    def missing(self) -> list[int]:
        """The ranks not counted yet, in order."""
        if self.complete:
            return []
        return list(itertools.compress(range(self.world_size), map((1).__xor__, self._counted)))


class RankValues:
    """One value per rank (the recipe each rank runs), written one rank at a time or a range at
    once; a later write wins. A range costs one entry, so a switch whose acks come as node
    summaries costs O(nodes) here too; `as_dict` expands it, for `dist-quant status`."""

    def __init__(self) -> None:
        self._stamp = itertools.count()
        self._by_rank: dict[int, tuple[int, Any]] = {}
        self._by_range: dict[tuple[int, int], tuple[int, Any]] = {}

    def set(self, rank: int, value: Any) -> None:
        self._by_rank[rank] = (next(self._stamp), value)

    def set_range(self, first: int, last: int, value: Any) -> None:
        # one node's ranges repeat switch after switch: rewriting the key keeps one entry each
        self._by_range[(first, last)] = (next(self._stamp), value)

    def as_dict(self) -> dict[int, Any]:
        """Every rank written so far -> its latest value, in rank order."""
        writes = [(stamp, (rank, rank), v) for rank, (stamp, v) in self._by_rank.items()]
        writes += [(stamp, span, v) for span, (stamp, v) in self._by_range.items()]
        out: dict[int, Any] = {}
        for _, (first, last), value in sorted(writes, key=lambda w: w[0]):
            out.update(dict.fromkeys(range(first, last + 1), value))
        return dict(sorted(out.items()))
