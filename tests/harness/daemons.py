"""What the cluster tests' local daemons (megaresil.drills.etcd, slurm_cluster.py)
share: polling, with a deadline, until something answers, and the fixture
shape that starts a daemon in a temporary directory (or skips, saying why it
cannot start here) and stops it when the module is done."""
from __future__ import annotations

import time
from pathlib import Path
from typing import Callable, Iterator, Optional, Protocol, TypeVar

import pytest

T = TypeVar("T")


def wait_until(check: Callable[[], Optional[T]], timeout: float, interval: float,
               failure: Callable[[], str]) -> T:
    """The first true value of `check()`, asked every `interval` s; after
    `timeout` s without one, TimeoutError with `failure()` (read then, so
    it can quote the daemon's logs)."""
    deadline = time.monotonic() + timeout
    while True:
        value = check()
        if value:
            return value
        if time.monotonic() >= deadline:
            raise TimeoutError(failure())
        time.sleep(interval)


class Daemon(Protocol):
    def start(self) -> "Daemon": ...

    def stop(self) -> None: ...


def serve(daemon: Callable[[Path], Daemon], missing_reason: Callable[[], Optional[str]],
          directory: Path) -> Iterator[Daemon]:
    """For a fixture to `yield from`: the daemon started in `directory`,
    stopped afterwards; the test skips with the reason when it cannot start."""
    reason = missing_reason()
    if reason:
        pytest.skip(reason)
    started = daemon(directory).start()
    try:
        yield started
    finally:
        started.stop()
