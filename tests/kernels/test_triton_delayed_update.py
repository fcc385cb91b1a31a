"""Triton one-launch delayed-scaling update against ``reference.delayed_scaling_update``.

Several groups of different history lengths, widths, margins and algorithms are updated in one
launch over three steps (the quantizers' row-0 writes in between), and each must end bit-equal to
the reference applied group by group, in place: views into ``scale`` and ``history[0]`` taken before
the update see the new values.
"""

import gc
import weakref

import pytest
import torch
from dist_quant.kernels import delayed_scaling_update_groups
from dist_quant.kernels import reference as ref
from dist_quant.kernels.delayed_update import (
    delayed_scaling_update_groups_triton,
    delayed_scaling_update_triton,
)
from triton_cases import DEVICE, assert_bitwise_equal

FLT_MAX = torch.finfo(torch.float32).max


def _history(L, n, seed):
    g = torch.Generator().manual_seed(seed)
    h = torch.rand(L, n, generator=g) * torch.exp2(torch.randint(-20, 21, (L, n), generator=g))
    return h.float()


def _edge_history():
    """(3, 8): columns whose max is 0, NaN (old row), inf (row 0), negative, tiny (scale -> inf
    -> FLT_MAX), an fp32 subnormal, an ordinary value, and -inf next to a positive value."""
    h = torch.tensor(
        [
            [0.0, 1.0, float("inf"), -1.0, 1e-40, 1e-45, 3.0, -float("inf")],
            [0.0, float("nan"), 2.0, -2.0, 1e-41, 0.0, 5.0, 2.0],
            [0.0, 3.0, 1.0, -0.5, 0.0, 1e-45, 1.0, -float("inf")],
        ]
    )
    return h


def _groups(device):
    """(history, scale, fp8_max, margin, algo) groups; fresh tensors on ``device``."""
    big = _history(6, 10, seed=44).to(device)
    groups = [
        (_history(1, 3, seed=40), 448.0, 0, "max"),  # L == 1: no roll, row 0 just restarts
        (_history(5, 4, seed=41), torch.full((4,), 57344.0), 1, "most_recent"),
        (_history(300, 3, seed=42), torch.tensor([448.0, 57344.0, 448.0]), 2.5, "max"),
        (_history(17, 200, seed=43), torch.tensor([448.0]), 0, "max"),  # several programs
        (_edge_history(), 448.0, 0, "max"),
        (_edge_history(), 448.0, 3, "most_recent"),
    ]
    out = []
    for i, (h, limit, margin, algo) in enumerate(groups):
        g = torch.Generator().manual_seed(100 + i)
        scale = (torch.rand(h.shape[1], generator=g) + 0.5).to(device)
        if isinstance(limit, torch.Tensor):
            limit = limit.to(device)
        out.append((h.to(device), scale, limit, margin, algo))
    # A strided view: every other column of a wider buffer, and a strided scale.
    scale_base = torch.rand(10, generator=torch.Generator().manual_seed(99)).to(device)
    out.append((big[:, ::2], scale_base[::2], torch.tensor([448.0], device=device), 1, "max"))
    return out


def _copy(t):
    """A separate contiguous CPU copy (``.cpu()`` alone aliases a CPU tensor)."""
    return t.cpu().clone(memory_format=torch.contiguous_format)


def _cpu(limit):
    return limit.cpu() if isinstance(limit, torch.Tensor) else limit


def test_one_launch_for_all_groups_matches_reference_over_three_steps():
    groups = _groups(DEVICE)
    expected = [(_copy(h), _copy(s), _cpu(lim), m, a) for h, s, lim, m, a in groups]
    row0_views = [h[0] for h, *_ in groups]
    scale_views = [s[:] for _, s, *_ in groups]
    g = torch.Generator().manual_seed(7)
    for step in range(3):
        delayed_scaling_update_groups_triton(groups)
        for h, s, lim, margin, algo in expected:
            ref.delayed_scaling_update(h, s, lim, margin=margin, algo=algo)
        # In place: the caller's own tensors (strided views too) hold the result; compare values.
        for i, ((h, s, *_), (eh, es, *_)) in enumerate(zip(groups, expected)):
            assert_bitwise_equal(h.contiguous(), eh, f"step {step} group {i} history")
            assert_bitwise_equal(s.contiguous(), es, f"step {step} group {i} scale")
            assert_bitwise_equal(row0_views[i].contiguous(), eh[0], "row-0 view")
            assert_bitwise_equal(scale_views[i].contiguous(), es, "scale view")
        for (h, *_), (eh, *_) in zip(groups, expected):  # quantizers write this step's amax
            fresh = torch.rand(h.shape[1], generator=g) * 100
            h[0].copy_(fresh)
            eh[0].copy_(fresh)


