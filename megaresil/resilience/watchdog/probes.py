"""What the watchdog reads of its own process: the training thread's CPU
clock and where it waits, and the kind of machine a calibration holds on."""
from __future__ import annotations

import os
import platform
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist

TORCH_DISTRIBUTED = os.path.dirname(dist.__file__)


def thread_cpu_clock(thread_id: int) -> Callable[[], float]:
    """CPU seconds used by one thread of this process (process CPU time where
    the platform has no per-thread clock)."""
    try:
        clock = time.pthread_getcpuclockid(thread_id)
        time.clock_gettime(clock)
    except (AttributeError, OSError):
        return time.process_time
    return lambda: time.clock_gettime(clock)


def waiting_in_torch_distributed(thread_id: int) -> bool:
    """Whether the thread's innermost Python frame is torch.distributed's: it
    waits there on its peers (a collective, a group's creation, the store)."""
    frame = sys._current_frames().get(thread_id)
    return frame is not None and TORCH_DISTRIBUTED in frame.f_code.co_filename


def machine_kind() -> dict:
    """What a section's duration depends on besides the workload. The host
    name is not part of it: a relaunch onto other nodes of the same kind
    keeps its budgets."""
    cpu_model = platform.processor()
    try:
        cpu_model = next(line.split(":", 1)[1].strip() for line in
                         Path("/proc/cpuinfo").read_text().splitlines()
                         if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return {"cpu": cpu_model, "cores": len(os.sched_getaffinity(0)),
            "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None}
