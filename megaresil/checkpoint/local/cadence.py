"""When the local tier saves (Cadence), and how it backs off after a failed
save (Pause, retry_step). Every rank must save at the same steps, since a
save is collective: what each rank measures is agreed by the saves' own
collectives."""
from __future__ import annotations

import math
import statistics
from collections import deque
from dataclasses import dataclass
from typing import Optional

from megaresil.clock import Clock, SystemClock

BUDGET = 0.05  # the share of a step a local save may hold the loop for (interval 0)
RETRY_FIRST_S, RETRY_MAX_S = 60.0, 1800.0  # a paused tier's back-off: doubling, capped


class Cadence:
    """When the local tier saves: every `interval` steps or, with interval 0,
    every step while a save holds the loop for at most BUDGET of a step, else
    the smallest interval that keeps it there (re-measured at every save).

    Every rank must save at the same steps (a save is collective), but each
    measures its own hold: a rank's measure is its proposal, the save's
    thread agrees on the largest (the slowest rank holds every rank's loop),
    and the next save applies it, once every rank has it."""

    def __init__(self, interval: int, clock: Clock = SystemClock()):
        self.fixed, self.clock = interval, clock
        self.every = max(1, interval)
        self.proposal = self.every  # this rank's measure, agreed on by the save in flight
        self.agreed: Optional[int] = None  # by every rank, at the last save
        self.last: Optional[int] = None  # step of the last save
        self.step_s: deque = deque(maxlen=16)  # recent step times, saves' holds left out
        self.ticked: Optional[float] = None
        self.held_since_tick = 0.0
        self.held_by_save = 0.0  # the loop's hold for the last save, so far

    def due(self, step: int) -> bool:
        """Called once per step, after it."""
        now = self.clock.monotonic()
        if self.ticked is not None:
            self.step_s.append(now - self.ticked - self.held_since_tick)
        self.ticked, self.held_since_tick = now, 0.0
        if self.fixed:
            return step % self.fixed == 0
        return self.last is None or step - self.last >= self.every

    def held(self, seconds: float) -> None:
        self.held_since_tick += seconds
        self.held_by_save += seconds

    def saving(self, step: int) -> None:
        """A save starts at `step`, after the previous one ended: the interval
        agreed then takes effect, and the previous save's hold, complete
        now, is this rank's next proposal."""
        if not self.fixed:
            self.every = self.agreed or self.every
            if self.last is not None and (step_s := self.step_seconds()) is not None:
                budget = BUDGET * step_s
                self.proposal = (max(1, math.ceil(self.held_by_save / budget))
                                 if budget > 0 else 1)
        self.last, self.held_by_save = step, 0.0

    def agree(self, proposals: list[int]) -> None:
        """On the save's thread, with every rank's proposal."""
        self.agreed = max(proposals)

    def step_seconds(self) -> Optional[float]:
        """The median of the recent step times (None before one is measured)."""
        return statistics.median(self.step_s) if self.step_s else None


@dataclass
class Pause:
    """The tier stopped saving: since which step, why, and the step from
    which it saves again (None: not in this run). Every rank holds the same
    Pause: a failed save's is agreed by the save's own collective, the
    start-up check's by its own; so no rank saves (and waits on a peer's
    replication) while another is paused."""
    step: int
    reason: str
    retry_at: Optional[int]
    failures: int = 1  # failed saves in a row

    def holds(self, step: int) -> bool:
        return self.retry_at is None or step < self.retry_at


def retry_step(step: int, failures: int, step_s: Optional[float]) -> tuple[int, float]:
    """Where a tier whose `failures`-th save in a row failed at `step` tries
    again, and after how long: RETRY_FIRST_S, doubled at each failure up to
    RETRY_MAX_S, in steps of `step_s` (with no step measured yet, the next
    step, whose failure then backs off by time)."""
    backoff = min(RETRY_FIRST_S * 2.0 ** min(failures - 1, 32), RETRY_MAX_S)
    return step + (max(1, math.ceil(backoff / step_s)) if step_s else 1), backoff
