"""Time, injected: code that judges by time (how long a wait has lasted, when
to look again, what a step costs) takes a `Clock`, so tests run it on a
fake one (tests/harness/fake_clock.py). Durations are on the monotonic
clock (on Linux time.perf_counter reads the same CLOCK_MONOTONIC, to the
nanosecond); wall-clock time appears only in events. Readings another
process compares (the watchdog's tick file, the guardian) take the real
clock, not this one. docs/architecture.md ("Worker environment and clock")."""
from __future__ import annotations

import threading
import time
from typing import Protocol


class Clock(Protocol):
    def monotonic(self) -> float:
        """Seconds on a clock that never steps back."""

    def sleep(self, seconds: float) -> None:
        """Let `seconds` pass on this clock."""

    def wait(self, event: threading.Event, timeout: float) -> bool:
        """Wait until `event` is set or `timeout` seconds pass on this clock;
        whether the event is set."""


class SystemClock:
    def monotonic(self) -> float:
        return time.monotonic()

    def sleep(self, seconds: float) -> None:
        time.sleep(seconds)

    def wait(self, event: threading.Event, timeout: float) -> bool:
        return event.wait(timeout)
