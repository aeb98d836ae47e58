"""Where training stands: the loop advances it, the checkpoint saves and
restores it (train/state.py)."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Progress:
    """Optimizer steps done and samples consumed; `consumed_samples` and the
    global batches skipped (first sample -> samples; data/sampler.skip_past)
    are the whole data position."""
    step: int = 0
    consumed_samples: int = 0
    skipped: dict[int, int] = field(default_factory=dict)
