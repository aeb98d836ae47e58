"""zarr v3 backend: one array per key holding the global tensor.

Each rank writes its rects as regions of the arrays. The chunk grid of an
array is cut at every writer's rect boundary (per dimension, the gcd of the
inner boundaries), so each chunk belongs to exactly one writer and no two
ranks ever write the same chunk file. No compression: checkpoints are
write-bandwidth bound and float weights barely compress.

bfloat16, which zarr lacks, is stored as its uint16 bit pattern with the
array attribute `torch_dtype: bfloat16`; the round trip is exact. Any zarr
tool reads the arrays (bf16 ones as raw uint16 plus that attribute).
"""
from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import torch
import zarr

from megaresil.checkpoint.backends import Written
from megaresil.checkpoint.format import fsync_path, inside, naming_write_errors
from megaresil.checkpoint.sharded import Rect


def storage_dtype(torch_dtype: str) -> str:
    return "uint16" if torch_dtype == "bfloat16" else torch_dtype


def chunk_shape(global_shape: list[int], rects: list[dict]) -> tuple[int, ...]:
    chunks = []
    for dim, extent in enumerate(global_shape):
        inner = {b for r in rects for b in (r["offset"][dim], r["offset"][dim] + r["shape"][dim])}
        inner -= {0, extent}
        chunks.append(math.gcd(*inner) if inner else max(extent, 1))
    return tuple(chunks)


def to_numpy(tensor: torch.Tensor) -> np.ndarray:
    t = tensor.detach().cpu().contiguous()
    return t.view(torch.uint16).numpy() if t.dtype == torch.bfloat16 else t.numpy()


def from_numpy(array: np.ndarray, torch_dtype: str) -> torch.Tensor:
    t = torch.from_numpy(np.ascontiguousarray(array))
    return t.view(torch.bfloat16) if torch_dtype == "bfloat16" else t


def region(offset, shape) -> tuple[slice, ...]:
    return tuple(slice(o, o + n) for o, n in zip(offset, shape))


class ZarrBackend:
    name = "zarr"
    one_file_per_write = False

    def prepare(self, directory: Path, layout_plan: dict[str, dict]) -> None:
        with naming_write_errors(directory / "zarr"):
            root = zarr.open_group(str(directory / "zarr"), mode="w")
            for key, entry in layout_plan.items():
                root.create_array(key, shape=entry["global_shape"],
                                  chunks=chunk_shape(entry["global_shape"], entry["rects"]),
                                  dtype=storage_dtype(entry["dtype"]), compressors=None,
                                  fill_value=0, attributes={"torch_dtype": entry["dtype"]})

    def _chunk_files(self, array: zarr.Array, key: str, rect: Rect) -> list[Path]:
        """The chunk files a rect's region covers (for fsync)."""
        ranges = [range(o // c, (o + n - 1) // c + 1)
                  for o, n, c in zip(rect.offset, rect.shape, array.chunks)]
        paths = [Path(key) / "c"]
        for r in ranges:
            paths = [p / str(i) for p in paths for i in r]
        return paths

    def write(self, directory: Path, rects: list[Rect], rank: int) -> Written:
        # Every chunk becomes a file, all-zero ones included (zarr skips those
        # by default): the commit fsyncs exactly the files a rank wrote.
        with zarr.config.set({"array.write_empty_chunks": True}):
            return Written(self._write(directory, rects))

    def finish(self, directory: Path, notes: list) -> None:
        """Nothing: prepare() wrote every array's metadata."""

    def _write(self, directory: Path, rects: list[Rect]) -> dict[tuple, str]:
        root = zarr.open_group(str(directory / "zarr"), mode="r+")
        locations = {}
        for rect in rects:
            array = root[rect.key]
            if rect.tensor.numel():
                # zarr's errors name no file: the array's directory stands in.
                with naming_write_errors(directory / "zarr" / rect.key):
                    array[region(rect.offset, rect.shape)] = to_numpy(rect.tensor)
                for path in self._chunk_files(array, rect.key, rect):
                    with naming_write_errors(directory / "zarr" / path):
                        fsync_path(directory / "zarr" / path)
            locations[rect.identity()] = f"zarr/{rect.key}"
        return locations

    def read(self, directory: Path, manifest: dict, targets: list[Rect]) -> None:
        root = zarr.open_group(str(inside(directory, "zarr")), mode="r")
        for target in targets:
            torch_dtype = manifest["tensors"][target.key]["dtype"]
            data = root[target.key][region(target.offset, target.shape)]
            target.tensor.copy_(from_numpy(data, torch_dtype))

