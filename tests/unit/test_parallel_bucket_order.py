"""Grad buckets are reduced in one order on every rank, whatever order the
grad hooks fire in (on CUDA they run on autograd's device thread, in an order
the engine does not promise): parallel/data_parallel.py's GradBuffers."""
from __future__ import annotations

import torch
import torch.nn as nn

from megaresil.parallel.data_parallel import GradBuffers


class Recorder:
    """A reducer that notes which buckets it was asked to reduce, in order."""

    def __init__(self, buckets_of):
        self.buckets_of, self.launched, self.landed_ = buckets_of, [], []

    def launch(self, bucket):
        self.launched.append(self.buckets_of().index(bucket))
        return None

    def landed(self, bucket):
        self.landed_.append(self.buckets_of().index(bucket))


def test_buckets_launch_in_index_order_when_hooks_fire_out_of_order():
    params = [nn.Parameter(torch.zeros(4)) for _ in range(6)]
    recorder = Recorder(lambda: grads.buckets)
    grads = GradBuffers(params, params, recorder, bucket_bytes=32)  # two params a bucket
    assert len(grads.buckets) == 3
    grads.arm()
    # Buckets fill from the last param back: bucket 0 holds params 5 and 4.
    # Buckets 2 and 1 become complete first (the hooks fire out of order).
    for param in params[:4]:
        grads._grad_ready(param)
    assert recorder.launched == []  # complete, but waiting for bucket 0
    for param in params[4:]:
        grads._grad_ready(param)
    assert recorder.launched == [0, 1, 2]
    grads.finish()
    assert recorder.launched == [0, 1, 2] and recorder.landed_ == [0, 1, 2]
    grads.close()


def test_unarmed_buckets_are_all_launched_in_order_by_finish():
    params = [nn.Parameter(torch.zeros(4)) for _ in range(4)]
    recorder = Recorder(lambda: grads.buckets)
    grads = GradBuffers(params, params, recorder, bucket_bytes=32)
    grads.arm()
    for param in params[:2]:  # bucket 1 complete, bucket 0 not (its params got no grad)
        grads._grad_ready(param)
    grads.finish()
    assert recorder.launched == [0, 1]
    grads.close()
