"""FP8 telemetry per quantized slot: amax, scale, saturated and underflowed fractions.

    telemetry = Telemetry(model, stats_interval=100)        # every rank of `group`
    for step in range(steps):
        telemetry.begin_step(step)      # before the forward: a stats step every 100 steps
        ...                             # forward, backward, optimizer step
        record = telemetry.end_step()   # after the backward: reduced over the group, or None

Under the coordinator, `attach(model, stats_interval=N)` does both calls inside
`participant.step_boundary` / `participant.observe`.

Design: counting is a separate kernel (`kernels/fp8_stats.py`, exact against
`kernels/reference.cast_stats`) launched by a cast observer that exists only between
`begin_step` and `end_step` of a stats step. The cast kernels are not touched, so a step without
telemetry runs exactly the code it ran before (one empty-tuple test per cast) and stats steps pay
one extra read of each quantized tensor (bench/bench_stats.py measures it). Per-tensor recipes
(delayed, current) are counted against the scale the cast used; MXFP8 and float8 block slots use
a scale per block that the cast computes internally, so they are not counted: the first stats
step warns once naming those slots.

A slot is (role name, tensor type, direction), as the runtime names it (`runtime.stats_slot`):
the role's name is the module a fallback factory targets (`layers.0.mlp.fc2` inside a
LayerNormMLP), falling back to the owning module's name for slots without a role.
Everything a stats step saw is summed per slot over its casts (microbatches, the TP copies of a
quantizer), then over the ranks of `group` (default: the whole job) with ONE all-gather of a
float64 buffer: counts are summed (exact below 2**53), amax is the max (NaN propagating), scale
the smallest scale any cast used. Every rank gets the same record; global rank 0 appends it to
`<run_dir>/fp8_stats.jsonl`. Ranks of `group` must hold the same dist-quant modules (TP ranks
do); a header in the buffer makes a mismatch raise ValueError on every rank. Under activation
checkpointing a recomputed forward is counted again.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import time
import warnings
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from dist_quant import quantizers as _quantizers
from dist_quant.jsonl import read_jsonl
from dist_quant.kernels.fp8_stats import cast_stats
from dist_quant.kinds import Direction
from dist_quant.runtime import dist_quant_modules, stats_slot

STATS_FILE = "fp8_stats.jsonl"
_FIELDS = 6  # per slot in the gathered buffer: numel, saturated, underflowed, nonzero, amax, scale
_HEADER = 3  # slot count and two 24-bit halves of a hash of the slot list


@dataclass(frozen=True)
class SlotStats:
    """One slot over one stats step, reduced over the group."""

    module: str
    tensor_type: str
    direction: str  # "forward" | "backward"
    numel: int  # elements cast (all casts, all ranks)
    saturated: int
    underflowed: int
    nonzero: int
    amax: float
    scale: float  # the smallest scale a cast of this slot used

    @property
    def saturated_fraction(self) -> float:
        return self.saturated / self.numel if self.numel else 0.0

    @property
    def underflow_fraction(self) -> float:
        return self.underflowed / self.nonzero if self.nonzero else 0.0

    def to_dict(self) -> dict[str, Any]:
        return {
            **asdict(self),
            "saturated_fraction": self.saturated_fraction,
            "underflow_fraction": self.underflow_fraction,
        }


@dataclass(frozen=True)
class StatsRecord:
    """Every counted slot of one stats step."""

    step: int
    slots: tuple[SlotStats, ...]

    def to_dict(self) -> dict[str, Any]:
        return {"step": self.step, "slots": [s.to_dict() for s in self.slots]}


def read_stats(run_dir: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """The records of `<run_dir>/fp8_stats.jsonl` (a torn last line is skipped)."""
    path = Path(run_dir) / STATS_FILE
    if not path.is_file():
        return []
    return read_jsonl(path)


class Telemetry:
    """Counts every per-tensor cast of `model`'s slots on every `stats_interval`-th step."""

    def __init__(
        self,
        model: nn.Module,
        *,
        stats_interval: int = 0,
        group: Any = None,
        run_dir: str | os.PathLike[str] | None = None,
    ) -> None:
        if (
            not isinstance(stats_interval, int)
            or isinstance(stats_interval, bool)
            or stats_interval < 0
        ):
            raise ValueError(
                f"Telemetry: stats_interval must be an int >= 0 (0 = off), got {stats_interval!r}"
            )
        self.model = model
        self.stats_interval = stats_interval
        self.group = group
        chosen = run_dir or os.environ.get("DIST_QUANT_RUN_DIR") or "dist_quant_run"
        self.path = Path(chosen).absolute() / STATS_FILE
        self.last: StatsRecord | None = None
        self._step: int | None = None
        self._acc: dict[tuple[str, str, str], list[tuple[Any, torch.Tensor, int]]] = {}
        self._uncounted: set[tuple[str, str, str]] = set()
        self._warned: set[tuple[str, str, str]] = set()
        self._observer = self._observe  # one bound method, so that removing it finds it

    def is_stats_step(self, step: int) -> bool:
        return self.stats_interval > 0 and step % self.stats_interval == 0

    def begin_step(self, step: int) -> None:
        """Before the forward of `step`: on a stats step, start counting every cast."""
        if self._step is not None:
            raise RuntimeError(
                f"Telemetry: begin_step({step}) while stats step {self._step} is open; "
                "call end_step() after each step's backward"
            )
        if self.is_stats_step(step):
            self._step = step
            self._acc = {}
            _quantizers.add_cast_observer(self._observer)

    def end_step(self) -> StatsRecord | None:
        """After the backward: on a stats step, the record reduced over the group (a collective
        on every rank of the group); else None and nothing is done."""
        if self._step is None:
            return None
        _quantizers.remove_cast_observer(self._observer)
        step, self._step = self._step, None
        self._warn_uncounted()
        slots = self._slot_keys()
        gathered = self._gather(self._pack(slots), slots)
        record = StatsRecord(step, _reduce(slots, gathered))
        self.last = record
        if _global_rank() == 0:
            self._write(record)
        return record

    def _write(self, record: StatsRecord) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.path, "a", encoding="utf-8") as f:
            f.write(json.dumps({**record.to_dict(), "time": time.time()}) + "\n")

    def close(self) -> None:
        """Stop counting without reducing (an open stats step is dropped)."""
        if self._step is not None:
            _quantizers.remove_cast_observer(self._observer)
            self._step = None

    # -- during a stats step ---------------------------------------------------------------------

    def _observe(self, q: Any, x: torch.Tensor, scale: torch.Tensor | None) -> None:
        slot = q.stats_slot
        if slot is None:
            return
        if scale is None:
            self._uncounted.add(slot)
            return
        with torch.no_grad():
            stats = cast_stats(x, scale, q.fp8_dtype)
            # a copy: a delayed scale is updated in place at the end of the step
            scale_now = scale.detach().reshape(1).clone()
            self._acc.setdefault(slot, []).append((stats, scale_now, x.numel()))

    def _warn_uncounted(self) -> None:
        new = sorted(self._uncounted - self._warned)
        if new:
            self._warned.update(new)
            names = ", ".join("/".join(s) for s in new)
            warnings.warn(
                f"Telemetry: slots with per-block scales (MXFP8, float8 block scaling, NVFP4) are not "
                f"counted, only per-tensor (delayed, current) ones: {names}",
                stacklevel=3,
            )
        self._uncounted = set()

    # -- reduction -------------------------------------------------------------------------------

    def _slot_keys(self) -> list[tuple[str, str, str]]:
        """Every slot the model's structure defines, in one order on every rank."""
        keys = []
        for m in dist_quant_modules(self.model):
            name = m.role_name or type(m).__name__
            for direction in Direction:
                fwd = direction.fwd
                roles = m.get_quantizer_roles(fwd=fwd, num_quantizers=m.num_quantizers(fwd=fwd))
                keys.extend(
                    stats_slot(name, role, i, direction.value) for i, role in enumerate(roles)
                )
        return sorted(set(keys))

    def _device(self) -> torch.device:
        for p in self.model.parameters():
            return p.device
        return torch.device("cpu")

    def _pack(self, slots: list[tuple[str, str, str]]) -> torch.Tensor:
        """(header + slots * 6,) float64 on the model's device: this rank's sums per slot."""
        dev = self._device()
        digest = hashlib.sha256(repr(slots).encode()).digest()
        sig_a = int.from_bytes(digest[:3], "big")
        sig_b = int.from_bytes(digest[3:6], "big")
        rows = []
        for slot in slots:
            entries = self._acc.get(slot)
            if not entries:
                rows.append(
                    torch.tensor([0, 0, 0, 0, 0, math.inf], dtype=torch.float64, device=dev)
                )
                continue
            counts = torch.stack(
                [torch.stack([s.saturated, s.underflowed, s.nonzero]) for s, _, _ in entries]
            ).sum(0)  # int64, exact
            numel = float(sum(n for _, _, n in entries))
            amax = torch.stack([s.amax for s, _, _ in entries]).amax()  # NaN propagates
            scale = torch.cat([sc for _, sc, _ in entries]).amin()
            rows.append(
                torch.cat(
                    [
                        torch.tensor([numel], dtype=torch.float64, device=dev),
                        counts.to(torch.float64),
                        amax.reshape(1).to(torch.float64),
                        scale.reshape(1).to(torch.float64),
                    ]
                )
            )
        header = torch.tensor([len(slots), sig_a, sig_b], dtype=torch.float64, device=dev)
        return torch.cat([header, *rows]) if rows else header

    def _gather(self, buf: torch.Tensor, slots: list) -> torch.Tensor:
        """(ranks, len) on the host. The one collective of a stats step."""
        if not (dist.is_available() and dist.is_initialized()):
            return buf.reshape(1, -1).cpu()
        world = dist.get_world_size(self.group)
        parts = [torch.empty_like(buf) for _ in range(world)]
        dist.all_gather(parts, buf, group=self.group)  # each rank's sums -> every rank's
        table = torch.stack(parts).cpu()
        headers = table[:, :_HEADER]
        if not bool((headers == headers[:1]).all()):
            bad = [r for r in range(world) if not torch.equal(headers[r], headers[0])]
            raise ValueError(
                f"Telemetry: ranks {bad} of the group hold other dist-quant slots than group "
                f"rank 0 ({len(slots)} slots here); every rank of the telemetry group must run "
                "the same modules"
            )
        return table


def _reduce(slots: list[tuple[str, str, str]], table: torch.Tensor) -> tuple[SlotStats, ...]:
    out = []
    body = table[:, _HEADER:].reshape(table.shape[0], len(slots), _FIELDS)
    sums = body[:, :, :4].sum(0)
    amax = body[:, :, 4].amax(0)  # NaN propagates
    scale = body[:, :, 5].amin(0)
    for i, (module, tensor_type, direction) in enumerate(slots):
        numel, sat, under, nonzero = (int(v) for v in sums[i].tolist())
        if numel == 0:
            continue  # not quantized per tensor on any rank this step
        out.append(
            SlotStats(
                module,
                tensor_type,
                direction,
                numel,
                sat,
                under,
                nonzero,
                float(amax[i]),
                float(scale[i]),
            )  # fmt: skip
        )
    return tuple(out)


def _global_rank() -> int:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank()
    return 0
