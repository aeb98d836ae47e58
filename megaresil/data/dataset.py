"""Map-style datasets indexed by a global sample index that never runs out:
sample i of a corpus with n samples per epoch is sample i % n of epoch i // n,
so resuming needs only the number of samples consumed."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from megaresil.config import ConfigError
from megaresil.data.index_cache import ShuffleIndex
from megaresil.data.indexed import IndexedDataset


class GPTDataset:
    """Fixed-length windows of a run of tokens of an indexed dataset.

    The run is `tokens` = [start, end) of the .bin's token stream (default:
    all of it; a train/valid split is a document range). Window j covers
    [start + j*T, start + j*T + T + 1); epoch e visits the windows in the
    order of a permutation seeded by (seed, e), built once and memory-mapped
    from `index_dir` (default: a .megaresil-index directory beside the data).
    When `vocab_size` is given, a sample holding a larger id is refused.
    """

    def __init__(self, indexed: IndexedDataset, seq_len: int, seed: int, *,
                 tokens: tuple[int, int] | None = None, index_dir: str | Path | None = None,
                 vocab_size: int | None = None, name: str | None = None):
        self.indexed = indexed  # not its token memmap: the dataset pickles by path
        self.seq_len = seq_len
        self.vocab_size = vocab_size
        self.start, self.end = tokens if tokens is not None else (0, indexed.num_tokens)
        self.name = name or indexed.prefix
        self.samples_per_epoch = (self.end - self.start - 1) // seq_len
        if self.samples_per_epoch < 1:
            raise ConfigError("data.seq_len", f"{self.name} holds {self.end - self.start} "
                              f"tokens, fewer than one sample of seq_len+1 = {seq_len + 1}.",
                              "lower data.seq_len or give it more data (data.source).")
        directory = index_dir or Path(indexed.prefix).parent / ".megaresil-index"
        self.shuffle = ShuffleIndex(directory, self.samples_per_epoch, seed)
        self.shuffle.epoch(0)  # at start-up, not inside the first step's time budget

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        if index < 0:
            raise IndexError(f"sample index {index} is negative.")
        epoch, k = divmod(int(index), self.samples_per_epoch)
        start = self.start + int(self.shuffle.epoch(epoch)[k]) * self.seq_len
        tokens = self.indexed.tokens()[start:start + self.seq_len + 1]
        self._check_vocab(tokens)
        window = torch.from_numpy(tokens.astype(np.int64))
        return window[:-1], window[1:]

    def _check_vocab(self, tokens: np.ndarray) -> None:
        # Checked per sample instead of scanning the corpus at start: an id past
        # the vocabulary would be silently dropped by a vocab-parallel embedding.
        if self.vocab_size is not None and int(tokens.max()) >= self.vocab_size:
            raise ConfigError("model.vocab_size", f"{self.name} holds token id "
                              f"{int(tokens.max())}, not below model.vocab_size="
                              f"{self.vocab_size}.", "set model.vocab_size to the data's "
                              "tokenizer vocabulary (or larger).")


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
