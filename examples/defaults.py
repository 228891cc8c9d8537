"""The example's default learning rates: each optimizer's best in a sweep of its own.

Two sweeps, one per kind of data, since the best lrs differ by far more between them than
between sizes:

- ``MARKOV``: the Markov chain of the quick start, at its default config (dim 96, 4 layers,
  300 steps of 16 x 128 tokens; single process, the same numbers at any world size), score
  the mean loss of the last 10 steps (floor 1.927, unigram 5.410). AdamW lr 3e-3 / 5e-3 /
  8e-3 / 1.2e-2: 2.0096 / 2.0063 / 2.0055 / 2.0109. Muon (spectral_norm) lr 0.02 / 0.03 /
  0.05 / 0.08 with its AdamW part at 5e-3: 1.9975 / 1.9983 / 1.9961 / 2.0030; 0.05 with 8e-3:
  1.9967. Muon rms_norm, AdamW part 8e-3, lr 5e-3 / 1e-2 / 2e-2 / 4e-2: 2.0005 / 1.9980 /
  1.9974 / 2.0006 (2026-11-26).
- ``TEXT``: byte-level text (``--data``, scripts/make_corpus.py), swept by
  benchmarks/sweep.py at ~150M (dim 1024) and confirmed at ~1B (dim 2048), each run the same
  9.8M tokens; benchmarks/README.md, "Optimizers on real text", has the table and the
  command. The best lrs were the same at both widths (AdamW 1.25e-4; Muon 0.01 with its
  AdamW part at 1e-3). That sweep held every warmup at 10 steps, which held AdamW back
  (issue 47); ``scripts/fair_sweep.sh`` sweeps the lr and the warmup of each, and
  ``benchmarks/sweep.py --from-json ... --write-defaults`` writes its bests into ``TEXT``.

AdamW's lr on the Markov chain falls as 1/width above the swept width, as muP prescribes for
hidden matrices (its update moves every entry by about lr); on text the sweep found the same
best lr at dims 1024 and 2048, so it is not scaled. Muon's lr is not scaled with width: its
update is orthogonalized and scaled by each matrix's shape (``adjust_lr``).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class SweptLrs:
    """Default lrs and warmups for one kind of data."""

    muon: dict[str, float]  # Muon's lr per adjust_lr
    muon_adamw: float  # Muon's AdamW part: embeddings, head, norms
    adamw: float  # --optimizer adamw, at ``adamw_dim``
    adamw_dim: int | None  # AdamW's lr falls as adamw_dim / dim above it; None: not scaled
    muon_warmup: int = 10  # --warmup steps of Muon, NorMuon and Dion2
    adamw_warmup: int = 10  # --warmup steps of --optimizer adamw

    def adamw_at(self, dim: int) -> float:
        if self.adamw_dim is None:
            return self.adamw
        return self.adamw * min(1.0, self.adamw_dim / dim)

    def warmup(self, optimizer: str) -> int:
        return self.adamw_warmup if optimizer == "adamw" else self.muon_warmup


MARKOV = SweptLrs({"spectral_norm": 0.05, "rms_norm": 2e-2}, 8e-3, 8e-3, 96)
# benchmarks/sweep.py --from-json ... --write-defaults rewrites this line from a sweep's best.
TEXT = SweptLrs({"spectral_norm": 0.01, "rms_norm": 2e-3}, 1e-3, 1.25e-4, None)
DEFAULT_ADJUST_LR = "spectral_norm"  # the best on text, 0.7747 against rms_norm's 0.8271


def swept_for(data: str | None) -> SweptLrs:
    """The defaults for ``--data`` (None: the Markov chain)."""
    return MARKOV if data is None else TEXT
