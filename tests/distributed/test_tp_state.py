"""Sharding rules and the full-state-dict loader, on one process (no process group needed).

What it catches: SwiGLU / fused-QKV weights cut into one contiguous block per rank (pairing one
rank's gate rows with another rank's up rows) and a loader that silently skips or half-applies
keys. Multi-rank loads (and the modules' sharding marks) are exercised by every test_tp_*
comparison against a single-rank reference.
"""

from __future__ import annotations

import pytest
import torch

import dist_quant as dq
from dist_quant.parallel import mark_tp_split, shard_of, tp_splits, unshard


def test_stacked_pieces_are_split_piecewise():
    full = torch.arange(12).reshape(12, 1)  # [q0..q3; k0..k3; v0..v3]
    got = [shard_of(full, 0, 3, r, 2).flatten().tolist() for r in range(2)]
    assert got == [[0, 1, 4, 5, 8, 9], [2, 3, 6, 7, 10, 11]]
    assert shard_of(full, 0, 1, 1, 3).flatten().tolist() == [4, 5, 6, 7]
    with pytest.raises(ValueError, match="not divisible by 8"):
        shard_of(full, 0, 2, 0, 4)


def test_unequal_pieces_are_split_piecewise_and_unshard_inverts_it():
    full = torch.arange(16).reshape(16, 1)  # grouped-query [q0..q7; k0 k1 k2 k3; v0..v3]
    got = [shard_of(full, 0, (2, 1, 1), r, 2).flatten().tolist() for r in range(2)]
    assert got == [[0, 1, 2, 3, 8, 9, 12, 13], [4, 5, 6, 7, 10, 11, 14, 15]]
    assert torch.equal(
        unshard([shard_of(full, 0, (4, 2, 2), r, 2) for r in range(2)], 0, (2, 1, 1)), full
    )
    with pytest.raises(ValueError, match="16 is not divisible by 32"):
        shard_of(full, 0, (2, 1, 1), 0, 8)  # k and v have 4 rows each: not 8 ranks' worth
    lin = dq.Linear(4, 16, name="qkv")
    mark_tp_split(lin, "weight", 0, (4, 2, 2))
    mark_tp_split(lin, "bias", 0, (1, 1, 1))
    assert tp_splits(lin) == {"weight": (0, (2, 1, 1)), "bias": (0, 3)}  # one spelling each
    with pytest.raises(
        ValueError, match=r"parts must be an int >= 1 or a tuple of them, got \(2, 0\)"
    ):
        mark_tp_split(lin, "weight", 0, (2, 0))


def test_loader_is_strict_and_changes_nothing_on_error():
    model = dq.Linear(4, 6, name="lin")
    before = {k: v.clone() for k, v in model.state_dict().items() if k != "_extra_state"}
    full = {k: torch.ones_like(v) for k, v in before.items()}
    with pytest.raises(ValueError, match=r"missing keys \['_extra_state'\]"):
        dq.load_full_state_dict_into_shards(model, full, None)
    full["_extra_state"] = model.state_dict()["_extra_state"]
    with pytest.raises(ValueError, match=r"unexpected keys \['other'\]"):
        dq.load_full_state_dict_into_shards(model, {**full, "other": torch.ones(1)}, None)
    with pytest.raises(ValueError, match=r"'weight' is \(6, 4\) on TP rank 0 of 1"):
        dq.load_full_state_dict_into_shards(model, {**full, "weight": torch.ones(6, 5)}, None)
    for k, v in model.state_dict().items():
        if k in before:
            assert torch.equal(v, before[k]), k
    dq.load_full_state_dict_into_shards(model, full, None)
    assert torch.equal(model.weight, torch.ones(6, 4)) and torch.equal(model.bias, torch.ones(6))
