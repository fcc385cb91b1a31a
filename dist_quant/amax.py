"""Amax reduction: delayed scaling's all-reduce of every slot's amax (parallel.py moves activations
and gradients, telemetry.py gathers statistics, a current-scaling quantizer with a reduction group
all-reduces its own amax: `quantizers.allreduce_current_amax`).

Delayed scaling: the amaxes recorded in a step by every slot of every module in one autocast region
(forward) or one backward pass are packed into one fp32 buffer and reduced with ONE all-reduce(MAX)
over the amax-reduction group, then each group's history/scale update runs. Numerics never reduce
by themselves: this file reduces and hands the result back.

The guard (ranks that ran different modules). The buffer is

    [amax rows of every module, sorted by module name] + zero padding + header
    header = [n, -n, sig_a, -sig_a, sig_b, -sig_b, dir, -dir, names_len]

where `n` is this rank's slot count, `sig_*` two 24-bit halves of a hash of its (module, slots)
list and `dir` the direction. Under MAX, `max(v)` and `-max(-v)` are the largest and smallest value
over the ranks, so one all-reduce tells every rank whether all ranks agree; every value is an integer
below 2**24, exact in fp32. Ranks whose modules differ would otherwise all-reduce buffers of
different lengths (gloo aborts, NCCL hangs or mixes unrelated amaxes), so the buffer length is never
taken from the local slot count: it is the group's capacity, the largest slot count the group has
agreed on so far (forward and backward share it), which every rank knows because it saw the same
sequence of reductions. A rank whose slots do not fit sends a zero payload and a header that says
so. After the one all-reduce every rank sees the same header and decides the same thing:
- all agree and fit: done (every step after the first: one all-reduce per direction, also when a
  job alternates models of different sizes);
- all agree on more slots than fit (the first step, a recipe switch that adds slots): the capacity
  grows and one more all-reduce carries the payload;
- ranks disagree (or one is in its forward, another in its backward): one more all-reduce exchanges
  each rank's module list (each rank writes its own row, the others are zero, so MAX is a gather)
  and every rank raises `AmaxReductionMismatch` naming the modules that ran on some ranks but not
  others. Scales and past history stay as they were; the step's recorded amaxes are discarded.
The decision needs the header on the host: one 36-byte device-to-host copy per direction per step.
A rank takes part when it has slots to reduce or the group's capacity is non-zero, so the one case
the guard cannot see is the group's very first reduction when some ranks have no delayed-scaling
slot at all: those ranks skip it and the others wait for the process-group timeout.
"""

from __future__ import annotations

import hashlib
import threading
import weakref
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from dist_quant.kernels import delayed_scaling_update_groups
from dist_quant.kinds import Direction

if TYPE_CHECKING:
    from dist_quant.state import DelayedGroup

_DIR_CODE = {Direction.FORWARD: 1.0, Direction.BACKWARD: 2.0}  # the header's `dir`
_HEADER = 9


class AmaxReductionMismatch(RuntimeError):
    """Ranks of one amax-reduction group ran different dist-quant modules in one step; raised on
    every rank of the group with the same description."""


# ---- who owns which buffer ---------------------------------------------------------------------
# A DelayedGroup is built once per published runtime (a switch publishes new ones), but its
# amax_history tensor is the slot group's identity (kept across switches by inherit_state_from),
# so names are keyed by it.
_names: dict[int, tuple[weakref.ref, str]] = {}


def name_groups(groups: Sequence[DelayedGroup], name: str) -> None:
    """Record that `groups` belong to module `name` (used in the packing order and in errors)."""
    for g in groups:
        key = id(g.amax_history)
        entry = _names.get(key)
        if entry is not None and entry[0]() is g.amax_history and entry[1] == name:
            continue
        ref = weakref.ref(g.amax_history, lambda _r, k=key: _names.pop(k, None))
        _names[key] = (ref, name)


def _name_of(g: DelayedGroup) -> str:
    entry = _names.get(id(g.amax_history))
    if entry is not None and entry[0]() is g.amax_history:
        return entry[1]
    return "<unnamed module>"


def _group_size(group: Any) -> int:
    if group is None or not dist.is_available() or not dist.is_initialized():
        return 1
    return dist.get_world_size(group)


