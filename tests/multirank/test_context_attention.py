"""Context-parallel attention (model/context_attention.py) against torch's
SDPA over the whole sequence: every rank's output rows and its q, k, v
grads are the single-process attention's for its two zig-zag chunks, at
cp=2 and cp=4, with either way of passing keys and values (all-gather,
ring), grouped-query heads, and sliding windows narrower than a chunk and
spanning part of one. Also the loss shares that sum to the whole mean."""
from __future__ import annotations

import math

import torch
import torch.distributed as dist
import torch.nn.functional as F

from megaresil.config import ContextComm
from megaresil.model.context_attention import context_attention
from megaresil.model.masks import causal_mask
from megaresil.parallel.context_parallel import CPGroup
from megaresil.parallel.tensor_parallel import IGNORE_TARGET
from megaresil.ports import free_port
from tests.harness.dist import join_group, spawn_ranks

WORLD = 4
B, H, G, T, D = 2, 4, 2, 64, 8  # GQA: 4 query heads over 2 key/value heads
# cp=4: chunks of 8 tokens, so 5 is inside a chunk and 12 reaches one back;
# cp=2: chunks of 16, both narrower than a chunk.
WINDOWS = [None, 5, 12]


def whole_sequence(window):
    """q, k, v, the output's weights, and SDPA's output and input grads."""
    g = torch.Generator().manual_seed(0 if window is None else window)
    q, k, v = (torch.randn(B, heads, T, D, generator=g) for heads in (H, G, G))
    weights = torch.randn(B, H, T, D, generator=g)
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    out = F.scaled_dot_product_attention(*leaves, attn_mask=causal_mask(T, window, q.device),
                                         scale=1 / math.sqrt(D), enable_gqa=True)
    (out * weights).sum().backward()
    return (q, k, v), weights, out.detach(), [x.grad for x in leaves]


def check_attention(cp: CPGroup, window) -> None:
    inputs, weights, want_out, want_grads = whole_sequence(window)
    local = [cp.slice_sequence(x, dim=2).clone().requires_grad_() for x in inputs]
    out = context_attention(*local, cp, window, 1 / math.sqrt(D))
    (out * cp.slice_sequence(weights, dim=2)).sum().backward()
    what = f"cp={cp.size} {cp.comm.value} window={window} rank={cp.rank}"
    torch.testing.assert_close(out, cp.slice_sequence(want_out, dim=2), rtol=1e-5, atol=2e-6,
                               msg=lambda m: f"{what} output: {m}")
    for name, x, want in zip("qkv", local, want_grads):
        torch.testing.assert_close(x.grad, cp.slice_sequence(want, dim=2), rtol=1e-5, atol=2e-6,
                                   msg=lambda m: f"{what} d{name}: {m}")


def check_token_share(cp: CPGroup) -> None:
    """Each rank's mean over its counted tokens times its token share,
    whatever share of the counted tokens it holds, sums over the cp ranks to
    the whole sequence's mean."""
    g = torch.Generator().manual_seed(1)
    losses, targets = torch.rand(B, T, generator=g), torch.randint(0, 9, (B, T), generator=g)
    targets[:, : T // 3] = IGNORE_TARGET  # the first ranks' head chunks count less
    counted = targets != IGNORE_TARGET
    mine, my_targets = cp.slice_sequence(losses), cp.slice_sequence(targets)
    share = mine[my_targets != IGNORE_TARGET].mean() * cp.token_share(my_targets)
    torch.testing.assert_close(cp.sum(share), losses[counted].mean())


def _worker(rank: int, port: int) -> None:
    join_group(rank, WORLD, port)
    try:
        halves = [dist.new_group([0, 1]), dist.new_group([2, 3])]  # every rank makes both
        for comm in ContextComm:
            for cp in (CPGroup(halves[rank // 2], 2, rank % 2, comm),
                       CPGroup(dist.group.WORLD, WORLD, rank, comm)):
                for window in WINDOWS:
                    check_attention(cp, window)
                if comm == ContextComm.allgather:
                    check_token_share(cp)
    finally:
        dist.destroy_process_group()


def test_context_attention_is_sdpa_over_the_whole_sequence():
    spawn_ranks(_worker, (free_port(),), WORLD)
