"""What a declared hang does to this process: the side effects. Collective
timeouts, stack dumps, the NCCL abort and HangAbort in the training thread,
the exit (HANG_EXIT_CODE) when that does not free it, and the guardian side
process for a training thread that starves the monitor of the GIL.
See docs/watchdog.md."""
from __future__ import annotations

import ctypes
import faulthandler
import mmap
import os
import signal
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import torch.distributed as dist

from megaresil.clock import Clock
from megaresil.compat import abort_process_groups, has_nccl_groups, process_groups, set_gloo_timeout
from megaresil.events import EventLog
from megaresil.safe_files import open_nofollow, own_dir, write_atomic

NCCL_WORKER_ENV = {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "0"}  # we abort NCCL ourselves
HANG_EXIT_CODE = 86  # a hang this process cannot recover from: the launcher restarts the group
# After HangAbort, how long past the hard limit the training thread may take to
# leave the generation (the limit covers a gloo op that returns at its timeout).
ABORT_GRACE_S = 5.0


class HangAbort(BaseException):
    """Raised in the training thread when the job aborts a hung generation.

    A BaseException so that `except Exception` blocks in library code do not
    swallow it on the way up to the restart logic."""


def raise_in_thread(thread_id: int, exc_type: type | None) -> bool:
    """Schedule `exc_type` in a thread at its next Python bytecode (None
    clears a pending one). False when no such thread exists (it ended)."""
    set_async_exc = ctypes.pythonapi.PyThreadState_SetAsyncExc
    changed = set_async_exc(ctypes.c_ulong(thread_id),
                            ctypes.py_object(exc_type) if exc_type else None)
    if changed > 1:  # the id matched several thread states: undo, touch none
        set_async_exc(ctypes.c_ulong(thread_id), None)
        raise SystemError(f"raise_in_thread: thread id {thread_id} matched {changed} "
                          "thread states; nothing was raised")
    return changed == 1


def set_collective_timeouts(seconds: float, exempt: set) -> None:
    """Timeout of collectives started from now on, in every gloo group but
    the exempt ones (checkpoint traffic has its own budget). A gloo op
    already blocked cannot be freed from outside: it returns at its timeout."""
    for group in process_groups():
        if group not in exempt:
            set_gloo_timeout(group, seconds)


def abort_nccl_groups() -> None:
    """Abort the NCCL communicators: ops blocked in them return (gloo has no
    such abort)."""
    if dist.is_initialized() and has_nccl_groups():
        abort_process_groups()


def dump_stacks(path: Path, headline: str, mode: str) -> None:
    """`headline` and every thread's stack into a hang dump."""
    own_dir(path.parent)
    with open_nofollow(path, mode) as f:
        f.write(headline + "\n")
        faulthandler.dump_traceback(file=f, all_threads=True)


class ExitTimer:
    """Runs `on_expiry` `seconds` after it is armed unless cancelled first, on
    a thread of its own: it is armed before the NCCL abort, which runs on the
    monitor thread and can itself block for ever (a teardown queued behind a
    kernel that never ends)."""

    def __init__(self, clock: Clock):
        self.clock = clock
        self.cancelled: threading.Event | None = None

    def arm(self, seconds: float, on_expiry: Callable[[], None]) -> None:
        self.cancel()
        self.cancelled = cancelled = threading.Event()
        threading.Thread(target=self._run, args=(seconds, cancelled, on_expiry),
                         name="megaresil-hang-exit", daemon=True).start()

    def _run(self, seconds: float, cancelled: threading.Event,
             on_expiry: Callable[[], None]) -> None:
        if not self.clock.wait(cancelled, seconds):
            on_expiry()

    def cancel(self) -> None:
        if self.cancelled is not None:
            self.cancelled.set()


def exit_for_relaunch(events: EventLog, dump: Path, *, section: str, generation: int) -> None:
    """The training thread was told to abort and still has not left the
    generation: it is blocked where no exception reaches it, in C code
    that released the GIL (a native call that never returns, a CUDA
    synchronize on a kernel that never ends; NCCL's abort does not free
    those), or the abort itself never returned. Only a new process frees
    it: exit, and the launcher restarts the worker group."""
    # The incident line, and what the relaunch names as its cause (restart.last_failure).
    events.emit("worker_error", error="not freed by the hang abort (blocked in native "
                "code or on the device): exiting for a relaunch",
                section=section, lost_peer=False, fatal=False,
                generation=generation, pid=os.getpid())
    dump_stacks(dump, "not freed by the abort: exiting", "a")
    os._exit(HANG_EXIT_CODE)


class Guardian:
    """The stdlib-only side process (guardian.py) that catches a training
    thread holding the GIL in C code: the monitor ticks a memory-mapped
    file at every poll; a stale tick gets a stack dump (SIGUSR2) and a kill."""

    def __init__(self, hang_dir: Path, rank: int, gil_timeout_s: float):
        own_dir(hang_dir)
        tick_path = hang_dir / f".tick.rank{rank}"
        write_atomic(tick_path, struct.pack("d", time.monotonic()))
        with open(tick_path, "r+b") as tick_file:
            self.ticks = mmap.mmap(tick_file.fileno(), 8)
        # Kept open: faulthandler writes to it from the signal handler.
        self.dump_file = open_nofollow(hang_dir / f"gil_rank{rank}.txt", "w")
        faulthandler.register(signal.SIGUSR2, file=self.dump_file, all_threads=True)
        self.process = subprocess.Popen(
            [sys.executable, "-m", "megaresil.resilience.guardian", str(os.getpid()),
             str(tick_path), str(gil_timeout_s)], start_new_session=False)

    def tick(self) -> None:
        # The real monotonic clock, whatever the watchdog's: the guardian
        # compares it with its own CLOCK_MONOTONIC, shared by the host.
        self.ticks[:8] = struct.pack("d", time.monotonic())

    def stop(self) -> None:
        self.process.terminate()
