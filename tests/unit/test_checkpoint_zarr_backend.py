"""The zarr backend's layout: each writer's rectangle one shard where the
writers' boundaries allow it, never more shard files than (tensor, writer)
pairs where they do not (tp=3 on a vocabulary 3 does not divide, ZeRO-1 row
blocks at dp=3), arrays that plain zarr reads as the global tensors (bf16 as
uint16 + attribute), and arrays of plain chunks (the earlier layout) still read.
Single process: the offline writer writes every planned rank's rects."""
from __future__ import annotations

import json
import math
import zlib
from pathlib import Path

import pytest
import torch
import zarr

from megaresil.checkpoint import format as fmt
from megaresil.checkpoint.validation import read_manifest
from megaresil.checkpoint.backends import get_backend, zarr_layout
from megaresil.checkpoint.backends.zarr_layout import choose_chunking
from megaresil.checkpoint.manager import Checkpointer
from megaresil.checkpoint.offline.writer import write_checkpoint
from megaresil.checkpoint.offline.planning import planned_rects, recipe_layout
from megaresil.checkpoint.sharded import Rect
from megaresil.checkpoint.state import RunRecord
from megaresil.cli import main
from megaresil.config import RecipeConfig, load_recipe, to_dict
from tests.harness.cli import ROOT



class GlobalTensors:
    """A source of whole global tensors (seeded by key): any region of the
    saved arrays can be checked against them."""

    def __init__(self, cfg: RecipeConfig):
        one = load_recipe(ROOT / "recipes/gpt-tiny.yaml", ["parallel.tp=1", "parallel.pp=1",
                                                           "parallel.dp=1"])
        self.full = {r.key: torch.randn(r.global_shape, generator=torch.Generator().manual_seed(
            zlib.crc32(r.key.encode()))) for r in planned_rects(one, weights_only=False)[0]}
        self.tensors = {key: {"global_shape": list(t.shape), "dtype": "float32"}
                        for key, t in self.full.items()}

    def read(self, targets) -> None:
        for target in targets:
            region = tuple(slice(o, o + n) for o, n in zip(target.offset, target.shape))
            target.tensor.copy_(self.full[target.key][region])


def state_of(cfg: RecipeConfig) -> RunRecord:
    return RunRecord(step=1, layout=recipe_layout(cfg), recipe=to_dict(cfg), consumed_samples=0,
                    optimizer_steps=1)


def data_files(checkpoint: Path) -> list[Path]:
    return [p for p in (checkpoint / "zarr").rglob("*") if p.is_file() and p.name != "zarr.json"]


