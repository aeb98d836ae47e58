"""Where a run's checkpoints live, and the failure of finding none usable."""
from __future__ import annotations

from pathlib import Path

from megaresil.config import RecipeConfig


class NoValidCheckpoint(RuntimeError):
    """Checkpoints exist but none can be loaded: never silently start over."""


def checkpoint_root(cfg: RecipeConfig) -> Path:
    return Path(cfg.checkpoint.dir) if cfg.checkpoint.dir else Path(cfg.run.dir) / "checkpoints"
