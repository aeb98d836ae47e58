"""One background save at a time, on a thread that owns its process group:
the lifecycle both checkpoint tiers share (the global Checkpointer and the
node-local LocalTier), after Megatron-Core's AsyncRequest/AsyncCaller, on a
thread rather than a process.

A tier submits a `SaveRequest` (its staging copy and its report) with the
work that stages, writes and commits it; the loop goes on and waits, before
its next optimizer step at the latest (`before_update`), until the save
releases it: the global tier once the state is staged, the local tier once
the rank's own shard is committed (awaited at its save call). It waits for
the whole save only before the next save (`wait`) or at the end (`close`). A
failed job `abandon`s the save in flight: nobody waits for it, it does not
commit or report, and the newest committed state stands.
"""
from __future__ import annotations

import contextlib
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Callable, Iterator, Optional

import torch
import torch.distributed as dist

from megaresil.checkpoint.collectives import Collectives, own_group, wait_for
from megaresil.checkpoint.staging import StagingCopy
from megaresil.clock import Clock, SystemClock
from megaresil.fencing import Fence


class SaveReport:
    """The `checkpoint_saved` event of one save: the save's figures come from
    the thread that commits it (rank 0), `blocking_seconds` from the loop,
    which was held by the save call and, for an async save, by its wait at
    its next update (`before_update`).

    The event goes out at the commit, and no thread waits for the other: a
    loop that has not reached its update by then will not wait at all (a
    save releases the loop before it commits), and a loop that is waiting at that
    moment sends the event itself when its wait ends."""

    def __init__(self, events, event: str = "checkpoint_saved", clock: Clock = SystemClock()):
        self.events, self.event, self.clock = events, event, clock
        self.lock = threading.Lock()
        self.held = 0.0  # seconds the loop has been held so far
        self.waiting = False  # the loop is in `loop_waiting`
        self.figures: Optional[dict] = None  # the committed save's, until sent

    def loop_held(self, seconds: float) -> None:
        with self.lock:
            self.held += seconds
            self.waiting = False
            self._send()

    @contextlib.contextmanager
    def loop_waiting(self) -> Iterator[None]:
        """Around the loop's wait for the save: its duration counts as held."""
        with self.lock:
            self.waiting = True
        started = self.clock.monotonic()
        try:
            yield
        finally:
            self.loop_held(self.clock.monotonic() - started)

    def saved(self, **figures) -> None:
        with self.lock:
            self.figures = figures
            if not self.waiting:
                self._send()

    def _send(self) -> None:
        if self.figures is not None:
            self.events.emit(self.event, **self.figures, blocking_seconds=self.held)
            self.figures = None


@dataclass
class SaveRequest:
    """One save in flight: its staging copy and its report; the loop's next
    optimizer step waits for `released`."""
    copy: StagingCopy
    report: SaveReport
    released: threading.Event = field(default_factory=threading.Event)  # the loop may update

    @contextlib.contextmanager
    def holding_update(self) -> Iterator[None]:
        """Around the save thread's work that the loop's next optimizer step
        waits for (at least the staging copy, which must read the tensors
        before the update changes them): the loop is let go at its end,
        whether it worked or not (a failure surfaces at `wait`)."""
        try:
            yield
        finally:
            self.released.set()


class BackgroundSaves:
    """At most one save in flight, run on a one-thread executor that owns
    `group` (every collective of the tier runs there, see collectives.py).
    A tier subclasses it and submits its work; `_loop_held` hears each time
    the loop was held waiting for a save, on `clock`."""

    def __init__(self, thread_name: str, group: Optional[dist.ProcessGroup],
                 device: torch.device, clock: Clock = SystemClock()):
        self.clock = clock
        self.executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix=thread_name,
                                           initializer=own_group, initargs=(group, device))
        self.coll = Collectives(group, self.executor)
        self.pending: Optional[Future] = None  # the save in flight
        self.request: Optional[SaveRequest] = None  # until the loop has waited for its copy
        self.abandoned = False  # the job failed: the save in flight must not commit

    def _submit(self, request: SaveRequest, work: Callable[..., None], *args) -> None:
        """Run `work(*args, request)` on the save thread; the caller has
        waited for the previous save."""
        self.request = request
        self.pending = self.executor.submit(work, *args, request)

    def _loop_held(self, seconds: float) -> None:
        """The loop waited `seconds` for a save (a tier's pacing may count it)."""

    def before_update(self) -> None:
        """Call before anything modifies the saved tensors (the optimizer
        step): waits until the save releases the loop (its staging copy
        enqueued, on a GPU; then the training stream waits for the copy) and
        reports how long the loop was held."""
        if self.request is None:
            return
        started = self.clock.monotonic()
        with self.request.report.loop_waiting():
            wait_for(self.request.released)
        self.request.copy.order_before_update()
        self._loop_held(self.clock.monotonic() - started)
        self.request = None

    def wait(self) -> None:
        """Wait for the save in flight; re-raises its failure."""
        self.before_update()
        if self.pending is not None:
            pending, self.pending = self.pending, None
            started = self.clock.monotonic()
            wait_for(pending)
            self._loop_held(self.clock.monotonic() - started)

    def close(self) -> None:
        if not self.abandoned:
            self.wait()
        self.executor.shutdown(wait=not self.abandoned)

    def check_fence(self, fence: Fence, write: str) -> None:
        """The fence's check before a commit (Fence.check), which records no
        `fenced` for a save this tier abandoned."""
        fence.check(write, abandoned=lambda: self.abandoned)

    def abandon(self) -> None:
        """The job failed: do not wait for the save in flight (its peers may
        be gone, its collectives then wait out their timeout on the save
        thread) and do not let it commit or report."""
        self.abandoned = True
        self.pending = self.request = None
