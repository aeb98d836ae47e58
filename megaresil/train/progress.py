"""Where training stands: the loop advances it, the checkpoint saves and
restores it (train/state.py)."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass
class Progress:
    """Optimizer steps done and samples consumed; `consumed_samples` is the
    whole data position."""
    step: int = 0
    consumed_samples: int = 0
