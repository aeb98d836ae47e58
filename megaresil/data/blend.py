"""Weighted blends of datasets, Megatron's `[w1, prefix1, w2, prefix2, ...]`.

The blend is a fixed interleave repeated every PERIOD samples: each period
takes counts[d] samples of dataset d (its weight's share of PERIOD, rounded by
largest remainder) spread evenly over the period. So the blend needs no
sequential pass over the run's samples and no cache: sample i of the blend is
sample (i // PERIOD) * counts[d] + rank of dataset d, computed in O(1), for
any i, at any dp, after any resume.
"""
# mypy: ignore-errors
from __future__ import annotations

from typing import Sequence

import numpy as np
import torch

from megaresil.config import ConfigError

PERIOD = 10_000


def parse_blend(paths: Sequence[object]) -> list[tuple[float, str]]:
    """(normalised weight, prefix) from `[w1, p1, w2, p2, ...]` or `[p1, p2, ...]`
    (equal weights)."""
    items = list(paths)
    if items and all(isinstance(item, str) for item in items):
        return [(1.0 / len(items), item) for item in items]
    pairs = list(zip(items[0::2], items[1::2]))
    well_formed = len(items) % 2 == 0 and items and all(
        isinstance(w, (int, float)) and not isinstance(w, bool) and isinstance(p, str)
        for w, p in pairs)
    if not well_formed:
        raise ConfigError("data.paths", f"{items!r} is neither [weight, prefix, weight, prefix, "
                          "...] nor a list of prefixes.", "write e.g. [0.7, data/a, 0.3, data/b].")
    if any(w <= 0 for w, _ in pairs):
        raise ConfigError("data.paths", "every weight must be positive.",
                          "drop the datasets you do not want instead of weighting them 0.")
    total = float(sum(w for w, _ in pairs))
    return [(w / total, prefix) for w, prefix in pairs]


def counts_per_period(weights: Sequence[float], period: int = PERIOD) -> np.ndarray:
    """Samples of each dataset per period: its share, rounded by largest remainder."""
    raw = np.asarray(weights, dtype=np.float64) * period
    counts = np.floor(raw).astype(np.int64)
    leftover = period - int(counts.sum())
    counts[np.argsort(-(raw - counts), kind="stable")[:leftover]] += 1
    if (counts == 0).any():
        raise ConfigError("data.paths", f"a weight below 1/{period} gives its dataset no samples.",
                          f"raise it to at least {1 / period}, or drop that dataset.")
    return counts


class BlendedDataset:
    """Samples of `datasets` interleaved by `weights` (each dataset indexed by
    its own never-ending global sample index)."""

    def __init__(self, datasets: Sequence[object], weights: Sequence[float]):
        self.datasets = list(datasets)
        self.counts = counts_per_period(weights)
        owners = np.repeat(np.arange(len(self.datasets)), self.counts)
        ranks = np.concatenate([np.arange(n) for n in self.counts])
        # Dataset d's k-th sample of a period is due at (k + 0.5) / counts[d];
        # ties go to the earlier dataset.
        due = (ranks + 0.5) / self.counts[owners]
        order = np.lexsort((owners, due))
        self._owner, self._rank = owners[order], ranks[order]

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        if index < 0:
            raise IndexError(f"sample index {index} is negative.")
        period, offset = divmod(int(index), PERIOD)
        owner = int(self._owner[offset])
        return self.datasets[owner][period * int(self.counts[owner]) + int(self._rank[offset])]