@pytest.mark.parametrize("algo", ["max", "most_recent"])
def test_single_group_launcher_matches_reference_on_edge_columns(algo):
    h, s = _edge_history(), torch.arange(1.0, 9.0)
    got_h, got_s = h.to(DEVICE, copy=True), s.to(DEVICE, copy=True)
    delayed_scaling_update_triton(got_h, got_s, 448.0, margin=0, algo=algo)
    ref.delayed_scaling_update(h, s, 448.0, margin=0, algo=algo)
    assert_bitwise_equal(got_h, h, "history")
    assert_bitwise_equal(got_s, s, "scale")
    if algo == "max":  # pin the edge semantics themselves, not only agreement
        assert got_s[0].item() == 1.0 and got_s[1].item() == 2.0 and got_s[3].item() == 4.0
        assert got_s[4].item() == FLT_MAX


def test_dispatcher_on_cpu_updates_each_group_like_the_reference():
    groups = _groups("cpu")
    expected = [(_copy(h), _copy(s), lim, m, a) for h, s, lim, m, a in groups]
    delayed_scaling_update_groups(groups)
    for h, s, lim, margin, algo in expected:
        ref.delayed_scaling_update(h, s, lim, margin=margin, algo=algo)
    for (h, s, *_), (eh, es, *_) in zip(groups, expected):
        assert_bitwise_equal(h.contiguous(), eh, "history")
        assert_bitwise_equal(s.contiguous(), es, "scale")


def test_bad_groups_raise_value_errors_naming_the_group():
    h = torch.zeros(4, 3, device=DEVICE)
    s = torch.ones(3, device=DEVICE)
    with pytest.raises(ValueError, match="group 1: algo must be 'max' or 'most_recent'"):
        delayed_scaling_update_groups_triton([(h, s, 448.0, 0, "max"), (h, s, 448.0, 0, "avg")])
    with pytest.raises(ValueError, match="group 0: scale must have shape \\(3,\\)"):
        delayed_scaling_update_groups_triton([(h, torch.ones(2, device=DEVICE), 448.0, 0, "max")])
    with pytest.raises(ValueError, match="group 0: amax_history must be float32"):
        delayed_scaling_update_groups_triton([(h.double(), s, 448.0, 0, "max")])
    with pytest.raises(ValueError, match="group 0: fp8_max must hold 1 or 3 values"):
        delayed_scaling_update_groups_triton([(h, s, torch.ones(2, device=DEVICE), 0, "max")])
    with pytest.raises(ValueError, match="group 0: margin must be a number >= 0"):
        delayed_scaling_update_groups_triton([(h, s, 448.0, -1, "max")])


# A training step passes the same list of buffers every time: the launcher validates and tables a
# list once and then only launches. These pin that a reused table never writes the wrong memory.
ENTRY_POINTS = {
    "launcher": delayed_scaling_update_groups_triton,
    "dispatcher": delayed_scaling_update_groups,  # CUDA: the launcher's cache; CPU: the reference
}


def _step_and_check(update, groups, expected, step, seed):
    """One update of ``groups`` and of their CPU copies ``expected`` by the reference, compared,
    then a fresh row 0 in both (the quantizers' amaxes of the next step)."""
    update(groups)
    for h, s, lim, margin, algo in expected:
        ref.delayed_scaling_update(h, s, lim, margin=margin, algo=algo)
    g = torch.Generator().manual_seed(seed)
    for i, ((h, s, *_), (eh, es, *_)) in enumerate(zip(groups, expected)):
        assert_bitwise_equal(h.contiguous(), eh, f"step {step} group {i} history")
        assert_bitwise_equal(s.contiguous(), es, f"step {step} group {i} scale")
        fresh = torch.rand(h.shape[1], generator=g) * 100
        h[0].copy_(fresh)
        eh[0].copy_(fresh)


def _expected(groups):
    return [(_copy(h), _copy(s), _cpu(lim), m, a) for h, s, lim, m, a in groups]


