"""The interface every storage backend implements (`Backend`) and what one
write reports (`Written`); the manifest, checksums and the commit protocol
are the same for all backends (checkpoint/format.py)."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Protocol

from megaresil.checkpoint.sharded import Rect


def _already_durable() -> None:
    pass


@dataclass
class Written:
    """What one `Backend.write` call reports."""
    locations: dict[tuple, str]  # each rect's location (relative to the directory) by identity
    note: Any = None  # what `Backend.finish` needs from this writer (picklable)
    # Returns once the written files are durable; a backend that flushes in
    # the background lets the caller work (checksums) meanwhile.
    durable: Callable[[], None] = _already_durable


class Backend(Protocol):
    name: str
    # Whether one `write` call makes one file of all the rects it is given
    # (torch_dist: a DCP save). An offline writer (offline/writer.py) then hands it
    # all of a checkpoint's rects at once, their data produced only as each
    # is written; a backend that stores each rect on its own (zarr) gets one
    # rect per call. Either way memory holds a read batch, not the checkpoint.
    one_file_per_write: bool

    def plan(self, layout_plan: dict[str, dict]) -> None:
        """Called on every writing process, once, before its first prepare or
        write; `layout_plan` maps each key to its global shape, dtype and
        every writer's rect (for chunking). It is the same for every save."""

    def prepare(self, directory: Path) -> None:
        """Called on one rank before anyone writes: what every writer shares
        (the directories above its files)."""

    def write(self, directory: Path, rects: list[Rect], rank: int) -> Written:
        """Write rank `rank`'s rects; each rank writes on its own, with no
        collectives. The files are durable (fsynced) once the returned
        `durable()` returns; the rects' tensors are no longer read."""

    def finish(self, directory: Path, notes: list[Any]) -> None:
        """Called on one process once every write has returned, with every
        write's note, before the manifest: for files that describe all
        ranks' writes. Durable on return."""

    def read(self, directory: Path, manifest: dict, targets: list[Rect]) -> None:
        """Fill every target rect's tensor from the saved global tensors,
        whatever rectangles they were saved in (this is resharding)."""
