"""Synthetic language: token sequences from a fixed random Markov chain over the vocabulary.

Why a Markov chain: it needs no download, it is generated in milliseconds on every rank, and
its entropy rate is known exactly, so the training loss has a true floor to be compared
against (the unigram entropy of the stationary distribution is what a model that ignores
context would reach). Each row of the transition matrix puts its mass on a small random
subset of successors with Dirichlet weights of small concentration, so the next token is
far more predictable from the previous one than from the token frequencies alone.

Batches are a pure function of ``(seed, step)`` and the row index inside the global batch,
never of the number of ranks: every rank walks the chain for its own rows only (see
``rank_slice``). A run resumed on a different world size therefore sees exactly the batches
an uninterrupted run would have seen, and the checkpoint needs no data-loader state beyond
the step counter.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch


@dataclass(frozen=True)
class ChainStats:
    """Information-theoretic reference points of a chain, in nats per token."""

    entropy_rate: float
    """Best achievable cross-entropy when the previous token is known: the loss floor."""
    unigram_entropy: float
    """Cross-entropy of predicting from token frequencies alone (stationary distribution)."""


class MarkovChain:
    """A seeded first-order Markov chain over ``vocab_size`` tokens.

    ``branching`` successors per token receive Dirichlet(``concentration``) weights and a
    fraction ``smoothing`` of each row's mass is spread uniformly, which makes the chain
    irreducible and aperiodic (so the stationary distribution exists and is unique) and
    keeps every transition possible, so no target has infinite loss.
    """

    def __init__(
        self,
        vocab_size: int,
        seed: int = 0,
        *,
        branching: int = 16,
        concentration: float = 0.3,
        smoothing: float = 0.01,
    ) -> None:
        if vocab_size < 2:
            raise ValueError(f"vocab_size={vocab_size} must be >= 2")
        branching = min(branching, vocab_size)
        self.vocab_size = vocab_size
        self.seed = seed
        # A forked global RNG keeps Dirichlet sampling (which takes no generator) seeded
        # without disturbing the caller's random state.
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            successors = torch.rand(vocab_size, vocab_size).argsort(dim=1)[:, :branching]
            alpha = torch.full((vocab_size, branching), concentration, dtype=torch.float64)
            weights = torch.distributions.Dirichlet(alpha).sample()
        sparse = torch.zeros(vocab_size, vocab_size, dtype=torch.float64)
        sparse.scatter_(1, successors, weights)
        self.transition = (1.0 - smoothing) * sparse + smoothing / vocab_size
        self.stationary = _stationary(self.transition)
        # Inverse-CDF sampling tables, float64 so the last entry rounds to 1 (clamped anyway).
        # Each row's CDF is cut into blocks of about sqrt(vocab_size) entries (the last block
        # padded with +inf, which no uniform reaches), and ``_block_ends`` keeps every
        # block's last entry: a draw reads one row of block ends and one block, not the row.
        self._block = max(1, math.isqrt(vocab_size))
        blocks = -(-vocab_size // self._block)
        cdf = np.full((vocab_size, blocks * self._block), np.inf)
        cdf[:, :vocab_size] = self.transition.cumsum(dim=1).numpy()
        self._blocks = cdf.reshape(vocab_size, blocks, self._block)
        self._block_ends = np.ascontiguousarray(self._blocks[:, :, -1])
        self._start_cdf = self.stationary.cumsum(dim=0).numpy()

    def stats(self) -> ChainStats:
        """Entropy rate ``sum_i pi_i H(P_i)`` and the stationary distribution's entropy."""
        p = self.transition
        row_entropy = -(p * p.clamp_min(1e-300).log()).sum(dim=1)
        pi = self.stationary
        return ChainStats(
            entropy_rate=float((pi * row_entropy).sum()),
            unigram_entropy=float(-(pi * pi.clamp_min(1e-300).log()).sum()),
        )

    def batch(self, step: int, batch_size: int, seq_len: int, rows: slice) -> torch.Tensor:
        """Rows ``rows`` of the ``[batch_size, seq_len + 1]`` int64 token batch of ``step``.

        Row ``r`` is the same whichever ``rows`` it is asked with, so ranks that each build
        their own rows together hold the global batch, on any number of ranks. The uniforms
        of the whole global batch are drawn (8 bytes a token, from one generator seeded by
        ``(seed, step)``); the chain is walked only for ``rows``. Each token is the first
        entry of its predecessor's CDF row at or above its uniform (inverse-CDF sampling,
        as ``torch.searchsorted`` on the whole row finds it), found by reading about
        ``2 sqrt(vocab_size)`` entries instead of the row, so the walk keeps ahead of a
        large model's step (16 rows x 1025 tokens at vocabulary 8192: benchmarks/README.md,
        "Training example").

        The first token of each row is drawn from the stationary distribution, so every
        position is in the chain's steady state and the floor applies to every target.
        """
        g = torch.Generator().manual_seed(_mix(self.seed, step))
        u = torch.rand(seq_len + 1, batch_size, 1, generator=g, dtype=torch.float64)
        draws = u[:, rows, 0].numpy()
        last = self.vocab_size - 1
        tokens = np.empty((seq_len + 1, draws.shape[1]), dtype=np.int64)
        tokens[0] = np.minimum(np.searchsorted(self._start_cdf, draws[0]), last)
        top_block = self._block_ends.shape[1] - 1
        for t in range(1, seq_len + 1):
            previous, ut = tokens[t - 1], draws[t][:, None]
            # The CDF entries below u, counted: whole blocks whose last entry is below u,
            # then the entries below u in the block that holds the first one at or above it.
            block = np.minimum((self._block_ends[previous] < ut).sum(axis=1), top_block)
            inside = (self._blocks[previous, block] < ut).sum(axis=1)
            tokens[t] = np.minimum(block * self._block + inside, last)
        return torch.from_numpy(np.ascontiguousarray(tokens.T))


def rank_slice(batch_size: int, rank: int, world_size: int) -> slice:
    """Rows of the global batch that ``rank`` trains on (``torch.tensor_split`` rule).

    Uneven splits are allowed (a batch of 8 on 3 ranks is 3/3/2); the loss is normalised by
    the global token count, so the gradient is the global-batch mean either way.
    """
    if batch_size < world_size:
        raise ValueError(
            f"--batch-size {batch_size} is smaller than the {world_size} ranks; every rank "
            "needs at least one sequence"
        )
    base, extra = divmod(batch_size, world_size)
    start = rank * base + min(rank, extra)
    return slice(start, start + base + (1 if rank < extra else 0))


def _stationary(transition: torch.Tensor, iters: int = 10_000, tol: float = 1e-14) -> torch.Tensor:
    """Stationary distribution by power iteration (the chain is irreducible and aperiodic)."""
    pi = torch.full((transition.size(0),), 1.0 / transition.size(0), dtype=torch.float64)
    for _ in range(iters):
        nxt = pi @ transition
        nxt = nxt / nxt.sum()
        if float((nxt - pi).abs().sum()) < tol:
            return nxt
        pi = nxt
    return pi


def _mix(seed: int, step: int) -> int:
    """A 63-bit generator seed from ``(seed, step)`` with no collisions for small values."""
    return (seed * 0x9E3779B97F4A7C15 + step * 0xBF58476D1CE4E5B9 + 1) % (2**63 - 1)


def max_loss(vocab_size: int) -> float:
    """Loss of a uniform prediction, the starting point of a freshly initialised model."""
    return math.log(vocab_size)
