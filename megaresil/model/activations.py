"""Where the activations of full recomputation live: which layers are
checkpointed (the recompute plan), and how each checkpoint's stored input is
kept until backward (whole, split across the TP group, or in host memory).

`CheckpointStore` installs saved-tensor hooks around torch's non-reentrant
checkpoint: pack turns a group's input into its stored form (this rank's 1/tp
slice and/or a host copy), unpack turns it back before recomputation.
Recomputation redraws the same dropout masks, so every variant gives the
losses and grads of no recomputation. See docs/parallelism.md
("Activation memory").
"""
from __future__ import annotations

import weakref
from collections import defaultdict
from dataclasses import dataclass
from typing import Callable, Optional, Sequence, Union

import torch
import torch.distributed as dist
from torch.utils.checkpoint import checkpoint

from megaresil.config import ActivationOffload, ModelConfig, Recompute, RecomputePolicy
from megaresil.parallel.tensor_parallel import TPGroup, has_values

Segment = tuple[list[int], bool]  # (global layer ids, recomputed?)


def recompute_segments(cfg: ModelConfig, layer_ids: Sequence[int]) -> list[Segment]:
    """This chunk's layers cut into the groups that run as one unit, as
    Megatron's recompute methods cut them: uniform, groups of N layers, each
    group checkpointed; block, the first N layers checkpointed one by one and
    the rest run plainly."""
    ids, n = list(layer_ids), cfg.recompute_layers
    if cfg.recompute != Recompute.full:
        return [(ids, False)] if ids else []
    if cfg.recompute_policy == RecomputePolicy.uniform:
        return [(ids[i:i + n], True) for i in range(0, len(ids), n)]
    return [([i], True) for i in ids[:n]] + ([(ids[n:], False)] if ids[n:] else [])


# --- host memory -------------------------------------------------------------------


class HostPool:
    """Host buffers for offloaded activations, reused from step to step.

    On CUDA the buffers are pinned and filled on a side stream, so the copy
    overlaps the next layers' compute. On a CPU-only machine the "host" is the
    same memory, but the mechanism still runs: each stored tensor is copied
    into a buffer the pool owns and copied back out for backward, and the
    pool's counters (`bytes_in_use`, `peak_bytes`) say what it holds. Because
    the buffers are reused, a step after the first allocates nothing for its
    offloaded activations: an allocator meter sees them leave the device.
    """

    def __init__(self):
        self.stream: Optional[torch.cuda.Stream] = None  # made on first CUDA use
        self.free: dict[tuple[int, torch.dtype], list[tuple[torch.Tensor, Optional[torch.cuda.Event]]]] = \
            defaultdict(list)
        self.bytes_in_use = 0
        self.peak_bytes = 0

    def store(self, t: torch.Tensor) -> "Offloaded":
        buffer = self._take(t.numel(), t.dtype, pinned=t.is_cuda)
        if not t.is_cuda:
            if has_values(t):  # a meta tensor (the memory estimate's) has no values to copy
                buffer.copy_(t.reshape(-1))
            return Offloaded(self, buffer, t.shape, None)
        self.stream = self.stream or torch.cuda.Stream(t.device)
        self.stream.wait_stream(torch.cuda.current_stream(t.device))
        with torch.cuda.stream(self.stream):
            buffer.copy_(t.reshape(-1), non_blocking=True)
            t.record_stream(self.stream)  # t's memory is not reused before the copy is done
            copied = torch.cuda.Event()
            copied.record()
        return Offloaded(self, buffer, t.shape, copied)

    def _take(self, numel: int, dtype: torch.dtype, *, pinned: bool) -> torch.Tensor:
        free = self.free[(numel, dtype)]
        if free:
            buffer, last_read = free.pop()
            if last_read is not None:
                last_read.synchronize()  # the previous backward's copy out has finished
        else:
            buffer = torch.empty(numel, dtype=dtype, pin_memory=pinned)
        self.bytes_in_use += buffer.nbytes
        self.peak_bytes = max(self.peak_bytes, self.bytes_in_use)
        return buffer

    def give_back(self, buffer: torch.Tensor, last_read: Optional[torch.cuda.Event]) -> None:
        self.bytes_in_use -= buffer.nbytes
        self.free[(buffer.numel(), buffer.dtype)].append((buffer, last_read))


