"""Writing DCP's files from each rank on its own.

Each rank saves with DCP's no-collectives mode: its own plan and its own
`__<rank>_0.distcp` file (RankWriter). One rank then writes the global
`.metadata` from every rank's plan and write results (`merged`, then DCP's own
FileSystemWriter.finish): the files are what a collective dcp.save writes and
plain `dcp.load` reads them, but a save costs none of DCP's four planning and
result collectives; the checkpoint manager gathers the notes together with its
own manifest records.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, BinaryIO, Callable, Optional, cast

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.filesystem import DEFAULT_SUFFIX
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner
from torch.distributed.checkpoint.storage import WriteResult
from torch.futures import Future

from megaresil.checkpoint.backends.file_io import PAGE, FsyncBehind, fsync_threads, start_writeback
from megaresil.checkpoint.format import naming_write_errors
from megaresil.compat import dcp_storage_info, torch_save_options

# Chunks of at least _ALIGNED_FROM bytes start on page boundaries, and so
# does their tensor data; smaller ones are packed (padding them would waste
# more than the alignment gains).
_ALIGNED_FROM = 1 << 20
# Writeback of what is written is started every _WRITEBACK_EVERY bytes.
_WRITEBACK_EVERY = 16 << 20


class EarlyWriteback:
    """Starts the disk writing a file's pages while later ones are still
    being copied into the page cache (file_io.start_writeback), every
    _WRITEBACK_EVERY bytes of a file written front to back."""

    def __init__(self, stream):
        self.stream, self.started_to = stream, 0

    def written(self) -> None:
        end = self.stream.tell() // PAGE * PAGE
        if end - self.started_to < _WRITEBACK_EVERY:
            return
        self.stream.flush()
        start_writeback(self.stream.fileno(), self.started_to, end)
        self.started_to = end


class RankWriter(dcp.FileSystemWriter):
    """DCP's file writer in its no-collectives mode under rank `rank`'s file
    prefix, keeping its write results for the global metadata instead of
    writing a per-rank metadata file.

    Its own `write_data` lays large chunks out page-aligned: DCP's packs
    each torch.save zip right after the previous one, so a chunk's data
    starts at an arbitrary offset, which writes slower than whole pages do
    (bench/checkpoint_io.py). The offsets are recorded as DCP's writer
    records them, so its reader (and ours) finds every chunk."""

    def __init__(self, path: Path, rank: int):
        super().__init__(str(path), sync_files=False)  # see fsynced_in_background
        self.writer_rank = rank
        self.results: list = []

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        super().set_up_storage_writer(is_coordinator, rank=self.writer_rank, use_collectives=False)

    def finish(self, metadata: Metadata, results: list[list]) -> None:
        self.results = [result for rank_results in results for result in rank_results]

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future:
        name = f"{plan.storage_data.prefix}0{DEFAULT_SUFFIX}"
        with naming_write_errors(Path(self.path) / name):
            results = self._write_file(name, plan, planner)
        written: Future = Future()
        written.set_result(results)
        return written

    def _write_file(self, name: str, plan: SavePlan, planner: SavePlanner) -> list[WriteResult]:
        results = []
        with open(Path(self.path) / name, "wb") as stream:
            writeback = EarlyWriteback(stream)
            for item in plan.items:
                data = planner.resolve_data(item)
                assert isinstance(data, torch.Tensor)  # megaresil's states hold tensors only
                tensor = _compact(data.detach())
                aligned = tensor.nbytes >= _ALIGNED_FROM
                if aligned:
                    stream.write(bytes(-stream.tell() % PAGE))
                start = stream.tell()
                # DCP stores each chunk as a torch.save zip, whose CRC-32
                # costs a large share of the write time and is never checked
                # (torch.load does not read it); the manifest's xxh3
                # checksums, checked at every start-up, cover the same bytes.
                with torch_save_options(crc32=False, alignment=PAGE if aligned else None):
                    _save_keeping_errno(tensor, stream)
                length = stream.tell() - start
                writeback.written()
                results.append(WriteResult(index=item.index, size_in_bytes=length,
                                           storage_data=dcp_storage_info(name, start, length)))
        return results


class _WriteErrorKept:
    """The file torch.save writes to, remembering the OSError a write raised:
    torch reports a failed write as its own RuntimeError ("unexpected pos"),
    which drops the errno (ENOSPC, EFBIG, ...)."""

    def __init__(self, stream: BinaryIO):
        self.stream = stream
        self.error: Optional[OSError] = None

    def write(self, data) -> int:
        try:
            return self.stream.write(data)
        except OSError as err:
            self.error = err
            raise

    def flush(self) -> None:
        self.stream.flush()


def _save_keeping_errno(tensor: torch.Tensor, stream: BinaryIO) -> None:
    """torch.save(tensor, stream), raising a failed write's own OSError."""
    kept = _WriteErrorKept(stream)
    try:
        torch.save(tensor, cast(BinaryIO, kept))  # any object with write and flush will do
    except RuntimeError:
        if kept.error is None:
            raise
        raise kept.error from None


def _compact(tensor: torch.Tensor) -> torch.Tensor:
    """A row-major tensor owning exactly its bytes (torch.save writes a
    view's whole storage), as DCP's own writer ensures."""
    if tensor.is_contiguous() and tensor.untyped_storage().nbytes() == tensor.nbytes:
        return tensor
    return tensor.clone(memory_format=torch.contiguous_format)


def merged(notes: list[tuple[dict, list]]) -> tuple[Metadata, list[list]]:
    """One Metadata of every rank's chunks, and every rank's write results."""
    tensors: dict[str, TensorStorageMetadata] = {}
    for rank_tensors, _ in notes:
        for fqn, saved in rank_tensors.items():
            tensors.setdefault(fqn, TensorStorageMetadata(saved.properties, saved.size, []))
            tensors[fqn].chunks.extend(saved.chunks)
    # A copy: Metadata's field is a dict of either kind of entry (invariant).
    return Metadata(state_dict_metadata=dict(tensors)), [results for _, results in notes]


def fsynced_in_background(files: set[Path]) -> Callable[[], None]:
    """fsync `files` on a thread, so the caller's checksums overlap the flush
    to disk; the returned wait re-raises its error."""
    threads = fsync_threads(1)
    flushing = FsyncBehind(threads)
    for path in sorted(files):
        flushing.add(path)
    threads.shutdown(wait=False)  # the thread ends once its queue is done
    return flushing.wait
