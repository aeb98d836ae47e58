"""Preemption: SIGTERM (and SIGUSR1, which schedulers send as an early warning)
set a flag; the training loop combines it over all ranks after every step, so
every rank stops at the same step, saves, writes a `preempted` event and exits."""
from __future__ import annotations

import signal
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

    def install(self) -> "PreemptionFlag":
        for sig in (signal.SIGTERM, signal.SIGUSR1):
            signal.signal(sig, self._handler)
        return self

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
