"""The demo's synthetic language: a chain the model can learn, sampled reproducibly."""

import math

import numpy as np
import pytest
import torch
from dist_quant.launch.demo_data import MarkovTask


def test_entropy_rate_matches_an_eigenvector_derivation() -> None:
    task = MarkovTask(vocab=16, branching=3, seed=5)
    p = task.transitions.numpy()
    # Stationary distribution: the left eigenvector of P for eigenvalue 1, normalised.
    vals, vecs = np.linalg.eig(p.T)
    pi = np.real(vecs[:, np.argmin(np.abs(vals - 1.0))])
    pi = pi / pi.sum()
    with np.errstate(divide="ignore", invalid="ignore"):
        row_h = -np.nansum(np.where(p > 0, p * np.log(p), 0.0), axis=1)
    assert task.entropy_rate() == pytest.approx(float(pi @ row_h), rel=1e-9)
    # A learnable task: far below uniform guessing.
    assert task.entropy_rate() < 0.5 * math.log(task.vocab)


def test_rows_are_distributions_over_exactly_branching_successors() -> None:
    task = MarkovTask(vocab=32, branching=4, seed=1)
    p = task.transitions
    assert torch.allclose(p.sum(dim=1), torch.ones(32, dtype=torch.float64))
    assert ((p > 0).sum(dim=1) == 4).all()


def test_batches_are_reproducible_per_rank_and_step_and_follow_the_chain() -> None:
    task = MarkovTask(vocab=32, branching=2, seed=3)
    x, y = task.batch(7, batch_size=4, seq_len=12, data_rank=1)
    x2, y2 = MarkovTask(vocab=32, branching=2, seed=3).batch(
        7, batch_size=4, seq_len=12, data_rank=1
    )
    assert torch.equal(x, x2) and torch.equal(y, y2)
    assert x.shape == y.shape == (4, 12) and x.dtype == torch.int64
    assert torch.equal(x[:, 1:], y[:, :-1])  # targets are the inputs shifted by one
    assert (task.transitions[x, y] > 0).all()  # every step is an edge of the chain
    other_rank, _ = task.batch(7, batch_size=4, seq_len=12, data_rank=0)
    other_step, _ = task.batch(8, batch_size=4, seq_len=12, data_rank=1)
    assert not torch.equal(x, other_rank) and not torch.equal(x, other_step)


def test_sampled_transition_frequencies_match_the_chain() -> None:
    task = MarkovTask(vocab=8, branching=2, seed=11)
    counts = torch.zeros(8, 8, dtype=torch.float64)
    for step in range(40):
        x, y = task.batch(step, batch_size=32, seq_len=32)
        counts.index_put_(
            (x.reshape(-1), y.reshape(-1)),
            torch.ones(x.numel(), dtype=torch.float64),
            accumulate=True,
        )
    n = counts.sum(dim=1, keepdim=True)
    freq = counts / n
    p = task.transitions
    # Each row's frequencies are binomial: allow 5 standard errors (rows are visited unevenly).
    tolerance = 5 * torch.sqrt(p * (1 - p) / n) + 1e-12
    assert (n > 100).all()
    assert (torch.abs(freq - p) <= tolerance).all()


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"vocab": 1}, "vocab"),
        ({"vocab": 4, "branching": 5}, "branching"),
        ({"sharpness": -1.0}, "sharpness"),
    ],
)
def test_bad_task_parameters_are_refused_naming_the_field(kwargs: dict, field: str) -> None:
    with pytest.raises(ValueError, match=field):
        MarkovTask(**kwargs)
