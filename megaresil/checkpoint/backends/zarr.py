"""zarr v3 backend: one array per key holding the global tensor.

Rank 0 writes the groups; the writer of an array's first element writes its
`zarr.json` (zarr_layout.py), from the plan every rank holds, so no rank waits
for another's metadata. Each rank writes its rects' bytes straight into their
places in the shard files, with file_io.py's early writeback and fsync behind
the writer; reads go straight into the target tensors. bfloat16 is stored as its uint16 bits with the
attribute `torch_dtype: bfloat16`. This module reads and writes the files
itself, without zarr. docs/checkpoints.md ("The zarr backend") has more.
"""
from __future__ import annotations

import contextlib
import json
import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path, PurePosixPath
from typing import Iterator, Optional

import torch

from megaresil.checkpoint.backends.base import Written
from megaresil.checkpoint.backends.dcp_read import narrowed
from megaresil.checkpoint.backends.file_io import (
    FsyncBehind,
    fsync_threads,
    prefetch,
    start_writeback,
)
from megaresil.checkpoint.backends.zarr_layout import ArrayLayout, Piece, runs
from megaresil.checkpoint.format import (
    CheckpointError,
    inside,
    naming_write_errors,
    tensor_bytes,
    torch_dtype,
)
from megaresil.checkpoint.sharded import Rect

METADATA = "zarr.json"
GROUP = {"zarr_format": 3, "node_type": "group", "attributes": {}}


def _write_json(path: Path, data: dict) -> None:
    with naming_write_errors(path):
        path.write_text(json.dumps(data, indent=1))


def _groups(keys) -> set[str]:
    """Every group a key lies in, the root ("") included."""
    return {"/".join(key.split("/")[:i]) for key in keys for i in range(key.count("/") + 1)}


def _pwrite_all(fd: int, data: memoryview, offset: int) -> None:
    while data:  # a short write (a file size limit) is followed by its error
        written = os.pwrite(fd, data, offset)
        data, offset = data[written:], offset + written


def _pread_into(fd: int, buffer: memoryview, offset: int, path: Path) -> None:
    while buffer:
        got = os.preadv(fd, [buffer], offset)
        if got == 0:
            raise CheckpointError(f"{path} is shorter than its zarr metadata says (truncated file)")
        buffer, offset = buffer[got:], offset + got


class ZarrBackend:
    name = "zarr"
    one_file_per_write = False

    def __init__(self) -> None:
        # Started at the first write and kept: an offline writer calls write
        # once per rect, and starting threads for each costs more than the fsyncs.
        self.threads: Optional[ThreadPoolExecutor] = None
        self.layouts: dict[str, ArrayLayout] = {}  # every planned array's, by key

    def _fsync_behind(self) -> FsyncBehind:
        if self.threads is None:
            self.threads = fsync_threads(4)
        return FsyncBehind(self.threads)

    def plan(self, layout_plan: dict[str, dict]) -> None:
        self.layouts = {key: ArrayLayout.planned(entry["global_shape"], entry["dtype"],
                                                 torch_dtype(entry["dtype"]).itemsize,
                                                 entry["rects"])
                        for key, entry in layout_plan.items()}

    def prepare(self, directory: Path) -> None:
        """The groups, and the arrays no writer starts (those without elements)."""
        root = directory / "zarr"
        for group in sorted(_groups(self.layouts)):
            (root / group).mkdir(parents=True, exist_ok=True)
            _write_json(root / group / METADATA, GROUP)
        for key in self._elementless():
            _start_array(root, key, self.layouts[key])

    def write(self, directory: Path, rects: list[Rect], rank: int) -> Written:
        root = directory / "zarr"
        flushing = self._fsync_behind()
        for rect in rects:
            if rect.tensor.numel():
                _write_rect(root, rect, self.layouts[rect.key], flushing)
        return Written({r.identity(): f"zarr/{r.key}" for r in rects},
                       note=sorted({r.key for r in rects}), durable=flushing.wait)

    def finish(self, directory: Path, notes: list[list[str]]) -> None:
        """The groups' metadata and the elementless arrays' made durable (an
        array's is made durable by the writer of its first element);
        `notes`: every write's keys."""
        flushing = self._fsync_behind()
        for group in sorted(_groups({key for keys in notes for key in keys})):
            flushing.add(directory / "zarr" / group / METADATA)
        for key in self._elementless():
            flushing.add(directory / "zarr" / key / METADATA)
        flushing.wait()

    def _elementless(self) -> list[str]:
        return sorted(key for key, layout in self.layouts.items() if 0 in layout.shape)

    def read(self, directory: Path, manifest: dict, targets: list[Rect]) -> None:
        root = inside(directory, "zarr")
        reads: dict[Path, list[tuple[Rect, ArrayLayout, tuple, Piece]]] = {}
        keys = sorted({t.key for t in targets})
        # Many small files, each a wait for the disk from a cold cache: read at once.
        with ThreadPoolExecutor(max_workers=8, thread_name_prefix="ckpt-read") as pool:
            layouts = dict(zip(keys, pool.map(lambda key: _layout_of(root, key), keys)))
        for target in targets:
            layout = layouts[target.key]
            for shard, pieces in layout.pieces(target.offset, target.shape).items():
                path = _array_dir(root, target.key) / layout.file_name(shard)
                reads.setdefault(path, []).extend((target, layout, shard, p) for p in pieces)
        _read_files(reads)


