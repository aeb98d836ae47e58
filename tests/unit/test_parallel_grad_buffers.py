"""Contiguous grad buffers and the bucketed distributed optimizer, in one process.

The multi-rank exactness of both (every layout against the single-process run)
is tests/multirank/test_parallel_equivalence.py's; here: grads live in the buckets'
buffers and stay there step after step, bf16 grads accumulate in fp32, and the
distributed optimizer issues one collective per bucket, not per parameter.
"""
from __future__ import annotations

import gc
import weakref

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

from megaresil.parallel.data_parallel import GradBuffers
from megaresil.parallel.distributed_optimizer import DistributedOptimizer
from megaresil.train.precision import MainParams


def tiny_model(seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))


def inside(view: torch.Tensor, buffer: torch.Tensor) -> bool:
    start = buffer.data_ptr()
    end = start + buffer.numel() * buffer.element_size()
    return start <= view.data_ptr() < end


def backward_twice(model: nn.Module, grads: GradBuffers) -> None:
    """Two micro-batches, the reduction armed for the last, as the trainer does."""
    for seed in (1, 2):
        if seed == 2:
            grads.arm()
        x = torch.randn(3, 8, generator=torch.Generator().manual_seed(seed))
        model(x.to(next(model.parameters()).dtype)).float().square().mean().backward()
    grads.finish()


def test_grads_accumulate_in_place_in_their_bucket_buffer():
    model, reference = tiny_model(), tiny_model()
    params = list(model.parameters())
    # A bucket per ~one layer: more than one bucket, each shared by params.
    grads = GradBuffers(params, params, reducer=None, bucket_bytes=300)
    assert len(grads.buckets) > 1
    pointers = [p.grad.data_ptr() for p in params]
    for _ in range(2):  # two steps: the views survive zero()
        backward_twice(model, grads)
        for seed in (1, 2):
            x = torch.randn(3, 8, generator=torch.Generator().manual_seed(seed))
            reference(x).square().mean().backward()
        for param, want in zip(params, reference.parameters()):
            assert inside(param.grad, grads.bucket_of[param].buffer)
            torch.testing.assert_close(param.grad, want.grad, rtol=0, atol=0)
        assert [p.grad.data_ptr() for p in params] == pointers
        grads.zero()
        reference.zero_grad()
    grads.close()


class Holding(torch.autograd.Function):
    """Identity that keeps an object in its context, as the TP functions keep
    their process group."""

    @staticmethod
    def forward(ctx, x, held):
        ctx.held = held
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class Held:
    pass


def test_a_backward_that_failed_inside_the_hook_is_let_go_at_close(monkeypatch):
    """Torch keeps the graph of a backward an exception left from inside a
    post-accumulate-grad hook (a hang abort landing there, a lost peer's
    error in a launch): with it a TP function's process group, whose open
    connections kept a peer waiting for its timeout. close() lets it go."""
    model = tiny_model()
    params = list(model.parameters())
    grads = GradBuffers(params, params, reducer=None)
    held = Held()
    kept = weakref.ref(held)

    def fail(param):
        raise KeyboardInterrupt("an abort landing in the hook")

    monkeypatch.setattr(grads, "_fold", fail)
    # The last layer's hooks fail while the held context's node still waits.
    hidden = Holding.apply(model[0](torch.randn(3, 8)), held)
    loss = model[2](model[1](hidden)).square().mean()
    try:
        loss.backward()
    except KeyboardInterrupt:
        pass
    else:
        pytest.fail("the hook's exception did not reach the caller")
    del held, hidden, loss
    gc.collect()
    assert kept() is not None  # what torch does: the failed backward's graph lives on
    grads.close()
    gc.collect()
    assert kept() is None


def micro_batch_grads(model: nn.Module, seed: int) -> list[torch.Tensor]:
    model.zero_grad()
    x = torch.randn(3, 8, generator=torch.Generator().manual_seed(seed))
    model(x.to(torch.bfloat16)).float().square().mean().backward()
    return [p.grad.clone() for p in model.parameters()]


def test_bf16_grads_accumulate_in_fp32_main_grads():
    model, alone = tiny_model(), tiny_model().to(torch.bfloat16)
    main = MainParams(list(model.parameters()))
    grads = GradBuffers(main.model, main.main, reducer=None)
    backward_twice(model, grads)
    first, second = micro_batch_grads(alone, 1), micro_batch_grads(alone, 2)
    rounded = 0
    for param, target, g1, g2 in zip(main.model, main.main, first, second):
        assert param.dtype == torch.bfloat16 and target.dtype == torch.float32
        assert param.grad is None  # folded into the fp32 main grad and freed
        torch.testing.assert_close(target.grad, g1.float() + g2.float(), rtol=0, atol=0)
        rounded += int(not torch.equal(target.grad, (g1 + g2).float()))
    assert rounded > 0  # a bf16 sum would have lost bits the fp32 one kept
    grads.close()


@pytest.fixture
def one_rank_group():
    dist.init_process_group("gloo", rank=0, world_size=1, store=dist.HashStore())
    yield dist.group.WORLD
    dist.destroy_process_group()


def test_distributed_optimizer_one_collective_per_bucket(one_rank_group, monkeypatch):
    model, reference = tiny_model(), tiny_model()
    params = list(model.parameters())
    calls = {"reduce_scatter": 0, "all_gather": 0}
    for name in calls:
        real = getattr(dist, name)

        def counted(*args, _real=real, _name=name, **kwargs):
            calls[_name] += 1
            return _real(*args, **kwargs)
        monkeypatch.setattr(dist, name, counted)
    kwargs = dict(lr=0.1)
    optimizer = DistributedOptimizer([{"params": params}], torch.optim.AdamW, kwargs,
                                      group=one_rank_group, dp=1, dp_rank=0, bucket_bytes=10**9)
    grads = GradBuffers(params, params, optimizer, bucket_bytes=10**9)
    plain = torch.optim.AdamW(reference.parameters(), **kwargs)
    backward_twice(model, grads)
    optimizer.step()
    backward_twice(reference, GradBuffers(list(reference.parameters()),
                                          list(reference.parameters()), None))
    plain.step()
    assert calls == {"reduce_scatter": 1, "all_gather": 1}  # 4 parameters, one bucket
    for got, want in zip(params, reference.parameters()):
        torch.testing.assert_close(got, want, rtol=0, atol=0)
