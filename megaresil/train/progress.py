"""Where training stands: the loop advances it, the checkpoint saves and
restores it (train/state.py)."""
from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass, field


@dataclass
class Progress:
    """Optimizer steps done and samples consumed; `consumed_samples` and the
    global batches skipped (first sample -> samples; data/sampler.skip_past)
    are the whole data position. `losses`: the last steps' losses, the
    spike detector's window (saved, so a resume detects as the run would).
    `settled`: False while the state changes (an update, a load, a repair):
    a state caught then is no step's, and is not handed over."""
    step: int = 0
    consumed_samples: int = 0
    skipped: dict[int, int] = field(default_factory=dict)
    losses: list[float] = field(default_factory=list)
    settled: bool = True

    @contextmanager
    def changing(self):
        """The state changes inside; an exception leaves it unsettled."""
        self.settled = False
        yield
        self.settled = True
