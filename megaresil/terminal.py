"""Progress on the console: a bar where a terminal can draw one, plain lines
everywhere else (a log file, a pipe, a terminal that reports 0 columns).

A terminal of 0 columns (what some CI runners' and containers'
pseudo-terminals report) makes tqdm draw nothing; a bar there would swallow
the lines a job prints instead of a bar, and a bar written into a log that
is not a terminal is a smear of carriage returns. So a bar is drawn only on
a terminal with a width, and a long job without one says how far it is in a
plain line every few seconds."""
from __future__ import annotations

import os
import sys
from typing import IO, Callable, Optional

from tqdm import tqdm

from megaresil.clock import Clock, SystemClock

DEFAULT_INTERVAL_S = 10.0
# Tests lower it (to 0: a line at every update) to see the plain lines of a
# short job; users have no reason to set it.
INTERVAL_ENV = "MEGARESIL_PROGRESS_LINE_S"


def draws_bars(stream: Optional[IO] = None) -> bool:
    """Whether `stream` (stderr) is a terminal that reports its width."""
    stream = sys.stderr if stream is None else stream
    try:
        return stream.isatty() and os.get_terminal_size(stream.fileno()).columns > 0
    except (AttributeError, OSError, ValueError):  # no file behind it, or closed
        return False


def progress_bar(**kwargs) -> tqdm:
    """A tqdm bar on stderr, drawn only where `draws_bars` (else a no-op)."""
    return tqdm(file=sys.stderr, disable=not draws_bars(sys.stderr), **kwargs)


def interval_s() -> float:
    return float(os.environ.get(INTERVAL_ENV, DEFAULT_INTERVAL_S))


def _say(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


class SizedProgress:
    """How far a job through `total` bytes is (None: unknown), with figures
    that ride along (documents, tokens): a bar where one draws, else a plain
    line at most every `interval` seconds, with the share done and an ETA
    (the elapsed time scaled by what is left)."""

    def __init__(self, what: str, total: Optional[int], *,
                 clock: Clock = SystemClock(),
                 say: Callable[[str], None] = _say, interval: Optional[float] = None,
                 drawn: Optional[bool] = None):
        self.what, self.total, self.clock, self.say = what, total, clock, say
        self.interval = interval_s() if interval is None else interval
        self.started = self.last_line = clock.monotonic()
        drawn = draws_bars() if drawn is None else drawn
        self.bar = tqdm(total=total, desc=what, unit="B", unit_scale=True, file=sys.stderr,
                        dynamic_ncols=True) if drawn else None

    def update(self, done: int, **figures: int) -> None:
        if self.bar is not None:
            self.bar.set_postfix({name: f"{value:,}" for name, value in figures.items()},
                                 refresh=False)
            self.bar.update(done - self.bar.n)
            return
        now = self.clock.monotonic()
        if now - self.last_line >= self.interval:
            self.last_line = now
            self.say(self.line(done, now - self.started, figures))

    def line(self, done: int, elapsed: float, figures: dict[str, int]) -> str:
        parts = [f"{value:,} {name}" for name, value in figures.items()]
        if self.total:
            parts.append(f"{100 * done / self.total:.0f}% of {self.total / 1e6:,.1f} MB read")
            if done:
                parts.append(f"ETA {_duration(elapsed * (self.total - done) / done)}")
        return f"{self.what}: {', '.join(parts) or 'started'}"

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()

    def __enter__(self) -> "SizedProgress":
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()


def _duration(seconds: float) -> str:
    if seconds < 90:
        return f"{seconds:.0f} s"
    if seconds < 5400:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.1f} h"
