"""Health checks while a node waits to be admitted. A hot spare may wait in
the rendezvous for hours, long enough to go bad (a GPU running hot, ECC
errors, a full disk): while its agent waits, the node's checks
(launch/health.py) run every resilience.health.interval_s, and the first
failure excludes the node and ends its wait, so it leaves before the job
needs it and the next spare is taken instead. A node admitted after a wait
longer than the interval is checked once more before its workers start.
docs/clusters.md#health-checks."""
from __future__ import annotations

import _thread
import signal
import socket
import threading
import time
from collections.abc import Callable
from types import FrameType
from typing import Any, Optional, Union

from torch.distributed.elastic.multiprocessing.api import SignalException

# Raised in the main thread (blocked in TorchElastic's rendezvous loop) by the
# checking thread, through _thread.interrupt_main: unlike a real signal it
# cannot reach the process once the handler is gone.
WAKE_SIGNAL = signal.SIGUSR2


class NodeExcluded(SignalException):
    """The end of the agent of a node that failed its check. A
    SignalException because TorchElastic's launch closes the rendezvous, for
    every node, when its agent ends with any other exception; after a signal
    it leaves it open (a spare leaving must not end the job)."""
    def __init__(self, line: str):
        super().__init__(line, signal.SIGTERM)
        self.line = line


class _Woken(Exception):
    """The checking thread's interruption of the main thread's wait."""


def _wake(signum, frame) -> None:
    raise _Woken()


class WaitingChecks:
    """Around the agent's rendezvous (main thread only): `check` (None when
    the node is fit, else the line that says why not, the node excluded)
    every `interval_s` while it waits, and once more after a wait that long.
    A failure raises NodeExcluded out of the block."""

    def __init__(self, check: Callable[[], Optional[str]], interval_s: float,
                 clock: Callable[[], float] = time.monotonic):
        self.check = check
        self.interval_s = interval_s
        self.clock = clock
        self.refusal: Optional[str] = None
        self.stopped = threading.Event()
        self.lock = threading.Lock()  # no interruption once the wait is over
        self.started = 0.0
        self.previous: Union[Callable[[int, Optional[FrameType]], Any], int, None] = None
        self.thread = threading.Thread(target=self._watch, name="megaresil-waiting-checks",
                                       daemon=True)

    def __enter__(self) -> "WaitingChecks":
        self.started = self.clock()
        self.previous = signal.signal(WAKE_SIGNAL, _wake)
        self.thread.start()
        return self

    def _watch(self) -> None:
        while not self.stopped.wait(self.interval_s):
            refusal = self._checked()
            with self.lock:
                if refusal and not self.stopped.is_set():
                    self.refusal = refusal
                    _thread.interrupt_main(WAKE_SIGNAL)
                    return

    def _checked(self) -> Optional[str]:
        """The check's verdict; one that cannot run says why and ends the
        wait as a failure would: a thread that died of it would leave a
        spare waiting unchecked, for hours."""
        try:
            return self.check()
        except Exception as err:  # noqa: BLE001 (whatever stops the check is its verdict)
            return (f"node {socket.gethostname()}'s health check could not run "
                    f"({type(err).__name__}: {err}); it stops waiting to join")

    def __exit__(self, exc_type, exc, tb) -> None:
        try:
            with self.lock:
                self.stopped.set()
            self.thread.join()
        except _Woken:  # the interruption landed here, after the wait it was for
            pass
        finally:
            signal.signal(WAKE_SIGNAL, self.previous)
        if self.refusal:
            raise NodeExcluded(self.refusal) from None
        if exc_type is None and self.clock() - self.started >= self.interval_s:
            refusal = self._checked()
            if refusal:
                raise NodeExcluded(refusal)
