"""Shuffle orders built once per machine and memory-mapped by every process.

Epoch e of a dataset of n samples visits them in the order
`numpy.random.default_rng([seed, e]).permutation(n)`. Building it costs O(n)
time and memory; rather than every rank doing so at start, the first process
that needs an epoch writes it to DIR/shuffle-<key>-e<epoch>.npy under a file
lock (into a temporary file renamed into place), and the others wait on the
lock and map the same file: one copy in the page cache, however many ranks.
The key hashes exactly what determines the order (n, seed, format version),
so datasets of the same size share files and a changed corpus, seq_len or
split (a changed n) never reuses a stale one.
"""
from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np

from megaresil.data.filelock import exclusive_lock
from megaresil.safe_files import replacing

FORMAT = 1
_MAPPED_EPOCHS = 2  # a global batch straddles at most one epoch boundary


class ShuffleIndex:
    def __init__(self, directory: str | Path, samples: int, seed: int):
        self.directory = Path(directory)
        self.samples = samples
        self.seed = seed
        key = json.dumps({"format": FORMAT, "samples": samples, "seed": seed}, sort_keys=True)
        self.key = hashlib.sha256(key.encode()).hexdigest()[:16]
        self._mapped: dict[int, np.ndarray] = {}

    def epoch(self, epoch: int) -> np.ndarray:
        """The order of `epoch` as a read-only memory map."""
        if epoch not in self._mapped:
            if len(self._mapped) >= _MAPPED_EPOCHS:
                self._mapped.pop(min(self._mapped))
            self._mapped[epoch] = self._load_or_build(epoch)
        return self._mapped[epoch]

    def path(self, epoch: int) -> Path:
        return self.directory / f"shuffle-{self.key}-e{epoch}.npy"

    def _load_or_build(self, epoch: int) -> np.ndarray:
        path = self.path(epoch)
        if not path.is_file():
            with exclusive_lock(self.directory / f"shuffle-{self.key}.lock", "data.index_cache"):
                if not path.is_file():  # another process may have built it meanwhile
                    self._build(epoch, path)
        return np.load(path, mmap_mode="r")

    def _build(self, epoch: int, path: Path) -> None:
        order = np.random.default_rng([self.seed, epoch]).permutation(self.samples)
        if self.samples < 2**31:
            order = order.astype(np.int32)  # same values, half the bytes
        with replacing(path) as handle:
            np.save(handle, order)

    # Pickle by description: the maps reopen on first use.
    def __getstate__(self) -> dict:
        return {**self.__dict__, "_mapped": {}}
