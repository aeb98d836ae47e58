"""A clock that moves only when a test says so, and a thread CPU clock to
match: time-dependent judgement (the watchdog's, live replacement's wait,
the local tier's cadence) runs on them deterministically, whatever the
machine's load."""
from __future__ import annotations

import threading
from typing import Callable, Optional


class FakeClock:
    """megaresil.clock.Clock on test time. Nothing moves the time but
    `advance`, `sleep` (which returns at once, after `on_sleep`: what the
    test makes happen meanwhile), an assignment to `now`, and the reads
    themselves when `tick` is given: each read returns the time, then moves
    it on by `tick` (code that reads the clock once per step, a step `tick`
    seconds). A wait returns when its event is set or when the time passes
    its deadline."""

    def __init__(self, now: float = 0.0, tick: float = 0.0):
        self.now, self.tick = now, tick
        self.on_sleep: Optional[Callable[[], None]] = None
        self.moved = threading.Condition()

    def monotonic(self) -> float:
        now = self.now
        if self.tick:
            self.advance(self.tick)
        return now

    def advance(self, seconds: float) -> None:
        with self.moved:
            self.now += seconds
            self.moved.notify_all()

    def sleep(self, seconds: float) -> None:
        self.advance(seconds)
        if self.on_sleep is not None:
            self.on_sleep()

    def wait(self, event: threading.Event, timeout: float) -> bool:
        deadline = self.now + timeout
        with self.moved:
            while not event.is_set() and self.now < deadline:
                self.moved.wait(0.01)  # setting the event does not notify us: look again soon
        return event.is_set()


class FakeCpu:
    """The training thread's CPU seconds, as the test makes it spend them."""

    def __init__(self):
        self.seconds = 0.0

    def __call__(self) -> float:
        return self.seconds


def run_monitor(wd, clock: FakeClock, cpu: FakeCpu, seconds: float, cpu_share: float) -> None:
    """`seconds` of test time of a watchdog's monitor, one poll per poll_s,
    while its training thread uses `cpu_share` of a core (1: computing, 0:
    blocked or sleeping). A HangAbort the monitor raises in the training
    thread (the test's own) ends it."""
    step = wd.cfg.poll_s
    for _ in range(round(seconds / step)):
        clock.advance(step)
        cpu.seconds += cpu_share * step
        wd.poll()
