"""What the memory census's meta forward (train/memory_census.py) runs in
place of the parts of a forward whose memory a meta tensor cannot show:
attention, whose kernel a real device picks, a mixture-of-experts layer's
routing, whose rows per expert depend on the data, and context-parallel
attention and loss, which talk to the other cp ranks. Shapes only; nothing
here runs in training."""
from __future__ import annotations

import dataclasses
import functools
import math
from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from megaresil import compat
from megaresil.config import ContextComm, MoEConfig
from megaresil.model.layers import Attention
from megaresil.model.moe import MoEBlock
from megaresil.model.moe.experts import GroupedExperts, expert_capacity
from megaresil.model.moe.routing import Routing
from megaresil.parallel.context_parallel import CPGroup


class _FusedAttentionMemory(torch.autograd.Function):
    """What a fused attention kernel (flash, memory-efficient; what a GPU or
    CPU run uses without attention dropout) keeps for backward: its inputs,
    its output and the (B, H, T) fp32 log-sum-exp, no (T, T) probabilities.
    Shapes only."""

    @staticmethod
    def forward(ctx, q, k, v):  # (B, H, T, D), keys and values (B, H_kv, T, D)
        out = q.new_empty(*q.shape[:-1], v.shape[-1])
        lse = q.new_empty(q.shape[:-1], dtype=torch.float32)
        ctx.save_for_backward(q, k, v, out, lse)
        return out

    @staticmethod
    def backward(ctx, grad):
        raise NotImplementedError("the memory estimate runs no backward")


class _GroupedMatmulMemory(torch.autograd.Function):
    """A grouped matmul's memory: it keeps both inputs, as torch's does
    (whose meta kernel takes only bf16, the dtype CUDA's takes)."""

    @staticmethod
    def forward(ctx, a, b):  # rows (M, K), weights (E, K, N) -> (M, N)
        ctx.save_for_backward(a, b)
        return a.new_empty(a.shape[0], b.shape[-1])

    @staticmethod
    def backward(ctx, grad):
        raise NotImplementedError("the memory estimate runs no backward")


class MetaStandIns(TorchFunctionMode):
    """Counts `scaled_dot_product_attention` as a fused kernel keeps it (on
    the meta device torch decomposes it into the math kernel, which would
    count the (T, T) probabilities a real run never holds), and gives
    `bincount` (no meta kernel: its length depends on the values) its
    `minlength`, the number of experts the routing losses count over, and
    counts a grouped matmul in any dtype."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.scaled_dot_product_attention:
            return _FusedAttentionMemory.apply(*args[:3])
        if compat.is_grouped_mm(func) and args[0].is_meta:
            return _GroupedMatmulMemory.apply(*args[:2])
        if func is torch.bincount and args[0].is_meta:
            return torch.zeros(kwargs.get("minlength", 0), dtype=torch.long, device="meta")
        return func(*args, **kwargs)


class BalancedRows:
    """A dispatcher with the shapes of a balanced routing: every expert gets
    N k / E of a micro-batch's N tokens' k choices (at most its capacity),
    from each rank of the expert-parallel group alike, so a rank's experts
    run N k / ep rows of each of the ep ranks: N k rows (dropless)."""

    def __init__(self, moe: MoEConfig):
        self.moe = moe

    def run(self, tokens: torch.Tensor, routing: Routing, experts: GroupedExperts) -> \
            torch.Tensor:
        N, E = tokens.shape[0], self.moe.num_experts
        per_expert = math.ceil(N * self.moe.top_k / E)
        capacity = expert_capacity(self.moe.capacity_factor, N, self.moe.top_k, E)
        per_expert = min(per_expert, capacity) if capacity is not None else per_expert
        local = experts.gate.shape[0]  # this rank's experts
        rows_n = per_expert * E
        index = torch.zeros(rows_n, dtype=torch.long, device=tokens.device)
        counts = torch.full((local,), rows_n // local, dtype=torch.long, device=tokens.device)
        out = experts(tokens[index], counts)  # (M, C)
        weights = routing.weights.new_empty(rows_n, 1).to(out.dtype)
        return out.new_zeros(N, out.shape[-1]).index_add(0, index, out * weights)


def balance_routing(chunk: nn.Module) -> None:
    """Give every MoE layer of a meta `chunk` the balanced dispatcher, and
    stop its routing counter (the census's forward is no training step)."""
    for module in chunk.modules():
        if isinstance(module, MoEBlock):
            module.dispatcher = BalancedRows(module.moe)  # type: ignore[assignment]
            module.counter.train(False)


class _ContextAttentionMemory(torch.autograd.Function):
    """What model/context_attention.py keeps for backward: the rank's own
    q, k, v (in fp32, its compute dtype), its output and the (B, H, T/cp)
    logsumexp, whatever cp is; and, for the peak, what a forward holds
    while it runs: the stacked k and v, the other ranks' (all of them
    gathered, or under p2p the block in hand and the one arriving) and one
    block's scores and probabilities. Shapes only."""

    @staticmethod
    def forward(ctx, q, k, v, cp):  # (B, H, T/cp, D), keys and values (B, G, T/cp, D)
        B, H, T, D = q.shape
        blocks = cp.size if cp.comm == ContextComm.allgather else 2
        working = [k.new_empty(blocks, 2, *k.shape),  # k and v stacked, and the others'
                   q.new_empty(B, H, T // 2, T // 2), q.new_empty(B, H, T // 2, T // 2)]
        del working
        out = q.new_empty(B, H, T, v.shape[-1])
        lse = q.new_empty(B, H, T)
        ctx.save_for_backward(q, k, v, out, lse)
        return out

    @staticmethod
    def backward(ctx, grad):
        raise NotImplementedError("the memory estimate runs no backward")


@dataclasses.dataclass(frozen=True)
class _PlannedCP(CPGroup):
    """A cp rank of a layout that does not run: its slice and positions as a
    running rank's, its sums (the loss share's, the routing counts') without
    asking the other ranks (scalars and counts are no memory to count)."""

    def sum(self, value: torch.Tensor) -> torch.Tensor:
        return value.detach().clone()


def _context_core(attention: Attention, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                  samples: Optional[torch.Tensor], documents: object) -> torch.Tensor:
    out = _ContextAttentionMemory.apply(q.float(), k.float(), v.float(), attention.cp)
    return out.to(q.dtype)


def plan_context_parallel(chunk: nn.Module) -> None:
    """Give a meta `chunk` built for a cp rank (parallel.cp > 1) the
    stand-ins above: its attention keeps what context attention keeps, its
    loss takes its share without the other ranks."""
    for module in chunk.modules():
        cp = getattr(module, "cp", None)
        if isinstance(cp, CPGroup) and cp.active:
            module.cp = _PlannedCP(None, cp.size, cp.rank, cp.comm)  # type: ignore[assignment]
            if isinstance(module, Attention):
                module.core = functools.partial(_context_core, module)  # type: ignore[method-assign]
