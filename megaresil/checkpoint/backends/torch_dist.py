"""torch_dist backend: PyTorch Distributed Checkpoint (DCP) files.

Our rects are handed to DCP through its planner interface: each key becomes
one saved tensor of its global shape, each rect a chunk at its offset, so DCP
computes the overlaps when a checkpoint is read into other rects (resharding).
Replicas were already deduplicated by our writer assignment, so DCP sees each
chunk once. DCP's own metadata file is a pickle; it is read with an unpickler
that admits only DCP's metadata classes, so loading never runs pickled code.
"""
from __future__ import annotations

import contextlib
import io
import warnings
import pathlib
import pickle
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.metadata import (ChunkStorageMetadata, Metadata, MetadataIndex,
                                                   StorageMeta, TensorProperties)
from torch.distributed.checkpoint.planner import (LoadPlan, LoadPlanner, TensorWriteData,
                                                  WriteItem, WriteItemType)
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

from megaresil.checkpoint.format import CheckpointError, inside
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
        for dim, (start, length) in enumerate(zip(read_item.dest_offsets, read_item.lengths)):
            tensor = tensor.narrow(dim, start, length)
        return tensor

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


@contextlib.contextmanager
def _quiet_single_process():
    """DCP warns whenever it runs without a process group, which is our
    intent for single-process saves and for every read."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


class TorchDistBackend:
    name = "torch_dist"

    def __init__(self, process_group=None) -> None:
        self.process_group = process_group

    def prepare(self, directory: Path, layout_plan: dict[str, dict]) -> None:
        (directory / "dcp").mkdir()

    def write(self, directory: Path, rects: list[Rect]) -> dict[tuple, str]:
        writer = dcp.FileSystemWriter(str(directory / "dcp"), sync_files=True, thread_count=1)
        with _quiet_single_process():
            dcp.save(_group([r for r in rects if r.tensor.numel()]), storage_writer=writer,
                     planner=_SavePlanner(), process_group=self.process_group,
                     no_dist=self.process_group is None)
        return {r.identity(): "dcp" for r in rects}

    def read(self, directory: Path, manifest: dict, targets: list[Rect]) -> None:
        targets = [t for t in targets if t.tensor.numel()]
        if not targets:
            return
        with _quiet_single_process():  # each rank reads what it needs on its own
            dcp.load(_group(targets), storage_reader=_SafeReader(str(inside(directory, "dcp"))),
                     planner=_LoadPlanner(), no_dist=True)
