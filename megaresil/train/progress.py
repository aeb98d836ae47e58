"""Where training stands: the loop advances it, the checkpoint saves and
restores it (train/state.py)."""
from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass, field

from megaresil.resilience.numerics import LossWatch


@dataclass
class Progress:
    """Optimizer steps done and samples consumed; `consumed_samples` and the
    global batches skipped (first sample -> samples; data/sampler.skip_past)
    are the whole data position. `watch`: what the spike detector and a
    spike's rollback read (saved and carried, so a resumed or replaced run
    decides as the uninterrupted one would).
    `settled`: False while the state changes (an update, a load, a repair):
    a state caught then is no step's, and is not handed over."""
    step: int = 0
    consumed_samples: int = 0
    skipped: dict[int, int] = field(default_factory=dict)
    watch: LossWatch = field(default_factory=LossWatch)
    settled: bool = True

    @contextmanager
    def changing(self):
        """The state changes inside; an exception leaves it unsettled."""
        self.settled = False
        yield
        self.settled = True
