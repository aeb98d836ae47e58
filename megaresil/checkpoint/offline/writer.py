"""Writing a whole checkpoint at any layout from one process, streamed.

The offline counterpart of `Checkpointer.save`: the rects every rank of the
target layout would save are planned without processes (planning.py), one
replica of each is attributed to a target rank, each rect's data is read from
the source only when the backend is about to write it and dropped after, and
the result is committed with the training save's own protocol
(manager.commit). Memory stays near one read batch plus the largest rect and
the backends' buffers, never the whole model.
"""
from __future__ import annotations

import contextlib
import itertools
import os
import re
import shutil
import sys
from collections import Counter
from pathlib import Path
from typing import Callable, Iterator

import psutil
import torch
from tqdm import tqdm

from megaresil.checkpoint import format as fmt
from megaresil.checkpoint.backends import get_backend
from megaresil.checkpoint.backends.base import Backend
from megaresil.checkpoint.keys import WEIGHTS
from megaresil.checkpoint.manager import build_manifest, commit, layout_plan, rect_record
from megaresil.checkpoint.offline.ondemand import OnDemandTensor
from megaresil.checkpoint.offline.planning import planned_rects, writer_share
from megaresil.checkpoint.sharded import Rect
from megaresil.checkpoint.sources import TensorSource, byte_batches
from megaresil.checkpoint.state import RunRecord
from megaresil.checkpoint.validation import check_shapes
from megaresil.config import RecipeConfig
from megaresil.terminal import progress_bar


def refuse_existing(dst: Path, overwrite: bool) -> None:
    settle_leftovers(dst)
    if dst.exists() and not overwrite:
        raise fmt.CheckpointError(f"{dst} already exists. Fix: choose another destination, or pass "
                                  "--overwrite to replace it (only once the new one is complete).")


class _Reader:
    """Reads rects from the source in write order, a batch at a time;
    checksums each and advances the progress bar over tensors.

    A rect asked for out of order is read again in a new batch, and whatever
    the previous batch still held is dropped: memory never exceeds one batch."""

    def __init__(self, source: TensorSource, order: list[Rect], bar: tqdm):
        self.source, self.order, self.bar = source, order, bar
        self.position = {rect.identity(): i for i, rect in enumerate(order)}
        self.batch: dict[tuple, torch.Tensor] = {}
        self.checksums: dict[tuple, str] = {}
        self.pending = Counter(rect.key for rect in order)

    def _read_batch(self, start: int) -> dict[tuple, torch.Tensor]:
        planned = next(byte_batches(itertools.islice(self.order, start, None), lambda r: r.nbytes))
        batch = [Rect(r.key, r.global_shape, r.offset, torch.empty(r.shape, dtype=r.tensor.dtype))
                 for r in planned]
        self.source.read(batch)
        return {rect.identity(): rect.tensor for rect in batch}

    def data(self, rect: Rect) -> torch.Tensor:
        identity = rect.identity()
        if identity not in self.batch:
            self.batch = self._read_batch(self.position[identity])
        data = self.batch.pop(identity)
        if identity not in self.checksums:
            self.pending[rect.key] -= 1
            if not self.pending[rect.key]:
                self.bar.update(1)
        self.checksums[identity] = fmt.checksum(data)
        return data

    def on_demand(self, rect: Rect) -> Rect:
        data = OnDemandTensor(torch.Size(rect.shape), rect.tensor.dtype, lambda: self.data(rect))
        return Rect(rect.key, rect.global_shape, rect.offset, data)


def _write(backend: Backend, directory: Path, reader: _Reader) -> dict[tuple, str]:
    """Write every rect in the reader's order; each one's location by identity."""
    if backend.one_file_per_write:
        # One write is one file, so it gets every rect at once; it asks for
        # each one's data, in this order, as it writes it (OnDemandTensor).
        done = [backend.write(directory, [reader.on_demand(rect) for rect in reader.order], 0)]
    else:
        done = [backend.write(directory, [Rect(rect.key, rect.global_shape, rect.offset,
                                               reader.data(rect))], 0)
                for rect in reader.order]
    for d in done:
        d.durable()
    backend.finish(directory, [d.note for d in done])
    return {identity: where for d in done for identity, where in d.locations.items()}


def _as_stored(rect: Rect, source: TensorSource) -> Rect:
    """A planned rect (the model's dtype) with the dtype the source stores,
    which the written data keeps."""
    dtype = fmt.torch_dtype(source.tensors[rect.key]["dtype"])
    return Rect(rect.key, rect.global_shape, rect.offset,
                torch.empty(rect.shape, dtype=dtype, device="meta"))


def _records(writes: list[tuple[int, Rect]], locations: dict[tuple, str],
             checksums: dict[tuple, str], world: int) -> list[list[dict]]:
    """The manifest records of what was written, per target rank."""
    per_rank: list[list[dict]] = [[] for _ in range(world)]
    for rank, rect in writes:
        per_rank[rank].append({**rect_record(rect), "rank": rank,
                               "checksum": checksums[rect.identity()],
                               "location": locations[rect.identity()]})
    return per_rank


# A write of `DST` works beside it: `DST.partial-<pid>` is the new directory
# until it is renamed to `DST`; with --overwrite, the old `DST` waits as
# `DST.replaced-<pid>` until the new one is committed. A process killed on the
# way leaves these behind; the next write of `DST` settles them.


def _leftover(dst: Path, kind: str, pid: int) -> Path:
    return dst.with_name(f"{dst.name}.{kind}-{pid}")


