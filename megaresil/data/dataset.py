"""Map-style datasets indexed by a global sample index that never runs out:
sample i of a corpus with n samples per epoch is sample i % n of epoch i // n,
so resuming needs only the number of samples consumed."""
from __future__ import annotations

import numpy as np
import torch

from megaresil.data.indexed import IndexedDataset


class GPTDataset:
    """Fixed-length windows of the token stream of an indexed dataset.

    The stream is every token of the .bin in order (prepare separates
    documents with eod). Window j covers tokens [j*T, j*T + T + 1); epoch e
    visits the windows in the order of a permutation seeded by (seed, e).
    """

    def __init__(self, indexed: IndexedDataset, seq_len: int, seed: int):
        self.indexed = indexed  # not its token memmap: the dataset pickles by path
        self.seq_len = seq_len
        self.seed = seed
        self.samples_per_epoch = (indexed.num_tokens - 1) // seq_len
        if self.samples_per_epoch < 1:
            raise ValueError(f"data.seq_len: {indexed.prefix} holds {indexed.num_tokens} tokens, "
                             f"fewer than one sample of seq_len+1 = {seq_len + 1}. "
                             "Fix: lower data.seq_len or use a larger corpus.")
        self._permutations: dict[int, np.ndarray] = {}

    def _permutation(self, epoch: int) -> np.ndarray:
        if epoch not in self._permutations:
            # Two entries cover a global batch that straddles an epoch boundary.
            if len(self._permutations) >= 2:
                self._permutations.pop(min(self._permutations))
            rng = np.random.default_rng([self.seed, epoch])
            self._permutations[epoch] = rng.permutation(self.samples_per_epoch)
        return self._permutations[epoch]

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        if index < 0:
            raise IndexError(f"sample index {index} is negative.")
        epoch, k = divmod(int(index), self.samples_per_epoch)
        start = int(self._permutation(epoch)[k]) * self.seq_len
        tokens = self.indexed.tokens()[start:start + self.seq_len + 1]
        window = torch.from_numpy(tokens.astype(np.int64))
        return window[:-1], window[1:]


class SyntheticDataset:
    """Deterministic, learnable samples with no corpus.

    The "language" is one random cycle through the whole vocabulary (so every
    token has exactly one successor: loss can fall to ~0); each sample is a
    window of it starting at a position drawn from (seed, index). The cycle
    depends only on vocab_size, so datasets with different seeds (train and
    valid) share it.
    """

    def __init__(self, vocab_size: int, seq_len: int, seed: int):
        self.vocab_size = vocab_size
        self.seq_len = seq_len
        self.seed = seed
        self._cycle = torch.from_numpy(np.random.default_rng(vocab_size).permutation(vocab_size))

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        if index < 0:
            raise IndexError(f"sample index {index} is negative.")
        start = int(np.random.default_rng([self.seed, int(index)]).integers(self.vocab_size))
        positions = (start + torch.arange(self.seq_len + 1)) % self.vocab_size
        window = self._cycle[positions]
        return window[:-1], window[1:]