def _array_dir(root: Path, key: str) -> Path:
    """`root / key`, refusing a key (from a manifest) that would leave
    `root`: checked by its parts, as resolving every path is slow."""
    parts = PurePosixPath(key).parts
    if not parts or key.startswith("/") or any(p in ("..", ".") for p in parts):
        raise CheckpointError(f"manifest names a file outside the checkpoint: {key!r}")
    return root / key


def _layout_of(root: Path, key: str) -> ArrayLayout:
    path = _array_dir(root, key) / METADATA
    try:
        return ArrayLayout.parse(path.read_text())
    except FileNotFoundError:
        raise CheckpointError(f"the checkpoint's zarr store has no array {key!r} ({path} "
                              "is missing)") from None
    except (ValueError, KeyError, IndexError) as err:
        raise CheckpointError(f"{path} describes an array megaresil cannot read: {err}") from None


# --- writing --------------------------------------------------------------------------


def _start_array(root: Path, key: str, layout: ArrayLayout, metadata: bool = True) -> None:
    """The array's directory (made by each of its writers: whichever comes
    first), with its metadata where asked."""
    with naming_write_errors(root / key):
        (root / key).mkdir(exist_ok=True)
    if metadata:
        _write_json(root / key / METADATA, layout.metadata())


def _write_rect(root: Path, rect: Rect, layout: ArrayLayout, flushing: FsyncBehind) -> None:
    first = layout.origin_in(next(iter(layout.shards())), rect.offset, rect.shape)
    _start_array(root, rect.key, layout, metadata=first)  # one writer holds the first element
    if first:
        flushing.add(root / rect.key / METADATA)
    for shard, pieces in layout.pieces(rect.offset, rect.shape).items():
        path = root / rect.key / layout.file_name(shard)
        with naming_write_errors(path):
            fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o644)
            try:
                for piece in pieces:
                    _write_piece(fd, layout, shard, piece, rect.tensor)
                if layout.sharded and layout.origin_in(shard, rect.offset, rect.shape):
                    _pwrite_all(fd, memoryview(layout.index(shard)), layout.data_size(shard))
            finally:
                os.close(fd)
        flushing.add(path)


