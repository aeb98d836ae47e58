"""Reading a region of a chunk in DCP's files straight into its target.

DCP's FileSystemReader torch.loads every saved chunk it touches whole, then
copies the overlap into the target: each byte is copied twice, into a fresh
allocation of the whole chunk. A chunk is a torch.save zip whose tensor data
is one uncompressed record, so when the saved tensor is row-major we read just
the rows of the overlap from the file, straight into the target when the rows
are whole and the target is a contiguous CPU tensor. The chunk's size, stride
and dtype come from torch.load onto the meta device (weights only, no data
read); any other layout is read DCP's way.
"""
from __future__ import annotations

import io
import math
import struct
import zipfile
from typing import BinaryIO, Optional, Sequence

import torch

from megaresil.checkpoint.format import CheckpointError, tensor_bytes

# A zip local file header: signature, 22 bytes we skip, name and extra-field lengths.
_LOCAL_HEADER = struct.Struct("<4s22xHH")
_LOCAL_SIGNATURE = b"PK\x03\x04"


class FileSlice(io.RawIOBase):
    """Bytes [start, start + length) of an open file, as a file of their own."""

    def __init__(self, file: BinaryIO, start: int, length: int):
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


def _data_record(chunk: FileSlice) -> Optional[tuple[int, int]]:
    """Offset and size of the tensor data record in a torch.save zip; None
    unless there is exactly one, stored uncompressed."""
    with zipfile.ZipFile(chunk) as archive:
        records = [info for info in archive.infolist()
                   if info.filename.split("/")[-2:-1] == ["data"]]
    if len(records) != 1 or records[0].compress_type != zipfile.ZIP_STORED:
        return None
    chunk.seek(records[0].header_offset)
    signature, name_length, extra_length = _LOCAL_HEADER.unpack(chunk.read(_LOCAL_HEADER.size))
    if signature != _LOCAL_SIGNATURE:
        return None
    return records[0].header_offset + _LOCAL_HEADER.size + name_length + extra_length, \
        records[0].file_size


def _read_exactly(chunk: FileSlice, tensor: torch.Tensor) -> None:
    if chunk.readinto(tensor_bytes(tensor)) != tensor.nbytes:
        raise CheckpointError(f"a DCP chunk in {getattr(chunk.file, 'name', 'a file')} is "
                              "shorter than its metadata says (truncated file)")


def read_region(file: BinaryIO, start: int, length: int, offsets: Sequence[int],
                lengths: Sequence[int], target: torch.Tensor) -> None:
    """Fill `target` with the region (`offsets`, `lengths`) of the chunk that
    DCP saved at bytes [start, start + length) of `file`."""
    chunk = FileSlice(file, start, length)
    saved = torch.load(chunk, map_location="meta", weights_only=True)
    record = None
    if saved.is_contiguous() and saved.storage_offset() == 0 and saved.dtype == target.dtype:
        record = _data_record(chunk)
    if record is None or record[1] != saved.nbytes:
        chunk.seek(0)
        whole = torch.load(chunk, map_location="cpu", weights_only=True)
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
