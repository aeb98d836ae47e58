"""torch_dist backend: PyTorch Distributed Checkpoint (DCP) files.

Our rects are handed to DCP through its planner interface: each key becomes
one saved tensor of its global shape, each rect a chunk at its offset, so DCP
computes the overlaps when a checkpoint is read into other rects (resharding).
Replicas were already deduplicated by our writer assignment, so DCP sees each
chunk once.

Each rank saves with DCP's no-collectives mode (its own `__<rank>_0.distcp`
file and plan), and one rank then writes the global `.metadata` from every
rank's plan and write results with DCP's own FileSystemWriter.finish: the
files are what a collective dcp.save writes, and plain `dcp.load` reads them,
but a save costs none of DCP's four planning and result collectives (the
checkpoint manager gathers the notes together with its own manifest records).

DCP's metadata file is a pickle; it is read with an unpickler that admits only
DCP's metadata classes, so loading never runs pickled code.
"""
from __future__ import annotations

import contextlib
import io
import warnings
import pathlib
import pickle
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed.checkpoint as dcp
from torch.futures import Future
import torch.utils.serialization.config as serialization_config
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.filesystem import DEFAULT_SUFFIX, _StorageInfo
from torch.distributed.checkpoint.metadata import (ChunkStorageMetadata, Metadata, MetadataIndex,
                                                   StorageMeta, TensorProperties,
                                                   TensorStorageMetadata)
from torch.distributed.checkpoint.planner import (LoadItemType, LoadPlan, LoadPlanner, SavePlan,
                                                  SavePlanner, TensorWriteData, WriteItem,
                                                  WriteItemType)
from torch.distributed.checkpoint.storage import WriteResult
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

from megaresil.checkpoint.backends import Written
from megaresil.checkpoint.backends.dcp_read import narrowed, read_region
from megaresil.checkpoint.format import CheckpointError, fsync_path, inside
from megaresil.checkpoint.sharded import Rect


class _Chunks:
    """All of one key's rects on this rank, in DCP's chunk vocabulary."""

    def __init__(self, rects: list[Rect]):
        self.global_shape = torch.Size(rects[0].global_shape)
        self.by_offset = {torch.Size(r.offset): r.tensor for r in rects}

    def chunk_list(self) -> list[ChunkStorageMetadata]:
        return [ChunkStorageMetadata(offsets=o, sizes=t.shape) for o, t in self.by_offset.items()]

    def __create_write_items__(self, fqn: str, _obj: Any) -> list[WriteItem]:
        """DCP's hook for tensor types it does not know (the one DTensor uses)."""
        return [WriteItem(index=MetadataIndex(fqn, offset), type=WriteItemType.SHARD,
                          tensor_data=TensorWriteData(
                              chunk=ChunkStorageMetadata(offsets=offset, sizes=t.shape),
                              properties=TensorProperties.create_from_tensor(t),
                              size=self.global_shape))
                for offset, t in self.by_offset.items()]


def _group(rects: list[Rect]) -> dict[str, _Chunks]:
    by_key: dict[str, list[Rect]] = {}
    for rect in rects:
        by_key.setdefault(rect.key, []).append(rect)
    return {key: _Chunks(group) for key, group in by_key.items()}


class _SavePlanner(DefaultSavePlanner):
    def __init__(self) -> None:
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)

    def lookup_object(self, index: MetadataIndex) -> Any:
        return self.state_dict[index.fqn].by_offset[index.offset]


# Chunks of at least _ALIGNED_FROM bytes start on page boundaries, and so
# does their tensor data; smaller ones are packed (padding them would waste
# more than the alignment gains).
_PAGE = 4096
_ALIGNED_FROM = 1 << 20