def _unique(groups: Sequence[DelayedGroup]) -> list[DelayedGroup]:
    # A module that ran twice in one region (a shared layer, two microbatches) enrols the same
    # buffers twice; its history must still roll exactly once.
    first: dict[int, DelayedGroup] = {}
    for g in groups:
        first.setdefault(id(g.amax_history), g)
    return list(first.values())


# ---- the group's capacity: the largest slot count it has agreed on --------------------------------
_capacity_lock = threading.Lock()
_capacity: dict[Any, int] = {}


def _signature(direction: Direction, entries: list[tuple[str, int]]) -> tuple[float, float, str]:
    text = direction + "\n" + "\n".join(f"{name}\t{n}" for name, n in entries)
    digest = hashlib.blake2b(text.encode(), digest_size=6).digest()
    return (
        float(int.from_bytes(digest[:3], "little")),
        float(int.from_bytes(digest[3:], "little")),
        text,
    )


def reduce_and_update(
    groups: Sequence[DelayedGroup], group: Any, *, direction: Direction = Direction.FORWARD
) -> None:
    """All-reduce(MAX) the current-step amax row of every group in one collective, then update.

    Groups with `reduce_amax=False` keep their local amax. The order of `groups` does not matter
    (they are packed by module name). Raises `AmaxReductionMismatch` on every rank when the ranks'
    lists of modules differ.
    """
    groups = _unique(groups)
    if _group_size(group) > 1:
        reduced = [g for g in groups if g.reduce_amax]
        if reduced and torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
            raise RuntimeError(
                f"amax reduction ({direction}) over {_group_size(group)} ranks cannot be captured "
                "in a CUDA graph (its mismatch guard reads a header on the host): graph the "
                "forward+backward with dist_quant.make_graphed_callables, which keeps the "
                "reduction outside the graph"
            )
        with _capacity_lock:
            capacity = _capacity.get(group, 0)
        if reduced or capacity:
            _reduce(reduced, group, direction, capacity)
    update_groups(groups)


def update_groups(groups: Sequence[DelayedGroup]) -> None:
    """History roll + scale compute of every group: the standard ones ("max" / "most_recent", no
    custom scaling function) in one fused launch on CUDA, callables one by one."""
    standard, custom = [], []
    for g in groups:
        if g.is_standard:
            standard.append((g.amax_history, g.scale, g.fp8_max, g.margin, g.algo))
        else:
            custom.append(g)
    if standard:
        delayed_scaling_update_groups(standard)
    for g in custom:
        g.update()


def _reduce(reduced: list[DelayedGroup], group: Any, direction: Direction, capacity: int) -> None:
    # Sort by module name (ties keep first-run order): ranks may run modules in different orders.
    order = sorted(range(len(reduced)), key=lambda i: (_name_of(reduced[i]), i))
    reduced = [reduced[i] for i in order]
    entries = [(_name_of(g), g.amax_history.shape[1]) for g in reduced]
    n = sum(c for _, c in entries)
    sig_a, sig_b, text = _signature(direction, entries)
    d = _DIR_CODE[direction]
    device = reduced[0].amax_history.device if reduced else _default_device(group)
    header = torch.tensor(
        [n, -n, sig_a, -sig_a, sig_b, -sig_b, d, -d, len(text.encode())],
        dtype=torch.float32,
        device=device,
    )
    fits = n <= capacity
    rows = [g.amax_history[0] for g in reduced] if fits else []
    pad = torch.zeros(capacity - n if fits else capacity, dtype=torch.float32, device=device)
    buf = torch.cat([*rows, pad, header])  # (capacity + 9,): this step's amaxes, padding, header
    dist.all_reduce(buf, op=dist.ReduceOp.MAX, group=group)  # -> max over the group's ranks
    h = buf[capacity:].tolist()
    consistent = h[0] == -h[1] and h[2] == -h[3] and h[4] == -h[5] and h[6] == -h[7]
    if not consistent:
        _raise_mismatch(reduced, text, int(h[8]), group, direction, device)
    if not fits:
        # Every rank has the same, larger list (first step, recipe switch): grow, then reduce.
        with _capacity_lock:
            _capacity[group] = n
        buf = torch.cat(rows or [g.amax_history[0] for g in reduced])  # (n,)
        dist.all_reduce(buf, op=dist.ReduceOp.MAX, group=group)  # (n,) -> max over the ranks
    offset = 0
    for g in reduced:
        width = g.amax_history.shape[1]
        g.amax_history[0].copy_(buf[offset : offset + width])
        offset += width


