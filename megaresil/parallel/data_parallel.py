"""Gradients in contiguous buffers, reduced over data parallelism in buckets
(megaresil's own, not DistributedDataParallel).

Each bucket owns one flat buffer and every grad is a view into it (fp32 main
grads under bf16, filled by a post-accumulate-grad hook). On the step's last
micro-batch each ready bucket is reduced asynchronously during backward (an
all-reduce, or the distributed optimizer's reduce-scatter), strictly in bucket
index order so every rank issues the same collectives in the same order.
docs/parallelism.md ("How it works") explains why, and which thread issues
these collectives.
"""
from __future__ import annotations

from typing import Optional, Protocol

import torch
import torch.distributed as dist
import torch.nn as nn

from megaresil.compat import release_failed_backward
from megaresil.parallel.sharding import spec_of

DEFAULT_BUCKET_BYTES = 25 * 2**20


class Bucket:
    """A run of parameters whose grads share one flat buffer."""

    def __init__(self, params: list[nn.Parameter], targets: list[nn.Parameter],
                 dtype: torch.dtype):
        self.params = params  # what the model computes with (autograd's leaves)
        self.targets = targets  # what the optimizer steps (params, or whole main copies)
        self.buffer = torch.zeros(sum(p.numel() for p in params), dtype=dtype,
                                  device=params[0].device)
        self.views: list[torch.Tensor] = []
        offset = 0
        for param in params:
            self.views.append(self.buffer[offset:offset + param.numel()].view_as(param))
            offset += param.numel()
        self.ready = 0
        self.work: Optional[dist.Work] = None


class Reducer(Protocol):
    """What happens to a bucket's summed grads once they are final."""

    def launch(self, bucket: Bucket) -> Optional[dist.Work]:
        """Start reducing `bucket` (asynchronously); None when nothing is pending."""

    def landed(self, bucket: Bucket) -> None:
        """`bucket`'s reduction finished: put its result where the optimizer reads it."""


class AllReduceMean:
    """Average every bucket over a data-parallel group, in place."""

    def __init__(self, group: dist.ProcessGroup, size: int):
        self.group, self.size = group, size

    def launch(self, bucket: Bucket) -> Optional[dist.Work]:
        bucket.buffer.div_(self.size)
        return dist.all_reduce(bucket.buffer, group=self.group, async_op=True)

    def landed(self, bucket: Bucket) -> None:
        pass  # reduced in place: the grads already are the views


class Mean:
    """Divide every bucket by the batches its grads were summed over, with
    no collective (a group of one rank whose grads hold several ranks'
    batches: experts with every data-parallel rank in their ep group)."""

    def __init__(self, size: int):
        self.size = size

    def launch(self, bucket: Bucket) -> Optional[dist.Work]:
        bucket.buffer.div_(self.size)
        return None

    def landed(self, bucket: Bucket) -> None:
        pass


def make_buckets(params: list[nn.Parameter], targets: list[nn.Parameter],
                 dtype: torch.dtype, bucket_bytes: int) -> list[Bucket]:
    """Buckets of about `bucket_bytes` of `dtype` grads, filled in reverse
    order of definition, the order in which backward makes grads ready."""
    buckets: list[Bucket] = []
    current: list[tuple[nn.Parameter, nn.Parameter]] = []
    used = 0
    size = torch.empty((), dtype=dtype).element_size()
    for param, target in reversed(list(zip(params, targets))):
        current.append((param, target))
        used += param.numel() * size
        if used >= bucket_bytes:
            buckets.append(_bucket(current, dtype))
            current, used = [], 0
    if current:
        buckets.append(_bucket(current, dtype))
    return buckets


def _bucket(pairs: list[tuple[nn.Parameter, nn.Parameter]], dtype: torch.dtype) -> Bucket:
    """The bucket of `pairs` of (param, target), in their order."""
    return Bucket([param for param, _ in pairs], [target for _, target in pairs], dtype)


