"""amax.py on one process: the update runs once per buffer, and the mismatch description.

The multi-rank behaviour (one all-reduce per direction, the guard raising on every rank) is tested
with real process groups in tests/distributed/test_amax_reduction.py.
"""

import pytest
import torch

import dist_quant as dq
from dist_quant.amax import _describe, _name_of, name_groups, reduce_and_update
from dist_quant.state import DelayedGroup


def group(n: int, hist: int = 3) -> DelayedGroup:
    return DelayedGroup(
        scale=torch.ones(n),
        amax_history=torch.zeros(hist, n),
        fp8_max=torch.full((n,), 448.0),
        margin=0,
        algo="max",
        reduce_amax=True,
    )


def test_a_buffer_enrolled_twice_in_one_region_rolls_its_history_once():
    g = group(2)
    g.amax_history[0] = torch.tensor([2.0, 4.0])
    # a module that ran twice builds two DelayedGroup objects over the same buffers
    twin = DelayedGroup(g.scale, g.amax_history, g.fp8_max, 0, "max", True)
    reduce_and_update([g, twin], None)
    want = torch.tensor([448.0, 448.0], dtype=torch.float32) / torch.tensor([2.0, 4.0])
    assert torch.equal(g.scale, want)
    # one roll: the step's amax sits in the last row, row 0 is cleared, nothing else moved
    assert torch.equal(g.amax_history, torch.tensor([[0.0, 0.0], [0.0, 0.0], [2.0, 4.0]]))


def test_reduction_without_a_group_updates_locally_and_needs_no_process_group():
    g = group(1)
    g.amax_history[0, 0] = 7.0
    reduce_and_update([g], None)
    assert g.scale.item() == torch.tensor(448.0 / 7.0, dtype=torch.float32).item()


def test_names_follow_the_buffer_not_the_group_object():
    lin = dq.Linear(8, 8, name="blk.fc")
    with dq.autocast(recipe=dq.DelayedScaling(amax_history_len=2)):
        lin(torch.randn(4, 8))
    rt = lin.quant_binding.runtime
    rebuilt = rt.delayed_groups(fwd=True)[0]  # a fresh object viewing the same buffers

    assert _name_of(rebuilt) == "blk.fc"
    assert _name_of(rt.delayed_groups(fwd=False)[0]) == "blk.fc"
    name_groups([rebuilt], "renamed")
    assert _name_of(rt.delayed_groups(fwd=True)[0]) == "renamed"


def test_mismatch_description_names_missing_modules_slot_counts_and_passes():
    lists = [
        "forward\na\t3\nb\t3\nhead\t3",
        "forward\na\t3\nb\t2",
    ]
    msg = _describe(lists, "forward", 1)
    assert "on rank 1 of 2" in msg
    assert "module 'head' ran on ranks [0] but not on ranks [1]" in msg
    assert "module 'b' has different delayed-scaling slot counts {0: 3, 1: 2}" in msg
    assert "'a'" not in msg
    msg = _describe(["forward\na\t3", "backward\na\t2"], "forward", 0)
    assert "not in the same pass: rank 0: forward, rank 1: backward" in msg


def test_a_backward_that_raises_does_not_stop_later_backward_updates():
    # A pass that fails after a module's backward never runs its end-of-pass callback; the next
    # pass must still reduce and update. Both passes see the same grad_output (ones, from sum), so
    # folding the failed pass's amax into the next update changes nothing: the clean run's state.
    def step(model, x, fail):
        with dq.autocast(recipe=dq.DelayedScaling(amax_history_len=4)):
            y = model(x.requires_grad_(True))
        if fail:
            x.register_hook(lambda g: (_ for _ in ()).throw(RuntimeError("boom")))
        y.sum().backward()

    torch.manual_seed(0)
    failing, clean = dq.Linear(16, 16), dq.Linear(16, 16)
    clean.load_state_dict(failing.state_dict())
    x = torch.randn(4, 16)
    with pytest.raises(RuntimeError, match="boom"):
        step(failing, x.clone(), fail=True)
    step(failing, 2 * x, fail=False)
    step(clean, 2 * x, fail=False)
    got = failing.state_dict()["_extra_state"]["buffers"]
    want = clean.state_dict()["_extra_state"]["buffers"]
    assert not torch.equal(want["backward.scale"], torch.ones(2))
    for key in ("backward.scale", "backward.amax_history"):
        assert torch.equal(got[key], want[key]), key
