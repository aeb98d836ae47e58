"""The collectives checkpointing needs, each on the thread that owns its group.

One thread, one process group (docs/architecture.md ("One thread, one
process group")): each checkpoint tier's background thread owns a process
group of its own (`own_group`, the thread's first act), and every collective
on that group runs on that thread; a caller on another thread hands the
collective over and waits for it in short slices (`wait_for`), so a hang
abort can still reach the caller and no two threads pair the wrong calls."""
from __future__ import annotations

import threading
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Callable, Optional, cast

import torch
import torch.distributed as dist

from megaresil.parallel.layout import use_device

_this_thread = threading.local()


def own_group(group: Optional[dist.ProcessGroup], device: torch.device) -> None:
    """First thing on a tier's save thread: it owns `group` (the tier's
    checkpoint group) and works on the trainer's device."""
    _this_thread.group = group
    use_device(device)


def owns(group: Optional[dist.ProcessGroup]) -> bool:
    """Whether the calling thread is the one that issues `group`'s collectives."""
    return getattr(_this_thread, "group", None) is group


def wait_for(waitable: threading.Event | Future, slice_s: float = 0.1):
    """Wait for an event or a future in short slices: a thread blocked in
    one long C-level wait never runs bytecode, so an abort raised in it (the
    watchdog's HangAbort) would never land."""
    if isinstance(waitable, threading.Event):
        while not waitable.wait(slice_s):
            pass
        return None
    while True:
        try:
            return waitable.result(timeout=slice_s)
        except FutureTimeout:
            continue


class Collectives:
    """The few collectives checkpointing needs, degrading to no-ops in a
    single process without a process group. Each is issued on the group's
    owning thread (`owner`, a one-thread executor): a caller on another
    thread hands it over and waits. Only the collective hops: the reading,
    writing and allocating stay on the caller's thread (a new thread's
    allocations land in a new malloc arena, which in-process restarts would
    pile up)."""

    def __init__(self, group: Optional[dist.ProcessGroup], owner: ThreadPoolExecutor):
        self.group, self.owner = group, owner
        self.rank = dist.get_rank() if group is not None else 0
        self.world = dist.get_world_size() if group is not None else 1

    def _on_owner(self, fn: Callable, *args):
        if owns(self.group):
            return fn(*args)
        return wait_for(self.owner.submit(fn, *args))

    def all_gather(self, obj) -> list:
        if self.group is None:
            return [obj]
        out = [None] * self.world
        self._on_owner(lambda: dist.all_gather_object(out, obj, group=self.group))
        return out

    def gather(self, obj) -> Optional[list]:
        """Every rank's `obj` on rank 0 (None elsewhere)."""
        if self.group is None:
            return [obj]
        out = [None] * self.world if self.rank == 0 else None
        self._on_owner(lambda: dist.gather_object(obj, out, group=self.group, group_dst=0))
        return out

    def barrier(self) -> None:
        if self.group is not None:
            self._on_owner(lambda: dist.barrier(group=self.group))

    def exchange(self, sends: list[tuple[int, int, torch.Tensor]],
                 recvs: list[tuple[int, int, torch.Tensor]]) -> None:
        """Point-to-point: send each (peer, tag, tensor), and fill each
        (peer, tag, tensor) from the send of that peer with that tag."""
        if self.group is not None:
            self._on_owner(lambda: [work.wait() for work in self._posted(sends, recvs)])

    def post(self, sends: list[tuple[int, int, torch.Tensor]],
             recvs: list[tuple[int, int, torch.Tensor]]) -> list[dist.Work]:
        """`exchange` started: its sends' and receives' works, in that order,
        each to be waited for with `finish`; the caller works meanwhile."""
        return [] if self.group is None else self._on_owner(self._posted, sends, recvs)

    def finish(self, work: dist.Work) -> None:
        """Wait for a posted work, once: a gloo receive waited for again
        waits for another message (checked on torch 2.13)."""
        self._on_owner(work.wait)

    def _posted(self, sends, recvs) -> list[dist.Work]:
        works = [dist.isend(t, dst=peer, group=self.group, tag=tag) for peer, tag, t in sends]
        works += [dist.irecv(t, src=peer, group=self.group, tag=tag) for peer, tag, t in recvs]
        # isend/irecv return None only to a rank outside the group; this one is in it.
        return cast(list[dist.Work], works)
