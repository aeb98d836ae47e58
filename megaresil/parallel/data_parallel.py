"""Data-parallel gradient averaging with our own buckets.

Why not DistributedDataParallel: it hides which grads are final behind its
reducer, its first use imports torch._dynamo (seconds of restart time on a
small CPU box), and the distributed optimizer needs a reduce-scatter path that
DDP does not offer. Here every parameter gets a post-accumulate-grad hook; on
the micro-batch that ends a step, a bucket whose grads are all ready is
flattened and all-reduced asynchronously while backward goes on through the
earlier layers, so communication overlaps compute. Earlier micro-batches only
accumulate locally: one sync per optimizer step.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist
import torch.nn as nn

DEFAULT_BUCKET_BYTES = 25 * 2**20


class _Bucket:
    def __init__(self, params: list[nn.Parameter]):
        self.params = params
        self.ready = 0
        self.flat: Optional[torch.Tensor] = None
        self.work: Optional[dist.Work] = None


class GradBuckets:
    """Averages `.grad` over `group` in buckets, overlapped with backward."""

    def __init__(self, params: list[nn.Parameter], group: dist.ProcessGroup, size: int,
                 bucket_bytes: int = DEFAULT_BUCKET_BYTES):
        self.group, self.size = group, size
        self.buckets = self._make_buckets(params, bucket_bytes)
        self.bucket_of = {p: b for b in self.buckets for p in b.params}
        self.armed = False
        self.handles = [p.register_post_accumulate_grad_hook(self._grad_ready) for p in params]

    @staticmethod
    def _make_buckets(params: list[nn.Parameter], bucket_bytes: int) -> list[_Bucket]:
        # Grads become ready roughly in reverse order of definition.
        buckets, current, used = [], [], 0
        for param in reversed(params):
            current.append(param)
            used += param.numel() * param.element_size()
            if used >= bucket_bytes:
                buckets.append(_Bucket(current))
                current, used = [], 0
        if current:
            buckets.append(_Bucket(current))
        return buckets

    def close(self) -> None:
        """Remove the grad hooks. A hook and its parameter reference each other
        partly through autograd's C++ side, a cycle Python's collector cannot
        break: without this a dropped trainer (an in-process restart) would
        keep its whole model alive."""
        for handle in self.handles:
            handle.remove()
        self.handles = []

    def arm(self) -> None:
        """The next backward is the step's last micro-batch: sync as grads land."""
        self.armed = True
        for bucket in self.buckets:
            bucket.ready, bucket.work = 0, None

    def _grad_ready(self, param: nn.Parameter) -> None:
        if not self.armed:
            return
        bucket = self.bucket_of[param]
        bucket.ready += 1
        if bucket.ready == len(bucket.params):
            self._launch(bucket)

    def _launch(self, bucket: _Bucket) -> None:
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in bucket.params]
        bucket.flat = torch.cat([g.reshape(-1) for g in grads]).div_(self.size)
        bucket.work = dist.all_reduce(bucket.flat, group=self.group, async_op=True)

    def finish(self) -> None:
        """Wait for every bucket and write the averaged grads back. Buckets the
        hooks did not launch (not armed, e.g. under a pipeline schedule that
        runs all backwards itself) are reduced now."""
        for bucket in self.buckets:
            if bucket.work is None:  # a param got no grad this step
                self._launch(bucket)
            bucket.work.wait()
            offset = 0
            for param in bucket.params:
                n = param.numel()
                param.grad = bucket.flat[offset:offset + n].view_as(param).clone()
                offset += n
            bucket.flat, bucket.work = None, None
        self.armed = False


def all_reduce_sequence_parallel_grads(params: list[nn.Parameter],
                                       tp_group: Optional[dist.ProcessGroup]) -> None:
    """Sum grads of replicated params that saw only a sequence shard (SP)."""
    grads = [p.grad for p in params if getattr(p, "sequence_parallel", False)
             and p.grad is not None]
    if tp_group is None or not grads:
        return
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat, group=tp_group)
    offset = 0
    for grad in grads:
        grad.copy_(flat[offset:offset + grad.numel()].view_as(grad))
        offset += grad.numel()
