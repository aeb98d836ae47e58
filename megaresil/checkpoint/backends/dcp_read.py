"""Reading a region of a chunk in DCP's files straight into its target.

DCP's FileSystemReader torch.loads every saved chunk it touches whole, then
copies the overlap into the target: each byte is copied twice, into a fresh
allocation of the whole chunk. A chunk is a torch.save zip whose tensor data
is one uncompressed record, so when the saved tensor is row-major we read just
the rows of the overlap from the file, straight into the target when the rows
are whole and the target is a contiguous CPU tensor. The chunk's size, stride
and dtype come from torch.load onto the meta device (weights only, no data
read); any other layout is read DCP's way.

DCP's metadata file is a pickle; SafeReader reads it with an unpickler that
admits only DCP's metadata classes, so loading never runs pickled code.
"""
from __future__ import annotations

import io
import math
import os
import pathlib
import pickle
from pathlib import Path
from typing import Any, BinaryIO, Optional, Sequence, cast

import torch
import torch.distributed.checkpoint as dcp
import torch.distributed.checkpoint.metadata as metadata_classes
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner
from torch.futures import Future

from megaresil.checkpoint.format import CheckpointError, inside, tensor_bytes
from megaresil.compat import dcp_metadata_private_globals, torch_save_data_record

# Where chunk_layout reads: a chunk's first and last bytes.
LAYOUT_HEAD, LAYOUT_TAIL = 32 << 10, 16 << 10


class FileSlice(io.RawIOBase):
    """Bytes [start, start + length) of an open file, as a file of their own.
    torch.load and zipfile read any such file object, though their stubs ask
    for an IO[bytes]: `as_io` gives it them under that type."""

    def __init__(self, file: io.BufferedReader, start: int, length: int):
        super().__init__()
        self.file, self.start, self.length, self.position = file, start, length, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self.position, io.SEEK_END: self.length}[whence]
        self.position = base + offset
        return self.position

    def tell(self) -> int:
        return self.position

    def as_io(self) -> BinaryIO:
        return cast(BinaryIO, self)

    def readinto(self, buffer) -> int:
        view = memoryview(buffer).cast("B")
        wanted = max(0, min(len(view), self.length - self.position))
        self.file.seek(self.start + self.position)
        got = self.file.readinto(view[:wanted]) or 0
        self.position += got
        return got


def narrowed(tensor: torch.Tensor, offsets: Sequence[int], lengths: Sequence[int]) -> torch.Tensor:
    for dim, (start, length) in enumerate(zip(offsets, lengths)):
        tensor = tensor.narrow(dim, start, length)
    return tensor


def _read_exactly(chunk: FileSlice, tensor: torch.Tensor) -> None:
    if chunk.readinto(tensor_bytes(tensor)) != tensor.nbytes:
        raise CheckpointError(f"a DCP chunk in {getattr(chunk.file, 'name', 'a file')} is "
                              "shorter than its metadata says (truncated file)")


def _damaged(chunk: FileSlice, err: Exception) -> CheckpointError:
    """A chunk torch.load cannot read: files that carry no digest (a
    Megatron checkpoint's) reach here damaged, megaresil's are verified first."""
    return CheckpointError(f"a DCP chunk in {getattr(chunk.file, 'name', 'a file')} is "
                           f"unreadable ({str(err).splitlines()[0]}): the file is damaged. "
                           "Fix: copy the checkpoint again.")


def chunk_layout(chunk: FileSlice) -> tuple[torch.Tensor, Optional[tuple[int, int]]]:
    """The saved tensor on the meta device (size, stride, dtype), and where
    its bytes lie in the chunk when they can be read in place: row-major,
    one uncompressed record of exactly its bytes; else None."""
    try:
        saved = torch.load(chunk.as_io(), map_location="meta", weights_only=True)
    except (RuntimeError, EOFError) as err:
        raise _damaged(chunk, err) from None
    if not (saved.is_contiguous() and saved.storage_offset() == 0):
        return saved, None
    record = torch_save_data_record(chunk.as_io())
    return saved, record if record is not None and record[1] == saved.nbytes else None


def prefetch_layouts(file: BinaryIO, chunks: list[tuple[int, int]]) -> None:
    """Ask the kernel to read the head and tail of every chunk (start,
    length) of `file` now, in one sweep: chunk_layout reads about twenty
    small pieces of them (the pickle and small records at the start, each on
    its own page in our files; the zip directory at the end), and from a cold
    page cache each piece waited for the disk in turn, which made up much of
    a load's time (bench/README.md). A no-op where posix_fadvise does not exist."""
    if not hasattr(os, "posix_fadvise"):
        return
    for start, length in chunks:
        os.posix_fadvise(file.fileno(), start, min(length, LAYOUT_HEAD), os.POSIX_FADV_WILLNEED)
        tail = min(length, LAYOUT_TAIL)
        os.posix_fadvise(file.fileno(), start + length - tail, tail, os.POSIX_FADV_WILLNEED)


