"""A save's staging copy: the saved tensors copied to host memory, so training
may change them while the copy is written.

On CUDA the copy goes into pinned memory on a side stream: it starts after
the work the training stream had queued at the save call (an event recorded
there, so it sees the last optimizer step), it does not queue behind the
forward/backward the loop issues meanwhile, and the loop's next optimizer
step makes the training stream wait for the copy's own event before it
changes the weights. The save thread waits for that event on the host before
it reads the copy. On the CPU all of this is a plain copy.

A `StagingCopy` is made on the training thread at the save call; the copying
and the host wait run on the save thread (whose CUDA device is the trainer's:
parallel/layout.py `use_device`); `order_before_update` runs on the training thread again.
`StagingBuffers` keeps the host memory from one save to the next.
"""
from __future__ import annotations

from typing import Optional, Sequence

import torch

from megaresil.clock import Clock, SystemClock


class StagingCopy:
    def __init__(self, device: torch.device):
        """Call on the training thread at the save call, with the device of the
        tensors to be copied (on CUDA this records where the training stream
        stands)."""
        self.device = device if device.type == "cuda" else None
        self.ready: Optional[torch.cuda.Event] = None  # the training stream at the save call
        self.done: Optional[torch.cuda.Event] = None  # the side stream after the last copy
        if self.device is not None:
            self.ready = torch.cuda.Event()
            self.ready.record(torch.cuda.current_stream(self.device))

    @classmethod
    def of(cls, sources: Sequence[torch.Tensor]) -> "StagingCopy":
        """For copying `sources`: on the GPU if any of them is there."""
        return cls(next((t.device for t in sources if t.is_cuda), torch.device("cpu")))

    @property
    def on_gpu(self) -> bool:
        return self.device is not None

    def host_empty(self, shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
        """Host memory for the copy: pinned when it comes from the GPU (an
        asynchronous copy needs it; pageable memory would be staged by the driver)."""
        return torch.empty(tuple(shape), dtype=dtype, pin_memory=self.on_gpu)

    def to_host(self, sources: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """New host copies of `sources` (enqueued on the GPU; see wait_on_host)."""
        copies = [self.host_empty(t.shape, t.dtype) for t in sources]
        self.into(copies, sources)
        return copies

    def into(self, targets: Sequence[torch.Tensor], sources: Sequence[torch.Tensor]) -> None:
        """Copy each source into its host target; on CUDA, enqueue the copies
        on a side stream after the training stream's `ready` point and record
        `done` after them."""
        if not self.on_gpu:
            for target, source in zip(targets, sources):
                target.copy_(source)
            return
        assert self.ready is not None  # recorded at the save call, on a GPU
        stream = torch.cuda.Stream(self.device)
        stream.wait_event(self.ready)
        with torch.cuda.stream(stream):
            for target, source in zip(targets, sources):
                target.copy_(source, non_blocking=source.is_cuda)
                if source.is_cuda:
                    # The caching allocator must not hand a source's memory to
                    # the training stream while this stream still reads it.
                    source.record_stream(stream)
            self.done = torch.cuda.Event()
            self.done.record(stream)

    def wait_on_host(self) -> None:
        """Save thread, before reading the copies: they have landed."""
        if self.done is not None:
            self.done.synchronize()

    def landed_within(self, seconds: float, clock: Clock = SystemClock()) -> bool:
        """Whether the copies have landed, waiting `seconds` at most: after a
        failure a copy may be queued behind a kernel that never ends (a
        collective a lost peer left), and a caller that must not hang gives
        up on it."""
        deadline = clock.monotonic() + seconds
        while self.done is not None and not self.done.query():
            if clock.monotonic() > deadline:
                return False
            clock.sleep(0.01)
        return True

    def order_before_update(self) -> None:
        """Training thread, before the optimizer changes the saved tensors (and
        after the save thread has enqueued the copy): the training stream
        waits for the copy, on the GPU, without holding the host."""
        if self.done is not None:
            torch.cuda.current_stream(self.device).wait_event(self.done)


class StagingBuffers:
    """Host memory for a tier's staging copies, kept from one save to the
    next, as DCP's DefaultStager does (cache_staged_state_dict): new memory
    costs a page fault at the first touch of every page on the CPU, and
    cudaHostAlloc for pinned memory, both inside the copy the loop's next
    update waits for (bench/README.md has the measured effect). It holds a
    host copy of the rank's written state between saves.

    One save at a time takes the buffers and gives them back once they are
    written; a save that fails keeps them, and the next allocates anew."""

    def __init__(self) -> None:
        self.kept: list[torch.Tensor] = []

    def copy(self, copy: StagingCopy, sources: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """Host copies of `sources` (StagingCopy.to_host) in the kept buffers
        when they fit them exactly, in new ones otherwise."""
        kept, self.kept = self.kept, []
        if not _fit(kept, sources, pinned=copy.on_gpu):
            return copy.to_host(sources)
        copy.into(kept, sources)
        return kept

    def give_back(self, buffers: list[torch.Tensor]) -> None:
        """The save has written `buffers`: the next one may copy into them."""
        self.kept = buffers


def _fit(buffers: Sequence[torch.Tensor], sources: Sequence[torch.Tensor], pinned: bool) -> bool:
    return len(buffers) == len(sources) and all(
        b.shape == s.shape and b.dtype == s.dtype and b.is_pinned() == pinned
        for b, s in zip(buffers, sources))