def _leftover_pids(dst: Path) -> list[int]:
    """The pids named by `DST.partial-<pid>` / `DST.replaced-<pid>` beside `dst`."""
    if not dst.parent.is_dir():
        return []
    pattern = re.compile(rf"{re.escape(dst.name)}\.(?:partial|replaced)-(\d+)")
    return sorted({int(m.group(1)) for path in dst.parent.iterdir()
                   if (m := pattern.fullmatch(path.name))})


def _writer_alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _committed(directory: Path) -> bool:
    """A checkpoint is committed once its marker is written; a Hugging Face export (no
    manifest, no marker) once it is in place."""
    return (directory / fmt.MARKER).exists() or not (directory / fmt.MANIFEST).exists()


def _settle_swap(dst: Path, pid: int) -> str:
    """Finish or undo a replacement of `dst` by process `pid` that stopped
    after moving the old one aside. The old one is deleted only once the new
    one is committed, and every step below leaves a state this function
    settles again, so no interruption loses both."""
    partial, replaced = _leftover(dst, "partial", pid), _leftover(dst, "replaced", pid)
    if dst.exists() and _committed(dst):
        shutil.rmtree(replaced)
        return f"removed {replaced}: the new {dst.name} had been committed"
    shutil.rmtree(partial, ignore_errors=True)
    if dst.exists():
        dst.rename(partial)  # the uncommitted new one is a partial again
    replaced.rename(dst)
    shutil.rmtree(partial, ignore_errors=True)
    return f"restored {dst} from {replaced}: its replacement had not been committed"


def settle_leftovers(dst: Path) -> None:
    """Clean up what killed writes of `dst` left beside it, restoring a `dst`
    an interrupted --overwrite had moved aside; refuse while a live process
    owns such leftovers (it may still be writing)."""
    # This process's own are in use (partial_dir clears a dead namesake's).
    for pid in [pid for pid in _leftover_pids(dst) if pid != os.getpid()]:
        partial, replaced = _leftover(dst, "partial", pid), _leftover(dst, "replaced", pid)
        if _writer_alive(pid):
            leftover = replaced if replaced.exists() else partial
            raise fmt.CheckpointError(f"{dst} is being written by running process {pid} "
                                      f"({leftover.name}). Fix: wait for it to finish; if process "
                                      f"{pid} is not a megaresil convert, delete {leftover}.")
        if replaced.exists():
            print(f"megaresil: {_settle_swap(dst, pid)}", file=sys.stderr)
        if partial.exists():
            shutil.rmtree(partial)
            print(f"megaresil: removed {partial}, left by a killed write (pid {pid})",
                  file=sys.stderr)


@contextlib.contextmanager
def partial_dir(dst: Path) -> Iterator[Path]:
    """A fresh directory beside `dst` to write into; gone afterwards unless
    it was moved into place as `dst`."""
    partial = _leftover(dst, "partial", os.getpid())
    shutil.rmtree(partial, ignore_errors=True)  # left by a dead process with our pid
    partial.mkdir(parents=True)
    try:
        yield partial
    finally:
        shutil.rmtree(partial, ignore_errors=True)


@contextlib.contextmanager
def replacing(dst: Path, overwrite: bool) -> Iterator[Callable[[Path], None]]:
    """The `make_room` for moving a new directory into place as `dst`: an
    existing `dst` (allowed by `overwrite`) is moved aside only then, and
    deleted once the new one is committed; on an error before that, it is
    put back (a killed process's is, by the next `settle_leftovers`)."""
    replaced = _leftover(dst, "replaced", os.getpid())

    def move_aside(existing: Path) -> None:
        refuse_existing(existing, overwrite)
        existing.rename(replaced)

    try:
        yield move_aside
    except BaseException:
        if replaced.exists():
            _settle_swap(dst, os.getpid())
        raise
    shutil.rmtree(replaced, ignore_errors=True)


def _check_source(source: TensorSource, planned: list[Rect], weights_only: bool) -> None:
    """The source must hold exactly the tensors of the target model (the
    keys of every target rank together), at their shapes; a weights-only
    write leaves the source's optimizer state out on purpose."""
    held = {key: entry for key, entry in source.tensors.items()
            if not weights_only or key.startswith(WEIGHTS)}
    check_shapes(held, planned, {rect.key for rect in planned})


def write_checkpoint(source: TensorSource, cfg: RecipeConfig, dst: Path, *, backend: str,
                     weights_only: bool, state: RunRecord, overwrite: bool) -> Path:
    """Write `source`'s tensors as checkpoint `dst` at the layout of recipe
    `cfg`, with the non-tensor `state`. `dst` appears only once complete."""
    refuse_existing(dst, overwrite)
    per_rank = planned_rects(cfg, weights_only=weights_only)
    planned = writer_share(per_rank)
    _check_source(source, [rect for _, rect in planned], weights_only)
    writes = sorted(((rank, _as_stored(rect, source)) for rank, rect in planned),
                    key=lambda w: (w[1].key, w[1].offset))
    writer = get_backend(backend)
    with partial_dir(dst) as partial, progress_bar(total=len({r.key for _, r in writes}),
                                                   desc="writing", unit="tensor") as bar:
        writer.plan(layout_plan([[rect_record(rect) for _, rect in writes]]))
        writer.prepare(partial)
        reader = _Reader(source, [rect for _, rect in writes], bar)
        locations = _write(writer, partial, reader)
        manifest = build_manifest(writer.name, state,
                                  _records(writes, locations, reader.checksums, len(per_rank)))
        with replacing(dst, overwrite) as make_room:
            commit(partial, dst, manifest, make_room)
    return dst
