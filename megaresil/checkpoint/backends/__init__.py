"""Storage backends behind one small interface.

A backend writes this rank's rects into a checkpoint directory and reads any
rectangles of the saved global tensors back; the manifest, checksums and the
commit protocol are the same for all backends (checkpoint/format.py). A new
backend is one file with a class implementing `Backend`, added to BACKENDS.
"""
# mypy: ignore-errors
from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from megaresil.checkpoint.backends.base import Backend


def get_backend(name: str) -> Backend:
    from megaresil.checkpoint.backends.torch_dist import TorchDistBackend
    from megaresil.checkpoint.backends.zarr import ZarrBackend

    backends = {"torch_dist": TorchDistBackend, "zarr": ZarrBackend}
    if name not in backends:
        raise ValueError(f"checkpoint.backend: unknown backend {name!r}; use one of {sorted(backends)}")
    return backends[name]()
