"""Rectangles of global tensors, and which replica writes each: pure geometry.

A `Rect` is one rank's block of a global tensor: a key that does not mention
the layout, the global shape, the block's offset and a local view. The same
description serves saving (the view is read) and loading (the view is filled
from whatever rectangles the checkpoint holds), which is all resharding
needs. Which keys a training state has, and its rects, is keys.py's business.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


@dataclass
class Rect:
    key: str
    global_shape: tuple[int, ...]
    offset: tuple[int, ...]
    tensor: torch.Tensor  # this rank's block: a view into live state

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.tensor.shape)

    @property
    def nbytes(self) -> int:
        return self.tensor.numel() * self.tensor.element_size()

    def identity(self) -> tuple:
        """Rects with the same identity on different ranks are replicas."""
        return (self.key, self.offset, self.shape)


def assign_writers(all_rects: list[list[tuple]], world: int) -> dict[tuple, int]:
    """Pick one writer among the replicas of every rect, balancing bytes.

    `all_rects[r]` lists (identity, nbytes) of rank r. Greedy over rects by
    size, each to the least-loaded of its replicas: every rank computes the
    same answer from the same gathered lists, so no further communication."""
    replicas: dict[tuple, list[int]] = {}
    sizes: dict[tuple, int] = {}
    for rank, rects in enumerate(all_rects):
        for identity, nbytes in rects:
            replicas.setdefault(identity, []).append(rank)
            sizes[identity] = nbytes
    load = [0] * world
    writers = {}
    for identity in sorted(replicas, key=lambda i: (-sizes[i], i)):
        rank = min(replicas[identity], key=lambda r: (load[r], r))
        writers[identity] = rank
        load[rank] += sizes[identity]
    return writers
