"""torch.profiler over chosen steps (`profile.*`): one Chrome/Perfetto trace per
profiled rank, run.dir/profile/rank{R}.steps{A}-{B}.pt.trace.json, which
https://ui.perfetto.dev opens and TensorBoard's profiler plugin lists
(`tensorboard --logdir run.dir/profile`)."""
from __future__ import annotations

from contextlib import contextmanager
from pathlib import Path
from typing import Optional

import torch
from torch.profiler import ProfilerActivity, profile

from megaresil.config import ProfileConfig
from megaresil.safe_files import own_dir


class StepProfiler:
    def __init__(self, cfg: ProfileConfig, rank: int, run_dir: Path):
        self.first, self.last = cfg.start_step, cfg.start_step + cfg.steps - 1
        self.active = cfg.enabled and rank in cfg.ranks
        self.path = Path(run_dir) / "profile" / f"rank{rank}.steps{self.first}-{self.last}.pt.trace.json"
        self.session: Optional[profile] = None

    @contextmanager
    def step(self, step: int):
        """Around one training step: starts before the first profiled step,
        writes the trace after the last."""
        if self.active and step == self.first and self.session is None:
            activities = [ProfilerActivity.CPU]
            if torch.cuda.is_available():
                activities.append(ProfilerActivity.CUDA)
            self.session = profile(activities=activities, record_shapes=True)
            self.session.__enter__()
        yield
        if self.session is not None and step == self.last:
            self.finish()

    def finish(self) -> None:
        """Write the trace of what was profiled so far (also when training
        stops inside the profiled steps)."""
        if self.session is None:
            return
        session, self.session = self.session, None
        session.__exit__(None, None, None)
        # The trace file is the library's to open (it replaces a link at its
        # name); the directory is the run's own, not a link planted in its place.
        session.export_chrome_trace(str(own_dir(self.path.parent) / self.path.name))
