"""Storage backends behind one small interface.

A backend writes this rank's rects into a checkpoint directory and reads any
rectangles of the saved global tensors back; the manifest, checksums and the
commit protocol are the same for all backends (checkpoint/format.py). A new
backend is one file with a class implementing `Backend`, added to BACKENDS.
"""
from __future__ import annotations

from pathlib import Path
from typing import Protocol

from megaresil.checkpoint.sharded import Rect


class Backend(Protocol):
    name: str

    def prepare(self, directory: Path, layout_plan: dict[str, dict]) -> None:
        """Called on one rank before anyone writes; `layout_plan` maps each key
        to its global shape, dtype and every writer's rect (for chunking)."""

    def write(self, directory: Path, rects: list[Rect]) -> dict[tuple, str]:
        """Write this rank's rects (all ranks call it together); return each
        rect's location (a path relative to `directory`) by rect identity.
        Files must be durable (fsynced) on return."""

    def read(self, directory: Path, manifest: dict, targets: list[Rect]) -> None:
        """Fill every target rect's tensor from the saved global tensors,
        whatever rectangles they were saved in (this is resharding)."""


def get_backend(name: str) -> Backend:
    from megaresil.checkpoint.backends.torch_dist import TorchDistBackend
    from megaresil.checkpoint.backends.zarr import ZarrBackend

    backends = {"torch_dist": TorchDistBackend, "zarr": ZarrBackend}
    if name not in backends:
        raise ValueError(f"checkpoint.backend: unknown backend {name!r}; use one of {sorted(backends)}")
    return backends[name]()
