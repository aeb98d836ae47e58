"""torch_dist backend: PyTorch Distributed Checkpoint (DCP) files.

Our rects are handed to DCP through its planner interface: each key becomes
one saved tensor of its global shape, each rect a chunk at its offset, so DCP
computes the overlaps when a checkpoint is read into other rects (resharding).
Replicas were already deduplicated by our writer assignment, so DCP sees each
chunk once.

Writing (dcp_write.py): each rank saves on its own, one rank writes DCP's
global metadata. Reading (dcp_read.py): safe metadata, bytes straight into
their targets. Plain `dcp.load` reads the files too.
"""
from __future__ import annotations

import contextlib
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    MetadataIndex,
    TensorProperties,
)
from torch.distributed.checkpoint.planner import (
    LoadPlan,
    LoadPlanner,
    TensorWriteData,
    WriteItem,
    WriteItemType,
)
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

from megaresil.checkpoint.backends.base import Written
from megaresil.checkpoint.backends.dcp_read import SafeReader, narrowed
from megaresil.checkpoint.backends.dcp_write import RankWriter, fsynced_in_background, merged
from megaresil.checkpoint.format import CheckpointError, inside, naming_write_errors
from megaresil.checkpoint.sharded import Rect


class Chunks:
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


def by_key(rects: list[Rect]) -> dict[str, Chunks]:
    """Rects grouped into each key's Chunks: the state dict DCP saves or loads."""
    grouped: dict[str, list[Rect]] = {}
    for rect in rects:
        grouped.setdefault(rect.key, []).append(rect)
    return {key: Chunks(group) for key, group in grouped.items()}


class ChunkSavePlanner(DefaultSavePlanner):
    """Saves a `by_key` state dict: each chunk where its rect lies."""

    def __init__(self) -> None:
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)

    def lookup_object(self, index: MetadataIndex) -> Any:
        return self.state_dict[index.fqn].by_offset[index.offset]


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


@contextlib.contextmanager
def quiet_single_process():
    """DCP warns whenever it runs without a process group, which is our
    intent for single-process saves and for every read."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


@contextlib.contextmanager
def own_errors():
    """A failure inside dcp.save or dcp.load as itself: DCP wraps it, with its
    traceback as text, in a CheckpointException, a BaseException that
    `except Exception` misses; a write error (RankWriter's CheckpointError)
    then reads as one line again."""
    try:
        yield
    except CheckpointException as err:
        failures = [failure for failure, _traceback in err.failures.values()]
        if not failures:
            raise
        raise failures[0] from None


class TorchDistBackend:
    name = "torch_dist"
    one_file_per_write = True

    def plan(self, layout_plan: dict[str, dict]) -> None:
        pass  # a DCP save lays out each writer's file from its own rects

    def prepare(self, directory: Path) -> None:
        with naming_write_errors(directory / "dcp"):
            (directory / "dcp").mkdir()

    def write(self, directory: Path, rects: list[Rect], rank: int) -> Written:
        writer = RankWriter(directory / "dcp", rank)
        with quiet_single_process(), own_errors():
            metadata = dcp.save(by_key([r for r in rects if r.tensor.numel()]),
                                storage_writer=writer, planner=ChunkSavePlanner(), no_dist=True)
        files = {directory / "dcp" / result.storage_data.relative_path for result in writer.results}
        return Written({r.identity(): "dcp" for r in rects},
                       note=(metadata.state_dict_metadata, writer.results),
                       durable=fsynced_in_background(files))

    def finish(self, directory: Path, notes: list[tuple[dict, list]]) -> None:
        """DCP's global `.metadata`, written (and fsynced) by DCP itself."""
        metadata, results = merged(notes)
        with naming_write_errors(directory / "dcp" / ".metadata"):
            dcp.FileSystemWriter(str(directory / "dcp"), sync_files=True).finish(metadata, results)

    def read(self, directory: Path, manifest: dict, targets: list[Rect]) -> None:
        read_dcp(SafeReader(str(inside(directory, "dcp"))), targets)


def read_dcp(reader: SafeReader, targets: list[Rect]) -> None:
    """Fill the target rects from the DCP files `reader` reads."""
    targets = [t for t in targets if t.tensor.numel()]
    if not targets:
        return
    with quiet_single_process(), own_errors():  # each rank reads what it needs on its own
        dcp.load(by_key(targets), storage_reader=reader, planner=_LoadPlanner(), no_dist=True)