@dataclass
class _Lease:
    """A pool buffer lent to one stored tensor, and (CUDA) the event after
    which its last copy out is done, so the next user may overwrite it."""
    buffer: torch.Tensor
    last_read: Optional[torch.cuda.Event] = None


class Offloaded:
    """One tensor's host copy; its buffer returns to the pool when autograd
    drops the saved tensor (after backward, or with the graph)."""

    def __init__(self, pool: HostPool, buffer: torch.Tensor, shape: torch.Size,
                 copied: Optional[torch.cuda.Event]):
        self.lease, self.shape, self.copied = _Lease(buffer), shape, copied
        lease = self.lease  # the finalizer must not hold `self`
        weakref.finalize(self, lambda: pool.give_back(lease.buffer, lease.last_read))

    def load(self, device: torch.device) -> torch.Tensor:
        buffer = self.lease.buffer
        if self.copied is None:
            return buffer.clone().view(self.shape)
        stream = torch.cuda.current_stream(device)
        stream.wait_event(self.copied)
        out = buffer.to(device, non_blocking=True).view(self.shape)
        self.lease.last_read = stream.record_event()
        return out


# --- the stored form of a checkpoint's input ------------------------------------------


def own_slice(t: torch.Tensor, tp: TPGroup) -> torch.Tensor:
    """This rank's 1/tp of the flattened tensor (zero-padded to a multiple of
    tp), in memory of its own so the whole tensor can be freed."""
    flat = t.reshape(-1)
    per_rank = -(-flat.numel() // tp.size)
    flat = torch.nn.functional.pad(flat, (0, per_rank * tp.size - flat.numel()))
    return flat[tp.rank * per_rank:(tp.rank + 1) * per_rank].clone()


def gather_slices(part: torch.Tensor, tp: TPGroup, shape: torch.Size) -> torch.Tensor:
    """The whole tensor back from every rank's `own_slice`."""
    parts = [torch.empty_like(part) for _ in range(tp.size)]
    dist.all_gather(parts, part, group=tp.group)
    return torch.cat(parts)[: shape.numel()].view(shape)


@dataclass
class _Packed:
    stored: Union[torch.Tensor, Offloaded]  # a tensor (whole or this rank's slice) or its host copy
    shape: torch.Size
    device: torch.device


class CheckpointStore:
    """Runs a group of layers under full recomputation and keeps its stored
    input whole, split across the TP group (`partition`), in host memory
    (`pool`), or both (split first, so each rank offloads 1/tp)."""

    def __init__(self, *, partition: Optional[TPGroup] = None, pool: Optional[HostPool] = None):
        self.partition, self.pool = partition, pool

    @classmethod
    def for_model(cls, cfg: ModelConfig, tp: TPGroup) -> "CheckpointStore":
        return cls(partition=tp if cfg.activation_partition and tp.active else None,
                   pool=HostPool() if cfg.activation_offload == ActivationOffload.cpu else None)

    def run(self, layers: Callable[..., torch.Tensor], x: torch.Tensor,
            samples: Optional[torch.Tensor]) -> torch.Tensor:
        if self.partition is None and self.pool is None:
            return checkpoint(layers, x, samples, use_reentrant=False)
        with torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack):
            return checkpoint(layers, x, samples, use_reentrant=False)

    def pack(self, t: torch.Tensor) -> Union[torch.Tensor, _Packed]:
        if not t.is_floating_point():
            return t  # sample indices, document ids and masks: small, and not activations
        kept = t.detach()
        if self.partition is not None:
            kept = own_slice(kept, self.partition)
        stored = self.pool.store(kept) if self.pool is not None else kept
        return _Packed(stored, t.shape, t.device)

    def unpack(self, packed: Union[torch.Tensor, _Packed]) -> torch.Tensor:
        if isinstance(packed, torch.Tensor):
            return packed
        # Offloaded exactly when there is a pool (pack).
        stored = packed.stored
        t = stored.load(packed.device) if isinstance(stored, Offloaded) else stored
        if self.partition is not None:
            t = gather_slices(t, self.partition, packed.shape)
        return t
