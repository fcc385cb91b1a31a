"""The demo's built-in language: a sparse random Markov chain over a small vocabulary.

Every token has a few likely successors, so a model that learns the transition table drives its
loss from about `ln(vocab)` (uniform guessing) down towards the chain's entropy rate, which
`MarkovTask.entropy_rate()` computes exactly. Batches are a pure function of
`(seed, data_rank, step)`: ranks that share a batch (a tensor-parallel group) draw the same tokens
without talking to each other, and a rerun with the same seed sees the same data.
"""

from __future__ import annotations

import torch


class MarkovTask:
    """A first-order Markov chain with `branching` successors per token.

    Each row of the transition matrix puts its mass on `branching` distinct successors with
    probabilities from a softmax of scaled Gaussian draws (`sharpness` sets how uneven they are).
    """

    def __init__(
        self, vocab: int = 64, branching: int = 3, sharpness: float = 1.5, seed: int = 0
    ) -> None:
        if vocab < 2:
            raise ValueError(f"MarkovTask: vocab must be >= 2, got {vocab}")
        if not 1 <= branching <= vocab:
            raise ValueError(
                f"MarkovTask: branching must be in [1, vocab={vocab}], got {branching}"
            )
        if sharpness < 0:
            raise ValueError(f"MarkovTask: sharpness must be >= 0, got {sharpness}")
        self.vocab = vocab
        self.branching = branching
        g = torch.Generator().manual_seed(seed)
        probs = torch.zeros(vocab, vocab, dtype=torch.float64)
        for row in range(vocab):
            succ = torch.randperm(vocab, generator=g)[:branching]
            logits = torch.randn(branching, generator=g, dtype=torch.float64) * sharpness
            probs[row, succ] = torch.softmax(logits, dim=0)
        self.transitions = probs  # (vocab, vocab), rows sum to 1
        self._seed = seed

    def stationary(self) -> torch.Tensor:
        """The chain's stationary distribution (power iteration from uniform, float64)."""
        pi = torch.full((self.vocab,), 1.0 / self.vocab, dtype=torch.float64)
        for _ in range(10_000):
            nxt = pi @ self.transitions
            # Lazy step: averaging with the previous iterate converges on periodic chains too.
            nxt = 0.5 * (nxt + pi)
            if torch.max(torch.abs(nxt - pi)) < 1e-13:
                return nxt
            pi = nxt
        return pi

    def entropy_rate(self) -> float:
        """Nats per token of the best possible predictor: the floor the demo's loss approaches."""
        p = self.transitions
        row_entropy = -(torch.where(p > 0, p * torch.log(p), torch.zeros_like(p))).sum(dim=1)
        return float(self.stationary() @ row_entropy)

    def batch(
        self, step: int, *, batch_size: int, seq_len: int, data_rank: int = 0
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """`(inputs, targets)`, both `(batch, seq_len)` int64; targets are inputs shifted by one."""
        if batch_size < 1 or seq_len < 1:
            raise ValueError(
                f"MarkovTask.batch: batch_size and seq_len must be >= 1, got {batch_size}, {seq_len}"
            )
        # Distinct, reproducible streams per (seed, data rank, step); the large odd multipliers
        # keep neighbouring (rank, step) pairs from sharing a generator seed.
        g = torch.Generator().manual_seed(
            (self._seed * 1_000_003 + data_rank * 7_919 + step * 104_729 + 1) % (2**63)
        )
        tokens = torch.empty(batch_size, seq_len + 1, dtype=torch.int64)
        tokens[:, 0] = torch.randint(0, self.vocab, (batch_size,), generator=g)
        for t in range(seq_len):
            rows = self.transitions[tokens[:, t]]  # (batch, vocab)
            tokens[:, t + 1] = torch.multinomial(rows, 1, generator=g).squeeze(1)
        return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()
