"""Where a step's time goes: the wall and training-thread CPU seconds of each
section (data, forward_backward, optimizer, checkpoint, eval).

CPU time tells work from waiting: a rank blocked in a collective for a slow
peer gains almost none (the watchdog relies on the same fact), so comparing
ranks' CPU time per section names the slow rank, not the ones waiting for
it. On a GPU the host thread's CPU time measures launching and synchronising
rather than the kernels; the wall times are kept beside it."""
from __future__ import annotations

import time
from contextlib import contextmanager
from dataclasses import dataclass, field

STEP_SECTIONS = ("data", "forward_backward", "optimizer", "checkpoint")


@dataclass
class SectionTime:
    wall_s: float = 0.0
    cpu_s: float = 0.0


@dataclass
class SectionClock:
    """Sections measured since the last `take` (a step's, and the checkpoint
    and eval that followed the step before it)."""
    pending: dict[str, SectionTime] = field(default_factory=dict)

    @contextmanager
    def measure(self, name: str):
        wall, cpu = time.perf_counter(), time.thread_time()
        yield
        spent = self.pending.setdefault(name, SectionTime())
        spent.wall_s += time.perf_counter() - wall
        spent.cpu_s += time.thread_time() - cpu

    def take(self) -> dict[str, SectionTime]:
        taken, self.pending = self.pending, {}
        return taken


def record_fields(times: dict[str, SectionTime]) -> dict[str, float]:
    """metrics.jsonl's section fields: `time_<section>_s` (wall seconds);
    checkpoint is the wait for the save after the previous step."""
    return {f"time_{name}_s": times[name].wall_s if name in times else 0.0
            for name in STEP_SECTIONS}
