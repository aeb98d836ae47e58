"""Measure activation memory as an allocator would: the bytes of every tensor
storage created while the meter is on, counted from its allocation until it is
freed, current and peak.

CUDA has allocator statistics (torch.cuda.max_memory_allocated); a CPU tensor
has none, so the meter watches the operations themselves: a dispatch mode sees
each aten op's outputs below autograd, so it also sees what autograd saves for
backward and what recomputation makes. A storage counts once, from the op that
allocated it (a view or an in-place op makes none), and stops counting when
torch frees it. Storages on another device than the meter's are host memory
(offloaded activations on CUDA); buffers reused from an earlier step (the CPU
host pool's) are allocated before the meter looks and so are not counted.
On the meta device the same count is the memory a run would allocate,
with none allocated (the memory estimate's forward).
"""
from __future__ import annotations

import gc
import weakref
from dataclasses import dataclass

import torch

from megaresil import compat


@dataclass
class MemoryReading:
    device_bytes: int  # live on the meter's device now
    peak_device_bytes: int  # most live at once since the meter started
    host_bytes: int
    peak_host_bytes: int


class ActivationMeter(compat.TorchDispatchMode):
    def __init__(self, device: torch.device):
        super().__init__()
        self.device = torch.device(device)
        self.live: dict[int, tuple[int, bool]] = {}  # storage identity -> (bytes, on device)
        self.now = {True: 0, False: 0}  # by "on device"
        self.peak = {True: 0, False: 0}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        existing = set()
        compat.tree_map_only(torch.Tensor, lambda t: existing.add(compat.storage_identity(t.untyped_storage())),
                             (args, kwargs))
        compat.tree_map_only(torch.Tensor, lambda t: self._allocated(t, existing), out)
        return out

    def _allocated(self, t: torch.Tensor, existing: set) -> None:
        storage = t.untyped_storage()
        key, size = compat.storage_identity(storage), storage.nbytes()
        if size == 0 or key in existing or key in self.live:
            return
        on_device = storage.device.type == self.device.type
        self.live[key] = (size, on_device)
        self.now[on_device] += size
        self.peak[on_device] = max(self.peak[on_device], self.now[on_device])
        weakref.finalize(storage, self._freed, key)

    def _freed(self, key: int) -> None:
        size, on_device = self.live.pop(key)
        self.now[on_device] -= size

    def reading(self) -> MemoryReading:
        # Storages caught in reference cycles are freed (and their finalizers
        # run) only when Python's collector runs, at a moment set by allocation
        # counts. Without collecting here the tp=2 test's reading came out one
        # (B, T, C) tensor high in ~1 run of 7; with it, 30 runs of 30 were exact.
        gc.collect()
        return MemoryReading(self.now[True], self.peak[True], self.now[False], self.peak[False])