def _write_piece(fd: int, layout: ArrayLayout, shard: tuple, piece: Piece,
                 tensor: torch.Tensor) -> None:
    """The piece's bytes to its place in the shard file: one write where it
    is contiguous in the chunk (whole rows), else one per run."""
    data = tensor_bytes(narrowed(tensor, piece.at, piece.shape))  # copies only a strided piece
    start = layout.chunk_offset(shard, piece.chunk)
    done = 0
    for first, length in runs(layout.inner, piece.within, piece.shape):
        size = length * layout.itemsize
        _pwrite_all(fd, data[done:done + size], start + first * layout.itemsize)
        done += size
    start_writeback(fd, start, start + layout.chunk_bytes)


# --- reading --------------------------------------------------------------------------


def _read_files(reads: dict[Path, list]) -> None:
    """Every piece, file by file. Every file's index is asked for in one
    sweep, then read; while one file's pieces are read, the next file's are
    asked for."""
    paths = sorted(reads)
    layouts = {path: reads[path][0][1] for path in paths}
    for path in paths:
        with _opened(path) as fd:
            _prefetch_index(fd, layouts[path])
    indexes = {}
    for path in paths:
        with _opened(path) as fd:
            indexes[path] = _read_index(fd, path, layouts[path])
    for path, following in zip(paths, [*paths[1:], None]):
        if following is not None:
            with _opened(following) as fd:
                prefetch(fd, _ranges(following, reads[following], indexes[following]))
        with _opened(path) as fd:
            for target, layout, _, piece in sorted(reads[path], key=lambda r: r[3].chunk):
                _read_piece(fd, path, layout, indexes[path], piece, target)


@contextlib.contextmanager
def _opened(path: Path) -> Iterator[int]:
    try:
        fd = os.open(path, os.O_RDONLY)
    except FileNotFoundError:
        raise CheckpointError(f"{path} is missing from the checkpoint") from None
    try:
        yield fd
    finally:
        os.close(fd)


def _prefetch_index(fd: int, layout: ArrayLayout) -> None:
    size = os.fstat(fd).st_size
    prefetch(fd, [(max(0, size - layout.index_size()), layout.index_size())])


def _read_index(fd: int, path: Path, layout: ArrayLayout):
    if not layout.sharded:
        return None
    size = os.fstat(fd).st_size
    if size < layout.index_size():
        raise CheckpointError(f"{path} is shorter than its zarr metadata says (truncated file)")
    raw = bytearray(layout.index_size())
    _pread_into(fd, memoryview(raw), size - len(raw), path)
    return layout.read_index(bytes(raw))


def _chunk_at(index, layout: ArrayLayout, piece: Piece, path: Path) -> int:
    """Where the piece's inner chunk starts in its file."""
    if index is None:
        return 0
    start, length = (int(v) for v in index[piece.chunk])
    if length != layout.chunk_bytes:
        raise CheckpointError(f"{path}: chunk {piece.chunk} is absent or not stored plainly "
                              f"({length} bytes, expected {layout.chunk_bytes})")
    return start


def _ranges(path: Path, pieces: list, index) -> list[tuple[int, int]]:
    return [(_chunk_at(index, layout, piece, path), layout.chunk_bytes)
            for _, layout, _, piece in pieces]


def _read_piece(fd: int, path: Path, layout: ArrayLayout, index, piece: Piece,
                target: Rect) -> None:
    start = _chunk_at(index, layout, piece, path)
    dest = narrowed(target.tensor, piece.at, piece.shape)
    stored = torch_dtype(layout.torch_dtype)
    spans = runs(layout.inner, piece.within, piece.shape)
    if len(spans) == 1 and dest.is_contiguous() and dest.dtype == stored \
            and dest.device.type == "cpu":
        first, length = spans[0]
        _pread_into(fd, tensor_bytes(dest), start + first * layout.itemsize, path)
        return
    chunk = torch.empty(layout.inner, dtype=stored)
    _pread_into(fd, tensor_bytes(chunk), start, path)
    dest.copy_(narrowed(chunk, piece.within, piece.shape))
