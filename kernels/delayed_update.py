"""Delayed-scaling update: every slot of a model in one launch (the Triton kernel, its launcher
with cached plans) and the op ``delayed_scaling_update_groups`` (``_op.py``).

Matches ``reference.delayed_scaling_update`` bit for bit, for a list of groups
``(amax_history (L_i, n_i), scale (n_i,), fp8_max (n_i,) | (1,) | float, margin_i, algo_i)``,
each updated in place (views into ``scale`` and ``history[0]`` stay valid).

Packing: the tensors stay where their owners put them. The launcher builds one int64 table with a
row per program (a group and a chunk of up to BN of its slots): the element offsets of the group's
history, scale and fp8_max relative to one base tensor (all are fp32 on one device), their strides,
``L``, ``n``, the chunk's first slot, ``algo`` and the fp32 bits of ``2**margin``. The table and
launch configuration are cached per list of tensor objects (by identity, checked against their
storage pointers on every hit) and margins and algorithms: a training step that updates the same
buffers every time validates them and copies one small table to the device only on its first step,
then pays a dict lookup and the launch.

Each program reads its columns' whole history in chunks of R rows, shifting each chunk up one row
in place. A CTA barrier sits between a chunk's loads and its stores: the thread that stores row
``i`` is not the one that loaded it.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

import torch
from dist_quant.kernels import reference
from dist_quant.kernels._fp8_round import f32_bits, is_finite, is_inf, next_pow2
from dist_quant.kernels._launch import FastLaunch, LaunchConfig, PreparedLaunch, launch_config
from dist_quant.kernels._op import register_op
from dist_quant.kernels._triton import tl, triton
from dist_quant.kernels.kinds_base import AmaxAlgo, spellings
from torch import Tensor

_FIELDS = 14  # int64 table columns, in the order the kernel reads them


@triton.jit
def _delayed_update_kernel(
    base_ptr,  # fp32; every offset in the table is relative to it
    table_ptr,  # int64 (programs, FIELDS)
    FIELDS: tl.constexpr,
    BN: tl.constexpr,
    R: tl.constexpr,
):
    row = table_ptr + tl.program_id(0) * FIELDS
    hist = base_ptr + tl.load(row + 0)
    h_s0 = tl.load(row + 1)
    h_s1 = tl.load(row + 2)
    scale = base_ptr + tl.load(row + 3)
    s_s = tl.load(row + 4)
    limit_p = base_ptr + tl.load(row + 5)
    l_s = tl.load(row + 6)
    L = tl.load(row + 7)
    n = tl.load(row + 8)
    col0 = tl.load(row + 9)
    algo = tl.load(row + 10)
    divisor = tl.load(row + 11).to(tl.int32).to(tl.float32, bitcast=True)
    limit_in_memory = tl.load(row + 12) == 0
    limit_value = tl.load(row + 13).to(tl.int32).to(tl.float32, bitcast=True)
    cols = col0 + tl.arange(0, BN)
    cmask = cols < n
    newest = tl.load(hist + cols * h_s1, mask=cmask, other=0.0)  # row 0
    # history.max(0) with NaN propagation: a NaN-free max plus a NaN flag (tl.reduce with a
    # NaN-aware combine function is orders of magnitude slower in the interpreter).
    running = tl.where(newest != newest, float("-inf"), newest)
    any_nan = newest != newest
    for start in range(0, L - 1, R):
        src = start + 1 + tl.arange(0, R)  # rows 1..L-1 move up to rows 0..L-2
        m = (src < L)[:, None] & cmask[None, :]
        v = tl.load(hist + src[:, None] * h_s0 + cols[None, :] * h_s1, mask=m, other=float("-inf"))
        running = tl.maximum(running, tl.max(tl.where(v != v, float("-inf"), v), axis=0))
        any_nan = any_nan | (tl.max((v != v).to(tl.int32), axis=0) > 0)
        tl.debug_barrier()  # all loads of this chunk land before any thread overwrites a row
        dst = src - 1
        v = tl.where((dst == 0)[:, None], 0.0, v)  # row 0 restarts the accumulation at 0
        tl.store(hist + dst[:, None] * h_s0 + cols[None, :] * h_s1, v, mask=m)
    # Row L-1 takes the old row 0 (the roll); with L == 1 it is row 0 itself, which restarts at 0.
    tl.store(hist + (L - 1) * h_s0 + cols * h_s1, tl.where(L > 1, newest, 0.0), mask=cmask)
    a = tl.where(algo == 0, tl.where(any_nan, float("nan"), running), newest)
    # An inline fp8_max has offset 0 and stride 0: the load reads base[0], then is discarded.
    limit = tl.load(limit_p + cols * l_s, mask=cmask, other=1.0)
    limit = tl.where(limit_in_memory, limit, limit_value)
    new = tl.math.div_rn(tl.math.div_rn(limit, a), tl.zeros_like(a) + divisor)
    new = tl.where(is_inf(new), 3.4028234663852886e38, new)
    old = tl.load(scale + cols * s_s, mask=cmask, other=1.0)
    keep = (is_finite(a) == 0) | (a <= 0.0)
    tl.store(scale + cols * s_s, tl.where(keep, old, new), mask=cmask)


def _check_group(i: int, group: Sequence) -> tuple:
    where = f"kernels.delayed_update.delayed_scaling_update: group {i}"
    if len(group) != 5:
        raise ValueError(f"{where}: expected (amax_history, scale, fp8_max, margin, algo)")
    history, scale, limit, margin, algo = group
    n = reference.check_delayed(where, history, scale, margin, algo)
    if history.device != scale.device:
        raise ValueError(f"{where}: amax_history and scale must share a device")
    if isinstance(limit, (int, float)):
        return history, scale, float(limit), float(margin), algo  # goes into the table
    limit = torch.as_tensor(limit, dtype=torch.float32, device=scale.device)
    if limit.numel() not in (1, n):
        raise ValueError(
            f"{where}: fp8_max must hold 1 or {n} values, got shape {tuple(limit.shape)}"
        )
    return history, scale, limit.reshape(-1), float(margin), algo


def _table(groups: list[tuple], base: torch.Tensor, bn: int) -> torch.Tensor:
    """The int64 program table (see module docstring), on ``base``'s device."""
    base_ptr = base.data_ptr()

    def offset(t: torch.Tensor) -> int:
        delta = t.data_ptr() - base_ptr
        if delta % 4:
            raise ValueError(
                "kernels.delayed_update: every tensor must be 4-byte aligned relative to the "
                "first amax_history"
            )
        return delta // 4

    rows = []
    for history, scale, limit, margin, algo in groups:
        L, n = history.shape
        divisor = f32_bits(2.0**margin)  # the reference's torch.tensor(2.0**margin, fp32)
        if isinstance(limit, torch.Tensor):
            l_off, l_stride = offset(limit), (limit.stride(0) if limit.numel() > 1 else 0)
            inline, l_bits = 0, 0
        else:
            l_off, l_stride, inline, l_bits = 0, 0, 1, f32_bits(limit)
        for col0 in range(0, n, bn):
            rows.append(
                [offset(history), history.stride(0), history.stride(1), offset(scale),
                 scale.stride(0), l_off, l_stride, L, n, col0, AmaxAlgo(algo).code, divisor, inline,
                 l_bits]
            )  # fmt: skip
    host = torch.tensor(rows, dtype=torch.int64)
    if base.is_cuda:
        host = host.pin_memory()
    return host.to(base.device, non_blocking=True)