def _default_device(group: Any) -> torch.device:
    # a rank with nothing to reduce still joins; its buffer must live where NCCL can move it
    if "nccl" in dist.get_backend(group) and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _raise_mismatch(
    reduced: list[DelayedGroup],
    text: str,
    max_len: int,
    group: Any,
    direction: Direction,
    device: torch.device,
) -> None:
    """Every rank got an inconsistent header: exchange the module lists (each rank fills its own
    row, MAX gathers them), discard the step's amaxes and raise the same description everywhere."""
    size, rank = dist.get_world_size(group), dist.get_rank(group)
    table = torch.zeros(size, max_len, dtype=torch.float32, device=device)
    mine = torch.tensor(list(text.encode()), dtype=torch.float32, device=device)
    table[rank, : mine.numel()] = mine
    dist.all_reduce(table, op=dist.ReduceOp.MAX, group=group)  # (ranks, bytes) -> every rank's list
    lists = [bytes(int(b) for b in row if b > 0).decode() for row in table.tolist()]
    discard_step(reduced)
    raise AmaxReductionMismatch(_describe(lists, direction, rank))


def _describe(lists: list[str], direction: Direction, rank: int) -> str:
    ran: dict[str, dict[int, int]] = {}  # module -> {rank: slots}
    directions = {}
    for r, text in enumerate(lists):
        head, *lines = text.split("\n")
        directions[r] = head
        for line in lines:
            if line:
                name, n = line.rsplit("\t", 1)
                ran.setdefault(name, {})[r] = int(n)
    everyone = set(range(len(lists)))
    problems = []
    if len(set(directions.values())) > 1:
        problems.append(
            "the ranks are not in the same pass: "
            + ", ".join(f"rank {r}: {d}" for r, d in sorted(directions.items()))
        )
    for name, per_rank in sorted(ran.items()):
        missing = sorted(everyone - per_rank.keys())
        if missing:
            problems.append(
                f"module {name!r} ran on ranks {sorted(per_rank)} but not on ranks {missing}"
            )
        elif len(set(per_rank.values())) > 1:
            problems.append(f"module {name!r} has different delayed-scaling slot counts {per_rank}")
    if not problems:
        problems.append("the module lists agree but the buffers do not (same names twice?)")
    return (
        f"amax reduction ({direction}) on rank {rank} of {len(lists)}: the ranks of the "
        f"amax-reduction group ran different dist-quant modules in this step, so their amax "
        f"buffers do not line up: " + "; ".join(problems) + ". Every module with delayed scaling "
        "must run on every rank of the group in each step (or use reduce_amax=False for it)."
    )


# ---- the backward region -------------------------------------------------------------------------
class _BackwardRegion:
    """Delayed-scaling groups whose backward ran in the current autograd pass; reduced once, by a
    callback the autograd engine runs after the last module's backward."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.groups: dict[int, DelayedGroup] = {}
        self.reduction_group: Any = None
        self.queued_task: int | None = None  # the autograd pass whose callback is queued

    def enrol(self, groups: Sequence[DelayedGroup], reduction_group: Any) -> None:
        task = torch._C._current_graph_task_id()
        with self.lock:
            if self.queued_task is not None and self.queued_task != task:
                # the pass that queued the callback raised before its end (the engine drops the
                # callbacks of a failed pass); its amaxes already share row 0 with this pass's, so
                # they count toward this pass's update, which is queued anew
                self.queued_task = None
            for g in groups:
                self.groups.setdefault(id(g.amax_history), g)
            if self.queued_task is None:
                self.reduction_group = reduction_group
                self.queued_task = task
                torch.autograd.Variable._execution_engine.queue_callback(self.finish)

    def finish(self) -> None:
        with self.lock:
            groups, group = list(self.groups.values()), self.reduction_group
            self.groups, self.reduction_group, self.queued_task = {}, None, None
        reduce_and_update(groups, group, direction=Direction.BACKWARD)


_backward_region = _BackwardRegion()


def enrol_backward(groups: Sequence[DelayedGroup], reduction_group: Any) -> None:
    """Called from a module's backward: reduce and update these groups once the whole pass ends."""
    if groups:
        _backward_region.enrol(groups, reduction_group)


def discard_step(groups: Sequence[DelayedGroup]) -> None:
    """Forget the amaxes recorded in a step that failed, leaving scales and past history as they were."""
    for g in groups:
        g.amax_history[0].zero_()