class GradBuffers:
    """The grads of `params` in per-bucket flat buffers of `grad_dtype` (default:
    the targets'), reduced by `reducer` (None: nothing to reduce, dp=1)
    overlapped with backward. Each `target` (the param itself, or its whole
    fp32 main copy) whose dtype is the buffer's gets its view as `.grad`; a
    bf16 target does not (the distributed optimizer's shards take their rows
    from the reducer)."""

    def __init__(self, params: list[nn.Parameter], targets: list[nn.Parameter],
                 reducer: Optional[Reducer], bucket_bytes: int = DEFAULT_BUCKET_BYTES, *,
                 grad_dtype: Optional[torch.dtype] = None):
        self.reducer = reducer
        grad_dtype = grad_dtype or targets[0].dtype
        self.buckets = make_buckets(params, targets, grad_dtype, bucket_bytes)
        self.bucket_of: dict[nn.Parameter, Bucket] = {}
        self.view_of: dict[nn.Parameter, torch.Tensor] = {}
        for bucket in self.buckets:
            for param, target, view in zip(bucket.params, bucket.targets, bucket.views):
                self.bucket_of[param], self.view_of[param] = bucket, view
                if target.dtype == grad_dtype:
                    target.grad = view
        # Grads land in `.grad` and are folded into the views by the hook.
        self.separate = any(p is not t or p.dtype != grad_dtype
                            for p, t in zip(params, targets))
        self.armed = False
        self.next_launch = 0  # index of the first bucket not launched yet
        self.handles = [p.register_post_accumulate_grad_hook(self._grad_ready) for p in params]

    def close(self) -> None:
        """Remove the grad hooks. A hook and its parameter reference each other
        partly through autograd's C++ side, a cycle Python's collector cannot
        break: without this a dropped trainer (an in-process restart) would
        keep its whole model alive. Called on the thread that ran the
        backwards, it also releases a backward an exception left from inside
        the hook (compat.release_failed_backward): a lost peer's error in a
        launch, or a hang abort, which lands at any bytecode, the hook's first
        included, so whether one did is not known here."""
        for handle in self.handles:
            handle.remove()
        self.handles = []
        if self.buckets:
            release_failed_backward(self.buckets[0].buffer.device)

    def arm(self) -> None:
        """The next backward is the step's last micro-batch: reduce as grads land."""
        self.armed = self.reducer is not None
        self.next_launch = 0
        for bucket in self.buckets:
            bucket.ready, bucket.work = 0, None

    def _grad_ready(self, param: nn.Parameter) -> None:
        self._fold(param)
        if not self.armed:
            return
        self.bucket_of[param].ready += 1
        self._launch_ready_in_order()

    def _launch_ready_in_order(self) -> None:
        """Launch the run of complete buckets from `next_launch` on: the same
        order on every rank, whatever order the hooks fired in."""
        while self.next_launch < len(self.buckets):
            bucket = self.buckets[self.next_launch]
            if bucket.ready < len(bucket.params):
                return
            self._launch(bucket)

    def _fold(self, param: nn.Parameter) -> None:
        """Move a bf16 grad into its fp32 main grad (no-op when they are one)."""
        if self.separate and param.grad is not None:
            self.view_of[param].add_(param.grad)
            param.grad = None

    def fold_all(self, divisor: int = 1) -> None:
        """Fold grads that reached `.grad` without the hook (a schedule's
        `autograd.grad` path), then divide the sums by `divisor` (a pipeline's
        micro-batch count: its schedule leaves them unscaled)."""
        for param in self.bucket_of:
            self._fold(param)
        if divisor != 1:
            for bucket in self.buckets:
                bucket.buffer.div_(divisor)

    def _launch(self, bucket: Bucket) -> None:
        assert self.reducer is not None  # launches happen armed, or in finish() with a reducer
        bucket.work = self.reducer.launch(bucket)
        self.next_launch += 1

    def finish(self) -> None:
        """Wait for every bucket's reduction. Buckets the hooks did not launch
        (not armed, e.g. under a pipeline schedule that runs all backwards
        itself, or a param got no grad this step) are reduced now."""
        if self.reducer is None:
            return
        for bucket in self.buckets[self.next_launch:]:
            self._launch(bucket)
        for bucket in self.buckets:
            if bucket.work is not None:
                bucket.work.wait()
            self.reducer.landed(bucket)
            bucket.work = None
        self.armed, self.next_launch = False, 0

    def zero(self) -> None:
        """Start the next step's accumulation (the views stay in place)."""
        for bucket in self.buckets:
            bucket.buffer.zero_()


def all_reduce_sequence_parallel_grads(entries: list[tuple[nn.Parameter, torch.Tensor]],
                                       tp_group: Optional[dist.ProcessGroup]) -> None:
    """Sum grads of replicated params that saw only a sequence shard (SP).
    `entries` pairs each param with the grad this rank holds of it."""
    grads = [g for p, g in entries if "tp" in spec_of(p).grad_sum_axes]
    if tp_group is None or not grads:
        return
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat, group=tp_group)
    offset = 0
    for grad in grads:
        grad.copy_(flat[offset:offset + grad.numel()].view_as(grad))
        offset += grad.numel()
