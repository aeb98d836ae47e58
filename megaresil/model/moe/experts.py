"""Experts computed grouped: a token permutation that brings each expert's
rows together (`LocalDispatcher`; `ExpertParallelDispatcher` adds the
all-to-all to the ranks that hold them) and SwiGLU experts held as 3-D
parameters, run as one `grouped_mm` per projection over a rank's experts.

Shapes in comments: N tokens, M routed rows (at most N*k), C hidden, E
experts, F an expert's width (F/tp per tensor-parallel rank).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

from megaresil.model.moe.routing import Routing
from megaresil.parallel.expert_parallel import EPGroup, all_to_all, exchange_counts
from megaresil.parallel.sharding import EXPERT_AXIS, EXPERT_REPLICAS, AxisShard, ShardSpec, set_spec
from megaresil.parallel.tensor_parallel import TPGroup


@dataclass(frozen=True)
class Dispatch:
    """Where each routed row came from and what its output weighs."""
    tokens: torch.Tensor  # (M,) the token of each row, rows grouped by expert
    weights: torch.Tensor  # (M,) fp32: the row's routing weight
    counts: torch.Tensor  # (E,) rows per expert, in expert order


def dispatch_plan(routing: Routing, num_experts: int, capacity: Optional[int]) -> Dispatch:
    """Each expert's rows in micro-batch order (token, then its choice order);
    with a `capacity`, an expert's rows past it are dropped: later tokens
    first, whatever the layout (the routing is the whole micro-batch's)."""
    N, k = routing.experts.shape
    flat = routing.experts.flatten()  # (N*k,) token-major
    order = torch.argsort(flat, stable=True)  # grouped by expert, token order within
    counts = torch.bincount(flat, minlength=num_experts)
    if capacity is not None:
        starts = counts.cumsum(0) - counts
        place = torch.arange(flat.numel(), device=flat.device) - starts[flat[order]]
        order = order[place < capacity]
        counts = counts.clamp(max=capacity)
    return Dispatch(order // k, routing.weights.flatten()[order], counts)


def expert_capacity(factor: Optional[float], tokens: int, top_k: int, num_experts: int) -> \
        Optional[int]:
    """Rows an expert takes from a micro-batch of `tokens`; None: all (dropless)."""
    return None if factor is None else math.ceil(factor * tokens * top_k / num_experts)


class LocalDispatcher:
    """Moves tokens to this rank's experts and their outputs back (every
    expert is local at ep=1). Expert parallelism wraps the same two steps
    with an all-to-all between ranks that hold different experts."""

    def __init__(self, num_experts: int, top_k: int, capacity_factor: Optional[float]):
        self.num_experts, self.top_k, self.capacity_factor = num_experts, top_k, capacity_factor

    def dispatch(self, tokens: torch.Tensor, routing: Routing) -> tuple[torch.Tensor, Dispatch]:
        """(M, C) rows grouped by expert, and the plan that brings them back."""
        capacity = expert_capacity(self.capacity_factor, tokens.shape[0], self.top_k,
                                   self.num_experts)
        plan = dispatch_plan(routing, self.num_experts, capacity)
        return tokens[plan.tokens], plan

    def combine(self, rows: torch.Tensor, plan: Dispatch, num_tokens: int) -> torch.Tensor:
        """(N, C): each token's rows, weighted and summed (dropped choices add nothing)."""
        weighted = rows * plan.weights.unsqueeze(-1).to(rows.dtype)
        out = rows.new_zeros(num_tokens, rows.shape[-1])
        return out.index_add(0, plan.tokens, weighted)

    def run(self, tokens: torch.Tensor, routing: Routing, experts: "GroupedExperts") -> \
            torch.Tensor:
        """(N, C): `tokens` through their experts, combined."""
        rows, plan = self.dispatch(tokens, routing)
        return self.combine(experts(rows, plan.counts), plan, tokens.shape[0])


def expert_major(received: torch.Tensor) -> torch.Tensor:
    """The order that takes rows arrived source-major ((ep, E/ep) counts:
    each source's rows, by local expert) to expert-major (each local
    expert's rows, by source)."""
    sizes = received.flatten()
    starts = (sizes.cumsum(0) - sizes).view_as(received).t().flatten()  # of each block, arrived
    sizes = received.t().flatten()
    places = sizes.cumsum(0) - sizes  # of each block, expert-major
    return torch.arange(int(sizes.sum()), device=received.device) + \
        torch.repeat_interleave(starts - places, sizes)


class ExpertParallelDispatcher:
    """The local permutation with an all-to-all on each side: ep rank r
    holds experts [r*E/ep, (r+1)*E/ep) and receives their rows from every
    rank of its expert-parallel group; the outputs go back the same way.
    Routing and capacity are each sender's, so what a token meets is what
    it meets at ep=1."""

    def __init__(self, local: LocalDispatcher, ep: EPGroup):
        self.local, self.ep = local, ep

    def run(self, tokens: torch.Tensor, routing: Routing, experts: "GroupedExperts") -> \
            torch.Tensor:
        """(N, C): `tokens` through the experts of every rank, combined."""
        rows, plan = self.local.dispatch(tokens, routing)  # (M, C) by global expert
        counts = plan.counts.view(self.ep.size, -1)  # (ep, E/ep): per rank, per its expert
        received = exchange_counts(counts, self.ep)  # (ep, E/ep): from each rank, per my expert
        send, receive = counts.sum(1).tolist(), received.sum(1).tolist()
        order = expert_major(received)
        arrived = all_to_all(rows, send, receive, self.ep)[order]  # (R, C) by local expert
        out = experts(arrived, received.sum(0))
        back = torch.empty_like(order)
        back[order] = torch.arange(order.numel(), device=order.device)
        returned = all_to_all(out[back], receive, send, self.ep)  # (M, C) by global expert
        return self.local.combine(returned, plan, tokens.shape[0])


def _expert_stack(shape: tuple[int, int, int], tp_dim: int, tp: TPGroup,
                  ep: EPGroup) -> nn.Parameter:
    """A stack of experts' weights: dim 0 this rank's experts (cut along
    EXPERT_AXIS, whole at ep=1), `tp_dim` cut by tensor parallelism like the
    dense MLP's."""
    param = nn.Parameter(torch.empty(shape))
    shards = (AxisShard(0, EXPERT_AXIS, ep.size, ep.rank),
              AxisShard(tp_dim, "tp", tp.size, tp.rank))
    # Split over ep, the stacks have replicas only across ep groups: edp.
    replicas = EXPERT_REPLICAS if ep.active else ShardSpec().replicated_over
    set_spec(param, ShardSpec(shards=shards, replicated_over=replicas))
    return param


class GroupedExperts(nn.Module):
    """E SwiGLU experts as 3-D weights: gate and up (E, F/tp, C), cut along
    F as the dense MLP's column-parallel rows; down (E, C, F/tp), cut along F
    as its row-parallel columns. The output is this rank's partial sum over
    its slice of F (the caller leaves the tensor-parallel region)."""

    def __init__(self, num_experts: int, hidden: int, ffn: int, tp: TPGroup,
                 ep: EPGroup = EPGroup()):
        super().__init__()
        if ffn % tp.size:
            raise ValueError(f"expert width ({ffn}) is not divisible by tp={tp.size}")
        if num_experts % ep.size:
            raise ValueError(f"{num_experts} experts do not split over ep={ep.size}")
        local, experts = ffn // tp.size, num_experts // ep.size
        self.gate = _expert_stack((experts, local, hidden), 1, tp, ep)
        self.up = _expert_stack((experts, local, hidden), 1, tp, ep)
        self.down = _expert_stack((experts, hidden, local), 2, tp, ep)

    def forward(self, rows: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:  # (M, C)
        offsets = counts.cumsum(0).to(torch.int32)  # where each expert's rows end
        rows = rows.to(self.gate.dtype)
        gate = F.grouped_mm(rows, self.gate.transpose(-2, -1), offs=offsets)  # (M, F/tp)
        up = F.grouped_mm(rows, self.up.transpose(-2, -1), offs=offsets)
        return F.grouped_mm(F.silu(gate) * up, self.down.transpose(-2, -1), offs=offsets)
