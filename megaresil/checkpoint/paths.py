"""Where a run keeps its files: the run directory, the global checkpoint
root and the local tier's root, computed from the recipe in one place, and
the rule between them: the local tier never lies inside the global
checkpoint root (the launcher checks it before any worker starts).
docs/architecture.md ("Run paths")."""
from __future__ import annotations

import hashlib
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from megaresil.checkpoint.local.store import DIR_KEY
from megaresil.config import ConfigError, RecipeConfig


@dataclass(frozen=True)
class RunPaths:
    run_dir: Path
    checkpoint_root: Path  # checkpoint.dir, or the run directory's checkpoints/
    local_root: Path  # checkpoint.local.dir, or its default for the run directory
    local_default: bool  # checkpoint.local.dir is unset: local_root is the default
    local_enabled: bool  # checkpoint.local.enabled

    @classmethod
    def of(cls, cfg: RecipeConfig) -> RunPaths:
        run_dir, local_dir = Path(cfg.run.dir), cfg.checkpoint.local.dir
        return cls(run_dir=run_dir,
                   checkpoint_root=(Path(cfg.checkpoint.dir) if cfg.checkpoint.dir
                                    else run_dir / "checkpoints"),
                   local_root=Path(local_dir) if local_dir else default_local_root(run_dir),
                   local_default=not local_dir, local_enabled=cfg.checkpoint.local.enabled)

    def check(self) -> None:
        """The local root must not be, or lie inside, the global checkpoint
        root: the local tier never writes there."""
        shared = self.checkpoint_root.resolve()
        if self.local_root.resolve() == shared or shared in self.local_root.resolve().parents:
            raise ConfigError(DIR_KEY,
                              f"{self.local_root} lies inside the global checkpoint root "
                              f"{shared}.", "point it at node-local storage (or leave it null "
                              "for /dev/shm/megaresil/<run dir name>-<digest>).")

    def local_tier_root(self) -> Optional[Path]:
        """The local root a job holds and writes while it runs, checked
        (None: the tier is off)."""
        if not self.local_enabled:
            return None
        self.check()
        return self.local_root

    def local_run_dir(self, run_id: str) -> Path:
        """The run's own directory under the local root."""
        return run_local_dir(self.local_root, run_id)


def default_local_root(run_dir: Path) -> Path:
    """/dev/shm/megaresil/<run dir name>-<digest of its path>: the same at
    every launch (a requeued job finds its shards) and different for every
    run directory, so runs in two directories never wait on one lock."""
    base = Path("/dev/shm") if Path("/dev/shm").is_dir() else Path(tempfile.gettempdir())
    run = Path(run_dir).resolve()
    return base / "megaresil" / f"{run.name}-{hashlib.sha1(str(run).encode()).hexdigest()[:10]}"


def run_local_dir(root: Path, run_id: str) -> Path:
    """A run's own directory under a local root: its node directories."""
    return root / f"run-{run_id}"
