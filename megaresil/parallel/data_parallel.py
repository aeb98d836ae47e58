"""Gradients in contiguous buffers, reduced over data parallelism in buckets.

Why not DistributedDataParallel: it hides which grads are final behind its
reducer, its first use imports torch._dynamo (seconds of restart time on a
small CPU box), and the distributed optimizer needs a reduce-scatter path that
DDP does not offer.

Every bucket owns one flat buffer and each of its parameters' grads is a view
into it (Megatron's grad buffer, DDP's gradient_as_bucket_view), so a step
allocates, concatenates and copies nothing: the buffer is reduced in place.
Two ways a grad lands in its view:
- same dtype (fp32 training): `param.grad` *is* the view before backward
  starts, and autograd accumulates into it in place;
- bf16 parameters with fp32 main grads (train.precision=bf16): the buffer is
  fp32 and a post-accumulate-grad hook adds each micro-batch's bf16 grad into
  the view and frees the bf16 grad, so accumulation over micro-batches happens
  in fp32, as Megatron's `main_grad` does. The view is the whole fp32 main
  parameter's `.grad`, or, under the distributed optimizer (which keeps only
  its rows of the main parameters), no tensor's: the reduce-scatter hands
  each rank its rows.

On the micro-batch that ends a step, a bucket whose grads are all ready is
handed to the reducer (an all-reduce here, a reduce-scatter in the distributed
optimizer) asynchronously while backward goes on through the earlier layers,
so communication overlaps compute. Earlier micro-batches only accumulate
locally: one sync per optimizer step.

Which thread issues these collectives (design.md: one thread, one process
group). The grad hooks run on the thread that executes the parameters'
AccumulateGrad nodes: the training thread on CPU, autograd's worker thread
for the device on CUDA (the same thread that runs the TP layers' backward
collectives). That is still one issuer at a time, in one total order: the
training thread issues its DP collectives before and after `backward()`, and
is blocked inside it, waiting for the graph, while the worker thread runs
the hooks; `backward()` returns only when they are done. PyTorch DDP's
reducer launches from the same hooks on the same argument. Autograd's engine
sets the worker thread's CUDA device to its own, so NCCL calls go to the
right GPU. What the hooks cannot promise is the order in which buckets become
ready on every rank (a graph's readiness order is an engine detail), so, as
DDP does, buckets are launched strictly in index order: a bucket that is
ready before its predecessors waits for them. Every rank then issues the
same collectives in the same order whatever order the hooks fire in.
"""
from __future__ import annotations

from typing import Optional, Protocol

import torch
import torch.distributed as dist
import torch.nn as nn

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


def make_buckets(params: list[nn.Parameter], targets: list[nn.Parameter],
                 dtype: torch.dtype, bucket_bytes: int) -> list[Bucket]:
    """Buckets of about `bucket_bytes` of `dtype` grads, filled in reverse
    order of definition, the order in which backward makes grads ready."""
    buckets, current, used = [], [], 0
    size = torch.empty((), dtype=dtype).element_size()
    for param, target in reversed(list(zip(params, targets))):
        current.append((param, target))
        used += param.numel() * size
        if used >= bucket_bytes:
            buckets.append(Bucket(*map(list, zip(*current)), dtype))
            current, used = [], 0
    if current:
        buckets.append(Bucket(*map(list, zip(*current)), dtype))
    return buckets


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
        keep its whole model alive."""
        for handle in self.handles:
            handle.remove()
        self.handles = []

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
    grads = [g for p, g in entries if getattr(p, "sequence_parallel", False)]
    if tp_group is None or not grads:
        return
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat, group=tp_group)
    offset = 0
    for grad in grads:
        grad.copy_(flat[offset:offset + grad.numel()].view_as(grad))
        offset += grad.numel()
