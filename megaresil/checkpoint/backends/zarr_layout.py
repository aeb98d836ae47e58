"""Where every byte of a zarr v3 array lies: the chunking we choose, the
array metadata (`zarr.json`), and the byte layout of its shard files.

Shards (one file each, zarr's `sharding_indexed` codec) follow the writers'
rectangles, so an array never has more shard files than writer rectangles;
inner chunks of about 4 MiB are stored uncompressed, so every chunk's place
in its file is known in advance. docs/checkpoints.md ("The zarr backend")
explains the rules.
"""
from __future__ import annotations

import itertools
import json
import math
from dataclasses import dataclass
from typing import Iterator, Optional

import numpy as np

# Inner chunks hold about this many bytes: large reads, yet a reader of a
# small region fetches little more than it needs.
INNER_CHUNK_BYTES = 4 << 20
EMPTY = 2**64 - 1  # the index's mark of an absent chunk


def storage_dtype(torch_dtype: str) -> str:
    """zarr has no bfloat16: its uint16 bit pattern is stored instead."""
    return "uint16" if torch_dtype == "bfloat16" else torch_dtype


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def _largest_divisor(n: int, limit: int) -> int:
    small = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]
    return max(d for d in small + [n // d for d in small] if d <= limit)


def _dim_chunking(extent: int, intervals: set[tuple[int, int]], limit: int) -> tuple[int, int]:
    """(shard, inner chunk) along one dimension whose writers cover
    `intervals`, the inner chunk at most `limit` long."""
    writers = max(1, len(intervals))
    bounds = {b for interval in intervals for b in interval} - {0, extent}
    step = math.gcd(*bounds) if bounds else extent
    if _ceil_div(extent, step) <= writers:  # a regular grid: one shard per writer interval
        inner = _largest_divisor(step, limit)
        if inner * 4 >= min(step, limit):  # else `step` has no divisor near the target
            return step, inner
    share = _ceil_div(extent, writers)
    inner = min(share, limit)
    return inner * _ceil_div(share, inner), inner  # at least `share`: at most `writers` shards


def choose_chunking(global_shape: list[int], itemsize: int,
                    rects: list[dict]) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(shard shape, inner chunk shape) for an array written as `rects`
    (offset, shape), inner chunks of about INNER_CHUNK_BYTES: filled from
    the last dimension, so a chunk is whole rows wherever they fit."""
    written = [r for r in rects if all(r["shape"])]
    shard, inner = [1] * len(global_shape), [1] * len(global_shape)
    elements = 1  # in an inner chunk, over the dimensions after d
    for d in reversed(range(len(global_shape))):
        intervals = {(r["offset"][d], r["offset"][d] + r["shape"][d]) for r in written}
        limit = max(1, INNER_CHUNK_BYTES // itemsize // elements)
        shard[d], inner[d] = _dim_chunking(max(global_shape[d], 1), intervals, limit)
        elements *= inner[d]
    return tuple(shard), tuple(inner)


def runs(box: tuple[int, ...], offset: tuple[int, ...],
         shape: tuple[int, ...]) -> list[tuple[int, int]]:
    """(start, length) in elements of the contiguous runs that the sub-box
    (offset, shape) occupies in a C-order array of shape `box`, in order."""
    whole = len(box)
    while whole > 0 and shape[whole - 1] == box[whole - 1]:
        whole -= 1  # dims from `whole` on are complete
    outer = max(whole - 1, 0)  # dims from `outer` on make one run
    strides = [math.prod(box[d + 1:]) for d in range(len(box))]
    inner_start = offset[outer] * strides[outer] if outer < len(box) else 0
    length = math.prod(shape[outer:])
    return [(sum(i * s for i, s in zip(index, strides)) + inner_start, length)
            for index in itertools.product(*(range(o, o + n) for o, n in
                                             zip(offset[:outer], shape[:outer])))]


@dataclass(frozen=True)
class Piece:
    """The part of a region that lies in one inner chunk."""
    chunk: tuple[int, ...]  # the inner chunk's coordinates within its shard
    within: tuple[int, ...]  # the part's offset inside the chunk
    shape: tuple[int, ...]
    at: tuple[int, ...]  # the part's offset inside the region


@dataclass(frozen=True)
class ArrayLayout:
    shape: tuple[int, ...]
    dtype: str  # zarr's data type
    torch_dtype: str
    shard: tuple[int, ...]  # the chunk grid: one file each
    inner: tuple[int, ...]  # chunks inside a shard (== shard when unsharded)
    sharded: bool
    separator: str = "."  # of chunk keys: "c.0.1"; arrays written before shards have "/"

    @classmethod
    def planned(cls, global_shape: list[int], torch_dtype: str, itemsize: int,
                rects: list[dict]) -> "ArrayLayout":
        shard, inner = choose_chunking(global_shape, itemsize, rects)
        return cls(tuple(global_shape), storage_dtype(torch_dtype), torch_dtype, shard, inner,
                   sharded=len(global_shape) > 0)

    @classmethod
    def parse(cls, text: str) -> "ArrayLayout":
        """From an array's zarr.json; ValueError for what we cannot read in
        place (compressed or transposed chunks, another grid)."""
        meta = json.loads(text)
        grid = meta["chunk_grid"]
        if grid["name"] != "regular":
            raise ValueError(f"chunk grid {grid['name']!r}")
        shard = tuple(grid["configuration"]["chunk_shape"])
        encoding = meta["chunk_key_encoding"]
        separator = encoding.get("configuration", {}).get("separator", "/")
        if encoding["name"] != "default":
            raise ValueError(f"chunk key encoding {encoding['name']!r}")
        codecs = meta["codecs"]
        sharded = codecs[0]["name"] == "sharding_indexed"
        if sharded:
            config = codecs[0]["configuration"]
            inner, codecs = tuple(config["chunk_shape"]), config["codecs"]
            if ([c["name"] for c in config["index_codecs"]] != ["bytes"]
                    or config.get("index_location", "end") != "end"):
                raise ValueError("a shard index that is not plain bytes at the end")
        else:
            inner = shard
        if [c["name"] for c in codecs] != ["bytes"] or \
                codecs[0].get("configuration", {}).get("endian", "little") != "little":
            raise ValueError(f"codecs {[c['name'] for c in codecs]} (not plain little-endian bytes)")
        torch_dtype = meta.get("attributes", {}).get("torch_dtype", meta["data_type"])
        return cls(tuple(meta["shape"]), meta["data_type"], torch_dtype, shard, inner, sharded,
                   separator)

    def metadata(self) -> dict:
        """The array's zarr.json."""
        plain = [{"name": "bytes", "configuration": {"endian": "little"}}]
        codecs = plain if not self.sharded else [{"name": "sharding_indexed", "configuration": {
            "chunk_shape": list(self.inner), "codecs": plain, "index_codecs": plain,
            "index_location": "end"}}]
        fill = False if self.dtype == "bool" else 0.0 if self.dtype.startswith("float") else 0
        return {"zarr_format": 3, "node_type": "array", "shape": list(self.shape),
                "data_type": self.dtype,
                "chunk_grid": {"name": "regular", "configuration": {"chunk_shape": list(self.shard)}},
                "chunk_key_encoding": {"name": "default", "configuration": {"separator": self.separator}},
                "fill_value": fill, "codecs": codecs, "attributes": {"torch_dtype": self.torch_dtype},
                "storage_transformers": []}

    # --- geometry -------------------------------------------------------------------

    @property
    def itemsize(self) -> int:
        return np.dtype("bool" if self.dtype == "bool" else self.dtype).itemsize

    @property
    def chunk_bytes(self) -> int:
        return math.prod(self.inner) * self.itemsize

    @property
    def per_shard(self) -> tuple[int, ...]:
        return tuple(s // c for s, c in zip(self.shard, self.inner))

    def shards(self) -> Iterator[tuple[int, ...]]:
        return itertools.product(*(range(_ceil_div(n, s)) for n, s in zip(self.shape, self.shard)))

    def file_name(self, shard: tuple[int, ...]) -> str:
        """The shard's file in the array's directory (zarr's default chunk
        key encoding with the "." separator: no directory per row of shards,
        each of which the commit would have to fsync)."""
        return self.separator.join(["c", *map(str, shard)])

    def in_bounds(self, shard: tuple[int, ...]) -> tuple[int, ...]:
        """Inner chunks per dimension of `shard` that hold array elements."""
        return tuple(min(k, _ceil_div(n - i * s, c)) for n, i, s, c, k in
                     zip(self.shape, shard, self.shard, self.inner, self.per_shard))

    def index_size(self) -> int:
        return math.prod(self.per_shard) * 16 if self.sharded else 0

    def data_size(self, shard: tuple[int, ...]) -> int:
        return math.prod(self.in_bounds(shard)) * self.chunk_bytes

    def chunk_offset(self, shard: tuple[int, ...], chunk: tuple[int, ...]) -> int:
        """Where an in-bounds inner chunk lies in its shard file, as we write it."""
        return int(np.ravel_multi_index(chunk, self.in_bounds(shard))) * self.chunk_bytes \
            if chunk else 0

    def index(self, shard: tuple[int, ...]) -> bytes:
        """The shard's index as we write it: in-bounds chunks packed in C order."""
        table = np.full((*self.per_shard, 2), EMPTY, dtype="<u8")
        for chunk in itertools.product(*map(range, self.in_bounds(shard))):
            table[chunk] = (self.chunk_offset(shard, chunk), self.chunk_bytes)
        return table.tobytes()

    def origin_in(self, shard: tuple[int, ...], offset: tuple[int, ...],
                  shape: tuple[int, ...]) -> bool:
        """Whether the region (offset, shape) holds the shard's first element:
        its writer writes the shard's index."""
        return all(o <= i * s < o + n for i, s, o, n in zip(shard, self.shard, offset, shape))

    def pieces(self, offset: tuple[int, ...],
               shape: tuple[int, ...]) -> dict[tuple[int, ...], list[Piece]]:
        """The region (offset, shape) cut at inner chunk boundaries, by shard
        (in C order, and so are the pieces of each)."""
        by_shard: dict[tuple[int, ...], list[Piece]] = {}
        spans = [range(o // c, (o + n - 1) // c + 1) for o, n, c in zip(offset, shape, self.inner)]
        for chunk in itertools.product(*spans):
            start = [max(o, i * c) for o, i, c in zip(offset, chunk, self.inner)]
            stop = [min(o + n, (i + 1) * c) for o, n, i, c in zip(offset, shape, chunk, self.inner)]
            shard = tuple(i // k for i, k in zip(chunk, self.per_shard))
            by_shard.setdefault(shard, []).append(Piece(
                chunk=tuple(i % k for i, k in zip(chunk, self.per_shard)),
                within=tuple(s - i * c for s, i, c in zip(start, chunk, self.inner)),
                shape=tuple(b - a for a, b in zip(start, stop)),
                at=tuple(s - o for s, o in zip(start, offset))))
        return dict(sorted(by_shard.items()))

    def read_index(self, raw: bytes) -> Optional[np.ndarray]:
        """A shard's index table (chunk coordinates, then offset and length)."""
        return np.frombuffer(raw, dtype="<u8").reshape(*self.per_shard, 2) if self.sharded else None
