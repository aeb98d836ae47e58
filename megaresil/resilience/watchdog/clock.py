"""The watchdog's time: one injected clock, so its judgement can be tested
on a fake one. Durations are on the monotonic clock; wall-clock time
appears only in events."""
from __future__ import annotations

import threading
import time
from typing import Protocol


class Clock(Protocol):
    def monotonic(self) -> float:
        """Seconds on a clock that never steps back."""

    def wait(self, event: threading.Event, timeout: float) -> bool:
        """Wait until `event` is set or `timeout` seconds pass on this clock;
        whether the event is set."""


class SystemClock:
    def monotonic(self) -> float:
        return time.monotonic()

    def wait(self, event: threading.Event, timeout: float) -> bool:
        return event.wait(timeout)
