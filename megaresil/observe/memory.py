"""Peak memory of this rank: CUDA's max allocated on a GPU, else the
process's peak resident set (what the kernel counted, all threads)."""
from __future__ import annotations

import resource
import sys

import torch


def peak_memory_mb(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux, bytes on macOS
    return peak / 2**20 if sys.platform == "darwin" else peak / 2**10