def gcd_grid_files(entry: dict) -> int:
    """Chunk files of a grid cut at the gcd of the writers' boundaries (the
    earlier layout): how hard the split is."""
    files = 1
    for dim, extent in enumerate(entry["global_shape"]):
        bounds = {b for s in entry["shards"] for b in (s["offset"][dim], s["offset"][dim] + s["shape"][dim])}
        files *= -(-extent // math.gcd(*(bounds - {0, extent}) or {extent}))
    return files


def test_uneven_split_keeps_one_file_per_writer_and_reads_with_plain_zarr(tmp_path, monkeypatch):
    # Inner chunks smaller than the tensors, so pieces straddle chunks and shards.
    monkeypatch.setattr(zarr_layout, "INNER_CHUNK_BYTES", 64 << 10)
    cfg = load_recipe(ROOT / "recipes/gpt-tiny.yaml",
                      ["parallel.tp=3", "parallel.pp=1", "parallel.dp=3",
                       "optimizer.distributed=true", "train.global_batch_size=12"])
    assert cfg.model.vocab_size % 3
    source = GlobalTensors(cfg)
    checkpoint = write_checkpoint(source, cfg, tmp_path / "ckpt", backend="zarr",
                                  weights_only=False, state=state_of(cfg), overwrite=False)
    manifest = read_manifest(checkpoint)
    pairs = sum(len(entry["shards"]) for entry in manifest["tensors"].values())
    assert sum(gcd_grid_files(e) for e in manifest["tensors"].values()) > 3 * pairs
    assert len(data_files(checkpoint)) <= pairs

    assert main(["ckpt", "verify", str(checkpoint)]) == 0
    store = zarr.open_group(str(checkpoint / "zarr"), mode="r")
    whole = []
    for key, full in source.full.items():
        assert torch.equal(torch.from_numpy(store[key][...]), full), key
        whole.append(Rect(key, tuple(full.shape), (0,) * full.ndim, torch.empty_like(full)))
    get_backend("zarr").read(checkpoint, manifest, whole)  # every tensor from every writer's rect
    assert all(torch.equal(r.tensor, source.full[r.key]) for r in whole)


def test_even_split_makes_each_writer_rect_one_shard():
    rows = [{"offset": [256 * i, 0], "shape": [256, 64]} for i in range(4)]
    assert choose_chunking([1024, 64], 4, rows) == ((256, 64), (256, 64))
    # A prime extent has no divisor near the inner chunk's size: the shard
    # grows past the array's edge instead, still one per writer.
    cols = [{"offset": [0, 96 * i], "shape": [50257, 96]} for i in range(2)]
    shard, inner = choose_chunking([50257, 192], 2, cols)
    assert shard[0] >= 50257 and shard[1] == 96 and inner[1] == 96
    assert (4 << 20) // 2 >= inner[0] * inner[1] >= (1 << 20) // 2


class NoEvents:
    def emit(self, event: str, **fields) -> None:
        pass


def test_bf16_is_uint16_with_its_dtype_for_plain_zarr_and_a_missing_shard_fails_verify(tmp_path):
    weights = torch.randn(300, 5).to(torch.bfloat16)
    ckpt = Checkpointer(tmp_path, "zarr", group=None, asynchronous=False, keep=1,
                        events=NoEvents(), device=torch.device("cpu"))
    ckpt.save([Rect("model/w", (300, 5), (0, 0), weights)], state_of(RecipeConfig()), {})
    ckpt.close()
    checkpoint = tmp_path / fmt.step_dir_name(1)
    array = zarr.open_array(str(checkpoint / "zarr" / "model" / "w"), mode="r")
    assert isinstance(array.metadata.codecs[0], zarr.codecs.ShardingCodec)
    assert array.dtype == "uint16" and array.attrs["torch_dtype"] == "bfloat16"
    assert torch.equal(torch.from_numpy(array[...]).view(torch.bfloat16), weights)
    assert main(["ckpt", "verify", str(checkpoint)]) == 0
    data_files(checkpoint)[0].unlink()
    assert main(["ckpt", "verify", str(checkpoint)]) == 1


def test_arrays_of_plain_chunks_still_read(tmp_path):
    """What megaresil wrote before shards: a regular grid of unsharded chunks."""
    values = torch.arange(60, dtype=torch.float32).view(10, 6)
    with zarr.config.set({"array.write_empty_chunks": True}):
        array = zarr.create_array(str(tmp_path / "zarr" / "w"), shape=(10, 6), chunks=(4, 3),
                                  dtype="float32", compressors=None, fill_value=0,
                                  attributes={"torch_dtype": "float32"})
        array[...] = values.numpy()
    target = Rect("w", (10, 6), (3, 1), torch.empty(5, 4))
    get_backend("zarr").read(tmp_path, {}, [target])
    assert torch.equal(target.tensor, values[3:8, 1:5])


def test_each_writer_starts_the_arrays_whose_first_element_it_writes(tmp_path):
    """Rank 0 no longer writes every array's metadata before anyone writes
    (the others waited for it): each array's first writer does, from the
    plan, with the same bytes; an array without elements is rank 0's."""
    plan = {"a/w": {"global_shape": [4, 6], "dtype": "float32",
                    "rects": [{"offset": [0, 0], "shape": [2, 6]}, {"offset": [2, 0], "shape": [2, 6]}]},
            "a/empty": {"global_shape": [0, 3], "dtype": "float32",
                        "rects": [{"offset": [0, 0], "shape": [0, 3]}]}}
    full = torch.arange(24, dtype=torch.float32).view(4, 6)
    first, second = get_backend("zarr"), get_backend("zarr")
    for backend in (first, second):
        backend.plan(plan)
    first.prepare(tmp_path)
    assert not (tmp_path / "zarr/a/w").exists()
    second.write(tmp_path, [Rect("a/w", (4, 6), (2, 0), full[2:])], 1).durable()
    assert not (tmp_path / "zarr/a/w/zarr.json").exists()  # not the first element's writer
    first.write(tmp_path, [Rect("a/w", (4, 6), (0, 0), full[:2])], 0).durable()
    first.finish(tmp_path, [["a/w"]])
    for key, entry in plan.items():
        layout = zarr_layout.ArrayLayout.planned(entry["global_shape"], "float32", 4, entry["rects"])
        written = (tmp_path / "zarr" / key / "zarr.json").read_text()
        assert written == json.dumps(layout.metadata(), indent=1), key
    assert torch.equal(torch.from_numpy(zarr.open_array(str(tmp_path / "zarr/a/w"), mode="r")[...]), full)
    assert zarr.open_array(str(tmp_path / "zarr/a/empty"), mode="r").shape == (0, 3)
