"""Where an offline checkpoint write takes its tensors from.

A source names its global tensors (key -> global shape and dtype, as a
manifest's tensor table does) and fills any rectangles of them. A committed
checkpoint is read through its backend's `read`, the same resharding path a
resuming trainer uses; a Hugging Face model's files serve the same interface
(hf/io.py's HFTensorSource).
"""
from __future__ import annotations

import itertools
from pathlib import Path
from typing import Callable, Iterable, Iterator, Protocol, TypeVar

import torch

from megaresil.checkpoint import format as fmt
from megaresil.checkpoint.backends import get_backend
from megaresil.checkpoint.backends.dcp_read import narrowed
from megaresil.checkpoint.sharded import Rect
from megaresil.checkpoint.validation import read_manifest, verify_shards
from megaresil.terminal import progress_bar

# Reads are batched up to this many bytes: a read of a DCP checkpoint costs
# tens of milliseconds however small, and a model has many small rects.
READ_BATCH_BYTES = 64 * 2**20

T = TypeVar("T")


def byte_batches(items: Iterable[T], nbytes: Callable[[T], int]) -> Iterator[list[T]]:
    """Consecutive items in batches of at most READ_BATCH_BYTES (or one item)."""
    batch: list[T] = []
    size = 0
    for item in items:
        if batch and size + nbytes(item) > READ_BATCH_BYTES:
            yield batch
            batch, size = [], 0
        batch.append(item)
        size += nbytes(item)
    if batch:
        yield batch


def fill_from_full(targets: list[Rect], full: Callable[[str], torch.Tensor]) -> None:
    """Fill each target rect from its key's global tensor, made once per key
    by `full` (a source that builds whole tensors: HF's, Megatron's)."""
    ordered = sorted(targets, key=lambda t: t.key)
    for key, group in itertools.groupby(ordered, key=lambda t: t.key):
        whole = full(key)
        for target in group:
            target.tensor.copy_(narrowed(whole, target.offset, target.shape))


class TensorSource(Protocol):
    tensors: dict[str, dict]  # key -> {"global_shape": [...], "dtype": "float32", ...}

    def read(self, targets: list[Rect]) -> None:
        """Fill every target rect's tensor from the global tensors."""


class CheckpointSource:
    """A committed checkpoint; CheckpointError when it is not one."""

    def __init__(self, path: Path):
        self.path = path
        self.manifest = read_manifest(path)
        self.backend = get_backend(self.manifest["backend"])
        self.tensors: dict[str, dict] = self.manifest["tensors"]

    def read(self, targets: list[Rect]) -> None:
        self.backend.read(self.path, self.manifest, targets)

    def verify(self) -> None:
        """Check every shard's checksum, a batch of shards at a time (memory
        stays near one batch or the largest shard); CheckpointError naming
        the first bad one."""
        shards = list(fmt.iter_shards(self.manifest))
        with progress_bar(total=len(shards), desc="verifying source", unit="shard") as bar:
            for batch in byte_batches(shards, lambda s: fmt.region_bytes(s[2]["shape"], s[1]["dtype"])):
                reason = verify_shards(self.backend, self.path, self.manifest, batch)
                if reason:
                    raise fmt.CheckpointError(
                        f"{self.path} is corrupt: {reason}. Fix: convert an earlier checkpoint "
                        "(`megaresil ckpt verify PATH` checks one).")
                bar.update(len(batch))


def _entry_bytes(entry: dict) -> int:
    return fmt.region_bytes(entry["global_shape"], entry["dtype"])


def full_tensors(source: TensorSource, keys: Iterable[str]) -> Iterator[tuple[str, torch.Tensor]]:
    """(key, whole global tensor) for each key, read a batch of keys at a time."""
    for batch in byte_batches(keys, lambda key: _entry_bytes(source.tensors[key])):
        rects = []
        for key in batch:
            shape = tuple(source.tensors[key]["global_shape"])
            data = torch.empty(shape, dtype=fmt.torch_dtype(source.tensors[key]["dtype"]))
            rects.append(Rect(key, shape, (0,) * len(shape), data))
        source.read(rects)
        yield from ((rect.key, rect.tensor) for rect in rects)