class _Plan:
    """A validated list of groups with its program table and launch configuration.

    It holds the caller's objects, so while it is cached no other object can take their ids (the
    cache key), and the tensors the table points into (a converted fp8_max among them). Identity
    alone does not pin the memory (``t.data = ...`` and ``set_`` swap a tensor's storage,
    ``resize_`` its shape), so a hit also compares each tensor's pointer, dtype, shape and strides.
    """

    def __init__(self, groups: Sequence[Sequence]) -> None:
        self.checked = [_check_group(i, g) for i, g in enumerate(groups)]
        self.objects = tuple(x for g in groups for x in g[:3])  # history, scale, fp8_max
        self.updated = tuple(x for g in groups for x in g[:2])  # history, scale
        self.tensors = tuple(x for x in self.objects if isinstance(x, torch.Tensor))
        self.layout = _layout(self.tensors)
        # A limit _check_group had to convert (another dtype or device) is a copy of its values
        # as of now: a plan that reads it must not be reused.
        self.reusable = all(
            not isinstance(limit, torch.Tensor)
            or (limit.dtype == torch.float32 and limit.device == scale.device)
            for _, scale, limit, _, _ in groups
        )
        checked = [g for g in self.checked if g[0].shape[1] > 0]
        self.config: LaunchConfig | None = None  # None: every group is empty, nothing to launch
        # the first GPU launch's compiled kernel, relaunched on the device it was loaded on
        self.prepared: tuple[PreparedLaunch, int] | None = None
        if not checked:
            return
        base = checked[0][0]
        for i, (history, _, _, _, _) in enumerate(checked):
            if history.device != base.device:
                raise ValueError(
                    f"kernels.delayed_update: group {i} is on {history.device}, group 0 on "
                    f"{base.device}; one launch needs one device"
                )
        max_n = max(g[0].shape[1] for g in checked)
        max_l = max(g[0].shape[0] for g in checked)
        bn = min(next_pow2(max_n), 128)
        # A chunk of R rows x BN slots: ~4K elements per step keeps registers modest; a 1024-long
        # history of a few slots is then one or two chunks.
        r = max(1, min(next_pow2(max(max_l - 1, 1)), 4096 // bn))
        table = _table(checked, base, bn)
        self.grid = (table.shape[0],)
        self.args = (base, table)
        self.interpreted = not base.is_cuda
        self.config = launch_config((("FIELDS", _FIELDS), ("BN", bn), ("R", r)))

    def is_current(self) -> bool:
        """Every tensor still has the memory and layout the table was built for."""
        return _layout(self.tensors) == self.layout

    def launch(self) -> None:
        if self.config is None:
            return
        # The kernel writes through raw pointers, which autograd does not see: a graph that saved
        # a scale or history for its backward (a compiled recompute) must fail its version check
        # instead of reading the updated values.
        torch.autograd.graph.increment_version(self.updated)
        if self.prepared is not None:
            prepared, device = self.prepared
            if torch._C._cuda_getDevice() == device:
                prepared.launch(torch._C._cuda_getCurrentRawStream(device))
                return
        _launch_update(self.grid, self.args, self.config, interpreted=self.interpreted)
        if not self.interpreted and self.prepared is None:
            # every argument is the plan's own (the base pointer and the table): all fixed
            prepared = _launch_update.prepare(self.grid, self.args, self.config, len(self.args))
            if prepared is not None:
                self.prepared = (prepared, torch._C._cuda_getDevice())


def _layout(tensors: Sequence[torch.Tensor]) -> list[tuple]:
    return [(t.data_ptr(), t.dtype, t.shape, t.stride()) for t in tensors]


def _identity_key(groups: Sequence[Sequence]) -> tuple | None:
    """The caller's history, scale and fp8_max objects by id, margin and algo by value; None when
    a group is malformed (the plan then validates it and raises)."""
    key: list = []
    try:
        for history, scale, limit, margin, algo in groups:
            key += (id(history), id(scale), id(limit), margin, algo)
    except (TypeError, ValueError):
        return None
    return tuple(key)


_PLANS: OrderedDict[tuple, _Plan] = OrderedDict()  # least recently used first
_PLAN_CACHE_SIZE = 32


def delayed_scaling_update_groups_triton(groups: Sequence[Sequence]) -> None:
    """Update every group in place with one launch (groups with ``n == 0`` are skipped).

    A list of the same tensor objects, with the same storage, margins and algorithms, as one of
    the last 32 lists costs a dict lookup and the launch: validation, the table and its copy to
    the device happen once per list.
    """
    key = _identity_key(groups)
    # popped and put back last (most recently used): no step can fail halfway if another thread
    # (the autograd engine's, running the backward update) touches the cache in between
    plan = _PLANS.pop(key, None) if key is not None else None
    if plan is None or not plan.is_current():
        plan = _Plan(groups)
    if key is not None and plan.reusable:
        _PLANS[key] = plan
        if len(_PLANS) > _PLAN_CACHE_SIZE:
            _PLANS.popitem(last=False)
    plan.launch()


_launch_update = FastLaunch(_delayed_update_kernel)


def delayed_scaling_update_triton(
    amax_history: torch.Tensor,
    scale: torch.Tensor,
    fp8_max_per_slot: torch.Tensor | float,
    *,
    margin: float,
    algo: AmaxAlgo | str,
) -> None:
    """``reference.delayed_scaling_update`` for one group (one launch)."""
    delayed_scaling_update_groups_triton([(amax_history, scale, fp8_max_per_slot, margin, algo)])


# ---- the op: reference call, fake, registration ------------------------------------------------
# The op takes the groups as five lists (a schema has no list of tuples) and the algorithms as
# integer codes (``AmaxAlgo.code``: a schema has no list of strings).
def _update_ref(
    histories: list[Tensor],
    scales: list[Tensor],
    fp8_maxes: list[Tensor],
    margins: list[float],
    algos: list[int],
) -> None:
    for history, scale, limit, margin, code in zip(histories, scales, fp8_maxes, margins, algos):
        reference.delayed_scaling_update(
            history, scale, limit, margin=margin, algo=AmaxAlgo.of_code(code)
        )


def _update_cuda(
    histories: list[Tensor],
    scales: list[Tensor],
    fp8_maxes: list[Tensor],
    margins: list[float],
    algos: list[int],
) -> None:
    delayed_scaling_update_groups_triton(
        [
            (h, s, limit, margin, AmaxAlgo.of_code(code))
            for h, s, limit, margin, code in zip(histories, scales, fp8_maxes, margins, algos)
        ]
    )


def _update_fake(*args: object) -> None:
    """Tracing sees only the declared writes: the op returns nothing."""
    return None


def _op_args(groups: Sequence[Sequence]) -> tuple[list, list, list, list, list]:
    """The op's five lists from ``(amax_history, scale, fp8_max, margin, algo)`` groups."""
    for i, g in enumerate(groups):
        if len(g) != 5 or g[4] not in tuple(AmaxAlgo):
            raise ValueError(
                f"delayed_scaling_update: group {i}: expected (amax_history, scale, fp8_max, "
                f"margin, algo) with algo {spellings(AmaxAlgo)}, got {g!r}"
            )
    limits = [
        g[2] if isinstance(g[2], Tensor) else torch.tensor(float(g[2]), device=g[0].device)
        for g in groups
    ]
    return (
        [g[0] for g in groups],
        [g[1] for g in groups],
        [limit.float() for limit in limits],
        [float(g[3]) for g in groups],
        [AmaxAlgo(g[4]).code for g in groups],
    )


# Eager CUDA calls take the groups as they are to the launcher, whose plan for a list of buffers
# costs a dict lookup and one launch of host time; its plans also keep it opaque under compile.
_update = register_op(
    "delayed_scaling_update_groups", ("histories", "scales"), _update_ref, _update_cuda,
    _update_fake, traceable=False, eager_cuda=delayed_scaling_update_groups_triton,
    to_op=_op_args,
)  # fmt: skip


# ---- public functions ----------------------------------------------------------------------------
def delayed_scaling_update_groups(groups: Sequence[Sequence]) -> None:
    """Every ``(amax_history, scale, fp8_max, margin, algo)`` group in place
    (``reference.delayed_scaling_update`` of each): one op call, one launch on CUDA."""
    if not groups:
        return
    if len(groups[0]) != 5 or not isinstance(groups[0][0], Tensor):
        raise ValueError(
            "delayed_scaling_update: group 0: expected (amax_history, scale, fp8_max, margin, "
            f"algo), got {groups[0]!r}"
        )
    _update(groups)


def delayed_scaling_update(
    amax_history: Tensor,
    scale: Tensor,
    fp8_max_per_slot: Tensor | float,
    *,
    margin: float,
    algo: AmaxAlgo | str,
) -> None:
    """``reference.delayed_scaling_update`` as a one-group ``delayed_scaling_update_groups``."""
    delayed_scaling_update_groups([(amax_history, scale, fp8_max_per_slot, margin, algo)])