@pytest.mark.parametrize("entry", ENTRY_POINTS)
def test_a_repeated_list_follows_buffers_whose_storage_or_shape_changed(entry):
    update = ENTRY_POINTS[entry]
    groups = _groups(DEVICE)
    expected = _expected(groups)
    _step_and_check(update, groups, expected, step=0, seed=1)
    _step_and_check(update, groups, expected, step=1, seed=2)  # the cached table
    # Same tensor objects, new storage (a loader or the user swapping .data): the old memory must
    # not be written, the new one must be.
    h, s, limit, _, _ = groups[3]
    old_h, old_s = h.data, s.data
    old_h_bits, old_s_bits = _copy(old_h), _copy(old_s)
    h.data = h.data.clone() * 2
    s.set_(s.data.clone() + 1)
    limit.data = torch.full_like(limit, 57344.0)
    expected[3] = (_copy(h), _copy(s), _cpu(limit), *expected[3][3:])
    for step in range(2, 4):
        _step_and_check(update, groups, expected, step=step, seed=step + 1)
    # Same object and storage, a shorter history (resize_ keeps the pointer).
    groups[1][0].resize_(3, groups[1][0].shape[1])
    expected[1] = (_copy(groups[1][0]), *expected[1][1:])
    for step in range(4, 6):
        _step_and_check(update, groups, expected, step=step, seed=step + 1)
    assert_bitwise_equal(old_h.contiguous(), old_h_bits, "old history storage untouched")
    assert_bitwise_equal(old_s.contiguous(), old_s_bits, "old scale storage untouched")


@pytest.mark.parametrize("entry", ENTRY_POINTS)
def test_lists_sharing_buffers_each_update_their_own_groups(entry):
    update = ENTRY_POINTS[entry]
    groups = _groups(DEVICE)
    expected = _expected(groups)
    h, s, limit, margin, algo = groups[2]
    eh, es, elimit, _, _ = expected[2]
    other_h = _history(*h.shape, seed=60).to(DEVICE)
    other_s = torch.rand(s.shape, generator=torch.Generator().manual_seed(61)).to(DEVICE) + 0.5
    lists = [  # (groups, their reference copies); shared buffers share their copies too
        ([groups[i] for i in (0, 1, 2)], [expected[i] for i in (0, 1, 2)]),
        ([groups[i] for i in (3, 4, 5, 6)], [expected[i] for i in (3, 4, 5, 6)]),
        ([groups[2], groups[3]], [expected[2], expected[3]]),  # one group of each list above
        ([groups[2]], [expected[2]]),
    ]
    # group 2 with one thing changed: each must be a list of its own (a recipe switch keeps the
    # history and changes the margin or algorithm; the rest pins the identity of every tensor)
    other_algo = "most_recent" if algo == "max" else "max"
    other_limit = torch.full_like(limit, 240.0)
    for variant, variant_expected in [
        ((h, s, limit, margin + 1, algo), (eh, es, elimit, margin + 1, algo)),
        ((h, s, limit, margin, other_algo), (eh, es, elimit, margin, other_algo)),
        ((other_h, s, limit, margin, algo), (_copy(other_h), es, elimit, margin, algo)),
        ((h, other_s, limit, margin, algo), (eh, _copy(other_s), elimit, margin, algo)),
        ((h, s, other_limit, margin, algo), (eh, es, _cpu(other_limit), margin, algo)),
    ]:
        lists.append(([variant], [variant_expected]))
    for step in range(2 * len(lists)):  # the second round takes every list's cached table
        chosen, chosen_expected = lists[step % len(lists)]
        _step_and_check(update, chosen, chosen_expected, step=step, seed=10 + step)
    # Groups outside the list just run must be as the reference left them.
    for i, ((got_h, got_s, *_), (want_h, want_s, *_)) in enumerate(zip(groups, expected)):
        assert_bitwise_equal(got_h.contiguous(), want_h, f"group {i} history at the end")
        assert_bitwise_equal(got_s.contiguous(), want_s, f"group {i} scale at the end")


@pytest.mark.parametrize("entry", ENTRY_POINTS)
def test_an_fp8_max_of_another_dtype_is_read_on_every_call(entry):
    # The launcher converts a float64 fp8_max to a float32 copy: a cached table must not keep
    # reading the copy after the caller changed the original.
    update = ENTRY_POINTS[entry]
    h, s = _history(4, 3, seed=50).to(DEVICE), torch.ones(3, device=DEVICE)
    limit = torch.full((3,), 448.0, dtype=torch.float64, device=DEVICE)
    groups = [(h, s, limit, 0, "max")]
    expected = _expected(groups)
    for step, value in enumerate([448.0, 448.0, 57344.0, 240.0]):
        limit.fill_(value)
        expected[0][2].fill_(value)
        _step_and_check(update, groups, expected, step=step, seed=20 + step)


def test_buffers_of_a_list_not_run_lately_are_released():
    # the table cache is bounded: a deleted module's buffers do not live on in it forever
    h, s = torch.zeros(2, 3, device=DEVICE), torch.ones(3, device=DEVICE)
    delayed_scaling_update_groups_triton([(h, s, 448.0, 0, "max")])
    released = weakref.ref(h)
    del h, s
    for _ in range(100):  # other lists, as other models would run
        delayed_scaling_update_groups_triton(
            [(torch.zeros(2, 3, device=DEVICE), torch.ones(3, device=DEVICE), 448.0, 0, "max")]
        )
    gc.collect()
    assert released() is None
