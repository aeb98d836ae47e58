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

import os
import signal
import threading
import time
from typing import Optional

import torch
import torch.distributed as dist

# `megaresil train`'s exit status after a preemption save (run it again to
# continue): EX_TEMPFAIL, so schedulers can requeue on it.
PREEMPTED_EXIT = 75


class PreemptionFlag:
    def __init__(self) -> None:
        self.signalled_at: Optional[float] = None
        self.signal_name = ""
        self.saving_possible = False  # set while a job trains and could save

    def install(self) -> "PreemptionFlag":
        for sig in (signal.SIGTERM, signal.SIGUSR1):
            signal.signal(sig, self._handler)
        read_end, write_end = os.pipe()
        os.set_blocking(write_end, False)
        signal.set_wakeup_fd(write_end)
        threading.Thread(target=self._hear, args=(read_end,), name="megaresil-signals",
                         daemon=True).start()
        return self

    def _hear(self, read_end: int) -> None:
        while True:
            for signum in os.read(read_end, 64):
                if signum == signal.SIGTERM and not self.saving_possible:
                    os._exit(128 + signal.SIGTERM)

    def _handler(self, signum, _frame) -> None:
        if self.signalled_at is None:
            self.signalled_at = time.time()
            self.signal_name = signal.Signals(signum).name

    def requested_anywhere(self, group: Optional[dist.ProcessGroup] = None) -> bool:
        """True on every rank when any rank was signalled (a collective)."""
        flag = torch.tensor([int(self.signalled_at is not None)])
        if dist.is_initialized():
            dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
        return bool(flag.item())
