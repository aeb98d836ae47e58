"""Preemption: SIGTERM (and SIGUSR1, which schedulers send as an early warning)
set a flag; the training loop combines it over all ranks after every step, so
every rank stops at the same step, saves, writes a `preempted` event and exits.

A SIGTERM that comes while no save is possible (before training starts, or
while a failed generation is being torn down and restarted) ends the process
at once: that is also how the TorchElastic agent stops a worker group it is
about to relaunch, and waiting out the grace period there would cost every
relaunch a minute. The main thread may then be blocked in C (a store or
collective wait), where Python signal handlers do not run, so a small thread
hears the signal through the wakeup fd, which the C-level handler writes."""
from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
import time
from typing import Iterator, Optional

import psutil
import torch
import torch.distributed as dist

# `megaresil train`'s exit status after a preemption save (run it again to
# continue): EX_TEMPFAIL, so schedulers can requeue on it.
PREEMPTED_EXIT = 75
# After Ctrl-C (SIGINT): saved, as a shell reports a job ended by SIGINT.
INTERRUPTED_EXIT = 128 + signal.SIGINT
# How a stop was asked for, combined over ranks by MAX: an interrupt wins.
STOP_KINDS = {0: None, 1: "preempted", 2: "interrupted"}


class PreemptionFlag:
    def __init__(self) -> None:
        self.signalled_at: Optional[float] = None
        self.signal_name = ""
        self.saving_possible = False  # set while a job trains and could save

    def install(self) -> "PreemptionFlag":
        # SIGINT (Ctrl-C) takes the SIGTERM path: no KeyboardInterrupt
        # unwinding mid-step on every rank, but a save at the step's end.
        for sig in (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT):
            signal.signal(sig, self._handler)
        read_end, write_end = os.pipe()
        os.set_blocking(write_end, False)
        signal.set_wakeup_fd(write_end)
        threading.Thread(target=self._hear, args=(read_end,), name="megaresil-signals",
                         daemon=True).start()
        return self

    def _hear(self, read_end: int) -> None:
        # Counted here, not by the handler: that runs only when the main
        # thread returns to Python, which a step in C may not do for minutes.
        interrupts = 0
        while True:
            for signum in os.read(read_end, 64):
                if signum in (signal.SIGTERM, signal.SIGINT) and not self.saving_possible:
                    os._exit(128 + signum)
                interrupts += signum == signal.SIGINT
                if interrupts > 1:
                    # A second Ctrl-C: the user does not want the save.
                    print("megaresil: second Ctrl-C: stopping at once, without saving",
                          file=sys.stderr, flush=True)
                    os._exit(INTERRUPTED_EXIT)

    def _handler(self, signum, _frame) -> None:
        if self.signalled_at is None:
            self.signalled_at = time.time()
            self.signal_name = signal.Signals(signum).name

    def requested_anywhere(self, group: Optional[dist.ProcessGroup] = None) -> Optional[str]:
        """On every rank, how any rank was told to stop: "interrupted"
        (SIGINT), "preempted" (SIGTERM, SIGUSR1) or None (a collective)."""
        flag = torch.tensor([self._kind()])
        if dist.is_initialized():
            dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
        return STOP_KINDS[int(flag.item())]

    def _kind(self) -> int:
        if self.signalled_at is None:
            return 0
        return 2 if self.signal_name == "SIGINT" else 1


@contextlib.contextmanager
def second_interrupt_kills_workers() -> Iterator[None]:
    """The launcher's side of a second Ctrl-C. TorchElastic's agent meets the
    first SIGINT by handing it to the workers (in sessions of their own, so
    the terminal's signal reaches only the agent) and waiting while they
    finish the step and save; a second SIGINT in that wait only starts the
    wait again (its shutdown runs once more, with SIGTERM). So here the second
    SIGINT the launcher hears kills the workers at once; the launcher then
    says so (launch.agent.interrupted)."""
    read_end, write_end = os.pipe()
    os.set_blocking(write_end, False)
    previous = signal.set_wakeup_fd(write_end)

    def hear() -> None:
        interrupts = 0
        try:
            while not done.is_set():  # reading on after the kill: the pipe never fills
                before, interrupts = interrupts, interrupts + os.read(read_end, 64).count(
                    signal.SIGINT)
                if before < 2 <= interrupts:
                    kill_descendants()
        finally:
            os.close(read_end)

    done = threading.Event()
    threading.Thread(target=hear, name="megaresil-second-interrupt", daemon=True).start()
    try:
        yield
    finally:
        signal.set_wakeup_fd(previous)
        done.set()
        os.write(write_end, b"\0")  # wakes the thread, which then closes its end
        os.close(write_end)


def kill_descendants() -> None:
    for child in psutil.Process().children(recursive=True):
        with contextlib.suppress(psutil.NoSuchProcess):  # one may end meanwhile
            child.kill()
