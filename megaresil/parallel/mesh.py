"""`MeshShape`: the named axes of the parallel mesh and the arithmetic between
a global rank and its coordinates, with no process group.

Ranks are numbered in mixed radix over the axes, outermost first: (pp, dp,
tp), so TP peers get adjacent ranks (NVLink), as in Megatron. A new
parallelism is a new axis name, not new arithmetic. A *joined* name stands
for axes taken together: under expert parallelism "dp" is (edp, ep), ep
innermost, so every rank keeps its number and dp index. "cp" sits between dp
and tp (Megatron's order). Sharded data parallelism cuts dp into
(dp_replicate, dp_shard), dp_shard into (dp_shard_mod_ep, ep) under experts
(TorchTitan's names); "dp_shard_cp" and "efsdp" are the ranks FSDP2 shards
dense parameters and experts over. An axis of size 1 is no axis (joined to
nothing), so a layout without it numbers and groups its ranks as it always did.
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
    ep: int
    cp: int
    dp_shard: int


# Without sharded data parallelism its shard axes are no axes (size 1).
NO_SHARDS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("dp_shard", ()), ("dp_shard_cp", ()), ("efsdp", ()))


@dataclass(frozen=True)
class MeshShape:
    axes: tuple[tuple[str, int], ...]  # (name, size), outermost first
    joined: tuple[tuple[str, tuple[str, ...]], ...] = ()  # (name, the axes it stands for)

    @classmethod
    def of(cls, cfg: Degrees) -> "MeshShape":
        context = (("cp", cfg.cp),) if cfg.cp > 1 else ()
        no_context = (("cp", ()),) if cfg.cp == 1 else ()
        if cfg.dp_shard > 1:
            return cls._sharded(cfg, context, no_context)
        no_sharding: tuple[tuple[str, tuple[str, ...]], ...]
        if cfg.ep == 1:
            no_sharding = (("dp_replicate", ("dp",)), *NO_SHARDS)
            return cls((("pp", cfg.pp), ("dp", cfg.dp), *context, ("tp", cfg.tp)),
                       (("edp", ("dp",)), ("ep", ()), *no_context, *no_sharding))
        no_sharding = (("dp_replicate", ("edp", "ep")), *NO_SHARDS)
        return cls((("pp", cfg.pp), ("edp", cfg.dp // cfg.ep), ("ep", cfg.ep), *context,
                    ("tp", cfg.tp)), (("dp", ("edp", "ep")), *no_context, *no_sharding))

    @classmethod
    def _sharded(cls, cfg: Degrees, context: tuple[tuple[str, int], ...],
                 no_context: tuple[tuple[str, tuple[str, ...]], ...]) -> "MeshShape":
        """Sharded data parallelism (config/sharded_data.py): dp is
        (dp_replicate, dp_shard); under expert parallelism dp_shard is
        (dp_shard_mod_ep, ep), TorchTitan's, and the experts, cut along ep,
        are sharded over dp_shard_mod_ep ("efsdp", with cp)."""
        cp = ("cp",) if cfg.cp > 1 else ()
        if cfg.ep == 1:
            return cls((("pp", cfg.pp), ("dp_replicate", cfg.dp // cfg.dp_shard),
                        ("dp_shard", cfg.dp_shard), *context, ("tp", cfg.tp)),
                       (("dp", ("dp_replicate", "dp_shard")), ("edp", ("dp_replicate", "dp_shard")),
                        ("ep", ()), *no_context, ("dp_shard_cp", ("dp_shard", *cp)),
                        ("efsdp", ("dp_shard", *cp))))
        return cls((("pp", cfg.pp), ("dp_replicate", cfg.dp // cfg.dp_shard),
                    ("dp_shard_mod_ep", cfg.dp_shard // cfg.ep), ("ep", cfg.ep), *context,
                    ("tp", cfg.tp)),
                   (("dp", ("dp_replicate", "dp_shard_mod_ep", "ep")),
                    ("edp", ("dp_replicate", "dp_shard_mod_ep")),
                    ("dp_shard", ("dp_shard_mod_ep", "ep")), *no_context,
                    ("dp_shard_cp", ("dp_shard_mod_ep", "ep", *cp)),
                    ("efsdp", ("dp_shard_mod_ep", *cp))))

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(name for name, _ in self.axes)

    @property
    def sizes(self) -> tuple[int, ...]:
        return tuple(size for _, size in self.axes)

    def expand(self, axes: tuple[str, ...]) -> tuple[str, ...]:
        """`axes` with each joined name replaced by its axes, in mesh order."""
        parts = dict(self.joined)
        named = {axis for name in axes for axis in parts.get(name, (name,))}
        unknown = named - set(self.names)
        if unknown:
            raise KeyError(f"no mesh axis {sorted(unknown)} in {self.names}")
        return tuple(name for name in self.names if name in named)

    def size(self, *axes: str) -> int:
        """The product of the sizes of `axes` (of every axis when none are named)."""
        sizes = dict(self.axes)
        return math.prod(sizes[axis] for axis in (self.expand(axes) if axes else self.names))

    def coords_of(self, rank: int) -> dict[str, int]:
        """`rank`'s coordinate on each axis (joined names: see `index_of`)."""
        coords = {}
        for name, size in reversed(self.axes):
            rank, coords[name] = divmod(rank, size)
        return {name: coords[name] for name in self.names}

    def rank_of(self, coords: Mapping[str, int]) -> int:
        rank = 0
        for name, size in self.axes:
            rank = rank * size + coords[name]
        return rank

    def index_of(self, rank: int, axes: tuple[str, ...]) -> int:
        """`rank`'s index in its group over `axes`: its coordinates on them in
        mixed radix (a joined name's coordinate)."""
        return self.group_of(axes, self.coords_of(rank)).index(rank)

    def group_of(self, axes: tuple[str, ...], at: Mapping[str, int]) -> list[int]:
        """The ranks that share `at`'s coordinates on every axis but `axes`,
        in rank order."""
        axes = self.expand(axes)
        return [self.rank_of({**at, **dict(zip(axes, values))})
                for values in itertools.product(*(range(self.size(a)) for a in axes))]

    def groups(self, axes: tuple[str, ...]) -> list[list[int]]:
        """Every group varying `axes`, the other axes' coordinates taken in
        mixed radix (the order every rank must create them in)."""
        varying = self.expand(axes)
        others = tuple(name for name in self.names if name not in varying)
        return [self.group_of(varying, dict(zip(others, values)))
                for values in itertools.product(*(range(self.size(a)) for a in others))]