class _RankWriter(dcp.FileSystemWriter):
    """DCP's file writer in its no-collectives mode under rank `rank`'s file
    prefix, keeping its write results for the global metadata instead of
    writing a per-rank metadata file.

    Its own `write_data` lays large chunks out page-aligned: DCP's packs
    each torch.save zip right after the previous one, so a chunk's data
    starts at an arbitrary offset, and writing 2 GB that way measured about
    5% slower than at page boundaries. The offsets are recorded as DCP's
    writer records them, so its reader (and ours) finds every chunk."""

    def __init__(self, path: Path, rank: int):
        super().__init__(str(path), sync_files=False)  # see TorchDistBackend.write
        self.writer_rank = rank
        self.results: list = []

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        super().set_up_storage_writer(is_coordinator, rank=self.writer_rank, use_collectives=False)

    def finish(self, metadata: Metadata, results: list[list]) -> None:
        self.results = [result for rank_results in results for result in rank_results]

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future:
        name = f"{plan.storage_data.prefix}0{DEFAULT_SUFFIX}"
        results = []
        with open(Path(self.path) / name, "wb") as stream:
            for item in plan.items:
                tensor = _compact(planner.resolve_data(item).detach())
                aligned = tensor.nbytes >= _ALIGNED_FROM
                if aligned:
                    stream.write(bytes(-stream.tell() % _PAGE))
                start = stream.tell()
                with (serialization_config.patch("save.storage_alignment", _PAGE) if aligned
                      else contextlib.nullcontext()):
                    torch.save(tensor, stream)
                length = stream.tell() - start
                results.append(WriteResult(index=item.index, size_in_bytes=length,
                                           storage_data=_StorageInfo(name, start, length)))
        written: Future = Future()
        written.set_result(results)
        return written


def _compact(tensor: torch.Tensor) -> torch.Tensor:
    """A row-major tensor owning exactly its bytes (torch.save writes a
    view's whole storage), as DCP's own writer ensures."""
    if tensor.is_contiguous() and tensor.untyped_storage().nbytes() == tensor.nbytes:
        return tensor
    return tensor.clone(memory_format=torch.contiguous_format)


def _merged(notes: list[tuple[dict, list]]) -> tuple[Metadata, list[list]]:
    """One Metadata of every rank's chunks, and every rank's write results."""
    tensors: dict[str, TensorStorageMetadata] = {}
    for rank_tensors, _ in notes:
        for fqn, saved in rank_tensors.items():
            tensors.setdefault(fqn, TensorStorageMetadata(saved.properties, saved.size, []))
            tensors[fqn].chunks.extend(saved.chunks)
    return Metadata(state_dict_metadata=tensors), [results for _, results in notes]


class _LoadPlanner(LoadPlanner):
    """Reads the overlap of the saved chunks with each target rect."""

    def set_up_planner(self, state_dict, metadata=None, is_coordinator=False) -> None:
        self.targets, self.metadata = state_dict, metadata

    def create_local_plan(self) -> LoadPlan:
        items = []
        for fqn, chunks in self.targets.items():
            saved = self.metadata.state_dict_metadata.get(fqn)
            if saved is None:
                raise CheckpointError(f"the checkpoint's DCP files have no tensor {fqn!r}")
            items += create_read_items_for_chunk_list(fqn, saved, chunks.chunk_list())
        return LoadPlan(items)

    def create_global_plan(self, global_plan):
        return global_plan

    def finish_plan(self, central_plan):
        return central_plan

    def load_bytes(self, read_item, value) -> None:
        raise CheckpointError(f"unexpected non-tensor item {read_item.dest_index.fqn!r}")

    def resolve_tensor(self, read_item) -> torch.Tensor:
        tensor = self.targets[read_item.dest_index.fqn].by_offset[read_item.dest_index.offset]
        return narrowed(tensor, read_item.dest_offsets, read_item.lengths)

    def commit_tensor(self, read_item, tensor) -> None:
        """Nothing to do: resolve_tensor handed out a view of the target."""


_ALLOWED_MODULES = ("torch.distributed.checkpoint.metadata", "torch.distributed.checkpoint.filesystem")


class _MetadataUnpickler(pickle.Unpickler):
    """Admits DCP's metadata dataclasses, torch dtypes/Size and paths; nothing
    that can run code."""

    def find_class(self, module: str, name: str) -> Any:
        if module in _ALLOWED_MODULES and isinstance(getattr(__import__(module, fromlist=[name]),
                                                             name, None), type):
            return getattr(__import__(module, fromlist=[name]), name)
        if module == "torch" and (name == "Size" or isinstance(getattr(torch, name, None),
                                                                 torch.dtype)):
            return getattr(torch, name)
        if module == "torch.serialization" and name == "_get_layout":
            return torch.serialization._get_layout
        if module == "pathlib" and name in ("PosixPath", "WindowsPath", "PurePosixPath"):
            return getattr(pathlib, name)
        raise pickle.UnpicklingError(f"refusing to load {module}.{name} from DCP metadata")