def read_region(file: io.BufferedReader, start: int, length: int, offsets: Sequence[int],
                lengths: Sequence[int], target: torch.Tensor) -> None:
    """Fill `target` with the region (`offsets`, `lengths`) of the chunk that
    DCP saved at bytes [start, start + length) of `file`."""
    chunk = FileSlice(file, start, length)
    saved, record = chunk_layout(chunk)
    if record is None or saved.dtype != target.dtype:
        chunk.seek(0)
        try:
            whole = torch.load(chunk.as_io(), map_location="cpu", weights_only=True)
        except (RuntimeError, EOFError) as err:
            raise _damaged(chunk, err) from None
        target.copy_(narrowed(whole, offsets, lengths))
        return
    # A 0-d tensor is read as one row of one element.
    shape, offsets, lengths = tuple(saved.shape) or (1,), tuple(offsets) or (0,), tuple(lengths) or (1,)
    chunk.seek(record[0] + offsets[0] * math.prod(shape[1:]) * saved.element_size())
    dest = target.view(lengths)
    if lengths[1:] == shape[1:] and dest.is_contiguous() and dest.device.type == "cpu":
        _read_exactly(chunk, dest)
        return
    rows = torch.empty((lengths[0], *shape[1:]), dtype=saved.dtype)
    _read_exactly(chunk, rows)
    dest.copy_(narrowed(rows, (0, *offsets[1:]), lengths))


# What DCP's .metadata pickle names (torch 2.9-2.14's metadata.py and
# filesystem.py): its metadata dataclasses, the per-entry storage record,
# torch.Size, dtypes and layouts (by name), and a PosixPath checkpoint_id.
# Nothing else in those modules (Tensor, Path, FileSystemWriter, ...) is data.
_METADATA_MODULE = "torch.distributed.checkpoint.metadata"
_METADATA_CLASSES = ("Metadata", "MetadataIndex", "StorageMeta", "TensorStorageMetadata",
                     "BytesStorageMetadata", "ChunkStorageMetadata", "TensorProperties")
_ALLOWED = {(_METADATA_MODULE, name): getattr(metadata_classes, name)
            for name in _METADATA_CLASSES}
_ALLOWED.update({(module, name): value for module, name, value in (
    ("torch", "Size", torch.Size), ("pathlib", "PosixPath", pathlib.PosixPath),
    *dcp_metadata_private_globals())})


def _allowed_global(module: str, name: str) -> Any:
    if (module, name) in _ALLOWED:
        return _ALLOWED[module, name]
    if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
        return getattr(torch, name)
    raise pickle.UnpicklingError(f"refusing to load {module}.{name} from DCP metadata")


class _MetadataUnpickler(pickle.Unpickler):
    """Admits DCP's metadata dataclasses, torch dtypes/Size and paths (and
    `extra`, more such data classes by name); nothing that can run code."""

    def __init__(self, file: BinaryIO, extra: dict[tuple[str, str], Any]):
        super().__init__(file)
        self.extra = extra

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in self.extra:
            return self.extra[module, name]
        return _allowed_global(module, name)


class SafeReader(dcp.FileSystemReader):
    """DCP's file reader with metadata unpickled safely, names kept inside the
    checkpoint, and each overlap's bytes read straight into its target. A
    reader of another writer's files admits that writer's data classes too
    (`extra_globals`)."""

    extra_globals: dict[tuple[str, str], Any] = {}

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        raw = Path(self.path, ".metadata").read_bytes()
        try:
            metadata = _MetadataUnpickler(io.BytesIO(raw), self.extra_globals).load()
        except (pickle.UnpicklingError, EOFError, AttributeError, ValueError) as err:
            raise CheckpointError(f"DCP metadata of {self.path} is unreadable: {err}") from None
        for relative in {str(info.relative_path) for info in (metadata.storage_data or {}).values()}:
            inside(Path(self.path), relative)
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future:
        """FileSystemReader's job, file by file, in file order."""
        by_file: dict[str, list] = {}
        for item in plan.items:
            stored = self.storage_data[item.storage_index]
            by_file.setdefault(stored.relative_path, []).append((stored, item))
        for relative, chunks in by_file.items():
            chunks.sort(key=lambda chunk: chunk[0].offset)
            with open(inside(Path(self.path), relative), "rb") as file:
                prefetch_layouts(file, [(stored.offset, stored.length) for stored, _ in chunks])
                for stored, item in chunks:
                    self._read_item(file, stored, item, planner)
        done: Future = Future()
        done.set_result(None)
        return done

    def _read_item(self, file, stored, item, planner: LoadPlanner) -> None:
        if item.type == LoadItemType.BYTE_IO or getattr(stored, "transform_descriptors", None):
            raise CheckpointError(f"{item.storage_index.fqn} in {self.path} is not a plain tensor "
                                  "chunk; this checkpoint was not written by megaresil")
        target = planner.resolve_tensor(item).detach()
        read_region(file, stored.offset, stored.length, item.storage_offsets, item.lengths, target)
        planner.commit_tensor(item, target)
