"""A Megatron-LM save directory: latest_checkpointed_iteration.txt naming
its newest `iter_NNNNNNN/` (or `release/`) directory. Torch-free, so that
`ckpt inspect` can tell a Megatron checkpoint from megaresil's cheaply."""
from __future__ import annotations

import re
from pathlib import Path

from megaresil.checkpoint import format as fmt

TRACKER = "latest_checkpointed_iteration.txt"
_ITERATION_DIR = re.compile(r"^iter_(\d+)$")


def is_megatron_checkpoint(path: Path) -> bool:
    """A Megatron-LM save directory, or one of its iteration directories
    (DCP's .metadata at its top: megaresil's own lies under dcp/)."""
    return (path / TRACKER).is_file() or (
        (bool(_ITERATION_DIR.match(path.name)) or path.name == "release")
        and (path / ".metadata").is_file())


def iteration_dir(path: Path) -> Path:
    """The iteration directory that `path` means (the tracker's, for a save directory)."""
    if not (path / TRACKER).is_file():
        return path
    text = (path / TRACKER).read_text(errors="replace").strip()
    name = "release" if text == "release" else (f"iter_{int(text):07d}" if text.isdigit() else "")
    if not name or not (path / name).is_dir():
        raise fmt.CheckpointError(f"{path / TRACKER} names {text[:40]!r}, which is not an "
                                  "iteration directory there. Fix: give the iter_NNNNNNN "
                                  "directory to read.")
    return path / name
