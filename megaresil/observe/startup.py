"""The start-up phases a user waits through (the launcher's data
preparation; each worker generation's rendezvous, data/model/optimizer
build and checkpoint load): each one that takes longer than a threshold is
recorded as a `startup_phase` event by rank 0, which the launcher's console
prints as one line (resilience/incidents.py), a load with its bytes and
bytes/s. Short phases say nothing: the banner and the first step follow at
once."""
from __future__ import annotations

import os
from contextlib import contextmanager
from typing import Callable, Iterator, Optional, Protocol

import psutil

from megaresil.clock import Clock, SystemClock

DEFAULT_THRESHOLD_S = 2.0
# Tests lower it (to 0: every phase gets its line) to see the lines of a
# tiny run's fast phases; users have no reason to set it.
THRESHOLD_ENV = "MEGARESIL_PHASE_LINE_S"


class Events(Protocol):
    def emit(self, event: str, **fields) -> dict: ...


def process_times() -> dict[str, float]:
    """When this worker process and the job that launched it started (its
    parent: the launcher's agent, or torchrun), for goodput's start-up time."""
    me = psutil.Process()
    parent = me.parent()
    return {"process_started": me.create_time(),
            "launched_at": parent.create_time() if parent else me.create_time()}


def threshold_s() -> float:
    return float(os.environ.get(THRESHOLD_ENV, DEFAULT_THRESHOLD_S))


class StartupPhases:
    """Times phases on `clock`; on rank 0, a phase of `threshold` seconds or
    more is emitted with its seconds and, when the phase reported bytes,
    bytes and bytes_per_s; and said through `say`, where given (the launcher,
    whose own phases come before its console follows the events)."""

    def __init__(self, events: Events, rank: int, *, clock: Clock = SystemClock(),
                 threshold: Optional[float] = None, say: Optional[Callable[[str], None]] = None):
        self.events, self.rank, self.clock, self.say = events, rank, clock, say
        self.threshold = threshold_s() if threshold is None else threshold

    @contextmanager
    def phase(self, name: str) -> Iterator[dict]:
        """Times the block; the block may put `bytes` (what it read) in the
        dict it is given. An exception ends the phase without a line: the
        failure has its own."""
        found: dict = {}
        started = self.clock.monotonic()
        yield found
        self.finished(name, self.clock.monotonic() - started, found.get("bytes"))

    def finished(self, name: str, seconds: float, nbytes: Optional[int] = None) -> None:
        if self.rank != 0 or seconds < self.threshold:
            return
        fields = {"phase": name, "seconds": seconds}
        if nbytes is not None:
            fields.update(bytes=nbytes, bytes_per_s=nbytes / seconds if seconds > 0 else None)
        record = self.events.emit("startup_phase", **fields)
        if self.say is not None:
            self.say(f"megaresil: {describe(record)}")


def describe(event: dict) -> str:
    """The console line of a `startup_phase` event."""
    line = f"start-up: {event.get('phase')} took {event.get('seconds', 0):.1f} s"
    if event.get("bytes") is not None:
        rate = event.get("bytes_per_s")
        line += f" ({event['bytes'] / 1e9:.3f} GB" + (f", {rate / 1e9:.3f} GB/s)" if rate
                                                       else ")")
    return line