class _SafeReader(dcp.FileSystemReader):
    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        raw = Path(self.path, ".metadata").read_bytes()
        try:
            metadata = _MetadataUnpickler(io.BytesIO(raw)).load()
        except (pickle.UnpicklingError, EOFError, AttributeError, ValueError) as err:
            raise CheckpointError(f"DCP metadata of {self.path} is unreadable: {err}") from None
        for relative in {str(info.relative_path) for info in (metadata.storage_data or {}).values()}:
            inside(Path(self.path), relative)
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future:
        """FileSystemReader's job, with each overlap's bytes read straight
        into its target (dcp_read.py), file by file, in file order."""
        by_file: dict[str, list] = {}
        for item in plan.items:
            by_file.setdefault(self.storage_data[item.storage_index].relative_path, []).append(item)
        for relative, items in by_file.items():
            with open(inside(Path(self.path), relative), "rb") as file:
                for item in sorted(items, key=lambda i: self.storage_data[i.storage_index].offset):
                    self._read_item(file, item, planner)
        done: Future = Future()
        done.set_result(None)
        return done

    def _read_item(self, file, item, planner: LoadPlanner) -> None:
        stored = self.storage_data[item.storage_index]
        if item.type == LoadItemType.BYTE_IO or getattr(stored, "transform_descriptors", None):
            raise CheckpointError(f"{item.storage_index.fqn} in {self.path} is not a plain tensor "
                                  "chunk; this checkpoint was not written by megaresil")
        target = planner.resolve_tensor(item).detach()
        read_region(file, stored.offset, stored.length, item.storage_offsets, item.lengths, target)
        planner.commit_tensor(item, target)


@contextlib.contextmanager
def _quiet_single_process():
    """DCP warns whenever it runs without a process group, which is our
    intent for single-process saves and for every read."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def _fsynced_in_background(files: set[Path]) -> Callable[[], None]:
    """fsync `files` on a thread (fsync releases the GIL), so the caller's
    checksums overlap the flush to disk; the returned wait re-raises its error."""
    pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ckpt-fsync")
    flushed = pool.submit(lambda: [fsync_path(path) for path in sorted(files)])
    pool.shutdown(wait=False)
    return flushed.result


class TorchDistBackend:
    name = "torch_dist"

    def prepare(self, directory: Path, layout_plan: dict[str, dict]) -> None:
        (directory / "dcp").mkdir()

    def write(self, directory: Path, rects: list[Rect], rank: int) -> Written:
        writer = _RankWriter(directory / "dcp", rank)
        # DCP stores each chunk as a torch.save zip, whose CRC-32 costs a
        # third of the write time and is never checked (torch.load does not
        # read it); the manifest's xxh3 checksums, checked at every start-up,
        # cover the same bytes. Files stay loadable by plain DCP.
        with _quiet_single_process(), serialization_config.patch("save.compute_crc32", False):
            metadata = dcp.save(_group([r for r in rects if r.tensor.numel()]),
                                storage_writer=writer, planner=_SavePlanner(), no_dist=True)
        files = {directory / "dcp" / result.storage_data.relative_path for result in writer.results}
        return Written({r.identity(): "dcp" for r in rects},
                       note=(metadata.state_dict_metadata, writer.results),
                       durable=_fsynced_in_background(files))

    def finish(self, directory: Path, notes: list[tuple[dict, list]]) -> None:
        """DCP's global `.metadata`, written (and fsynced) by DCP itself."""
        metadata, results = _merged(notes)
        dcp.FileSystemWriter(str(directory / "dcp"), sync_files=True).finish(metadata, results)

    def read(self, directory: Path, manifest: dict, targets: list[Rect]) -> None:
        targets = [t for t in targets if t.tensor.numel()]
        if not targets:
            return
        with _quiet_single_process():  # each rank reads what it needs on its own
            dcp.load(_group(targets), storage_reader=_SafeReader(str(inside(directory, "dcp"))),
                     planner=_LoadPlanner(), no_dist=True)
