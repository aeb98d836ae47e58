"""`MeshShape`: the named axes of the parallel mesh and the arithmetic between
a global rank and its coordinates, with no process group.

Axes are listed outermost first and ranks are numbered in mixed radix over
them, the last axis innermost: today (pp, dp, tp), so TP peers get adjacent
ranks (on a GPU node they share NVLink), as in Megatron. A new parallelism is
a new axis name (one of size 1 changes no rank's number), not new arithmetic.
"""
from __future__ import annotations

import itertools
import math
from dataclasses import dataclass
from typing import Mapping, Protocol


class Degrees(Protocol):
    """The parallel degrees: a ParallelConfig, or a ParallelLayout."""

    tp: int
    pp: int
    dp: int


@dataclass(frozen=True)
class MeshShape:
    axes: tuple[tuple[str, int], ...]  # (name, size), outermost first

    @classmethod
    def of(cls, cfg: Degrees) -> "MeshShape":
        return cls((("pp", cfg.pp), ("dp", cfg.dp), ("tp", cfg.tp)))

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(name for name, _ in self.axes)

    @property
    def sizes(self) -> tuple[int, ...]:
        return tuple(size for _, size in self.axes)

    def size(self, *axes: str) -> int:
        """The product of the sizes of `axes` (of every axis when none are named)."""
        sizes = dict(self.axes)
        return math.prod(sizes[axis] for axis in axes or self.names)

    def coords_of(self, rank: int) -> dict[str, int]:
        coords = {}
        for name, size in reversed(self.axes):
            rank, coords[name] = divmod(rank, size)
        return {name: coords[name] for name in self.names}

    def rank_of(self, coords: Mapping[str, int]) -> int:
        rank = 0
        for name, size in self.axes:
            rank = rank * size + coords[name]
        return rank

    def group_of(self, axes: tuple[str, ...], at: Mapping[str, int]) -> list[int]:
        """The ranks that share `at`'s coordinates on every axis but `axes`,
        in rank order."""
        axes = tuple(name for name in self.names if name in axes)
        return [self.rank_of({**at, **dict(zip(axes, values))})
                for values in itertools.product(*(range(self.size(a)) for a in axes))]

    def groups(self, axes: tuple[str, ...]) -> list[list[int]]:
        """Every group varying `axes`, the other axes' coordinates taken in
        mixed radix (the order every rank must create them in)."""
        others = tuple(name for name in self.names if name not in axes)
        return [self.group_of(axes, dict(zip(others, values)))
                for values in itertools.product(*(range(self.size(a)) for a in others))]
