"""The mixture-of-experts block that replaces a layer's MLP: route the
micro-batch, dispatch, run the grouped experts, combine, add the shared
expert; the routing losses reach the gradients through the block's output.

Under tensor parallelism the block is one tensor-parallel region, like the
dense MLP: its input is gathered (the whole micro-batch on every rank, so
routing does not depend on the layout), each rank computes its slice of every
expert's width, and the weighted partial outputs are summed (reduce-scattered
under sequence parallelism) on the way out.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Union

import torch
import torch.nn as nn

from megaresil.config import ModelConfig, MoEConfig
from megaresil.model.mlp import SwiGLUMLP
from megaresil.model.moe.counting import RoutingCounter
from megaresil.model.moe.experts import (
    ExpertParallelDispatcher,
    GroupedExperts,
    LocalDispatcher,
    expert_capacity,
)
from megaresil.model.moe.routing import Router, Routing, load_balancing_loss, router_z_loss
from megaresil.parallel.context_parallel import CPGroup
from megaresil.parallel.expert_parallel import EPGroup
from megaresil.parallel.tensor_parallel import TPGroup, enter_tp_region, leave_tp_region


def has_experts(cfg: MoEConfig, layer: int) -> bool:
    """Whether global layer `layer` has experts: from first_dense_layers on,
    every every_n_layers-th."""
    return (cfg.num_experts > 0 and layer >= cfg.first_dense_layers
            and (layer - cfg.first_dense_layers) % cfg.every_n_layers == 0)


@dataclass
class MoELossScale:
    """What the trainer's backward multiplies a micro-batch's main loss by
    (1/micro-batches where the loss is divided before its backward, 1 where
    the summed grads are divided afterwards): the routing losses' gradients
    are scaled the same, so they weigh against the main loss alike in every
    schedule. One per model chunk, set before the step's backward."""
    value: float = 1.0


class _RoutingLossGrad(torch.autograd.Function):
    """Identity on the block's output; its backward also starts the routing
    losses' backward, with gradient `weight` (Megatron's
    MoEAuxLossAutoScaler): the losses join the gradients without joining the
    loss the schedule sees."""

    @staticmethod
    def forward(ctx, output: torch.Tensor, loss: torch.Tensor,
                weight: float) -> torch.Tensor:
        ctx.weight = weight
        return output

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, torch.full((), ctx.weight, dtype=torch.float32, device=grad.device), None


class MoEBlock(nn.Module):
    """Router (`router.weight`), grouped experts (`experts.gate/up/down`) and
    an optional shared expert (`shared.*`, a dense SwiGLU MLP); `counter`
    counts the step's routing (no parameters, no checkpoint keys)."""

    def __init__(self, cfg: ModelConfig, tp: TPGroup, scale: MoELossScale, *, ffn: int,
                 ep: EPGroup = EPGroup(), cp: CPGroup = CPGroup()):
        super().__init__()
        moe = cfg.moe
        self.moe, self.tp, self.cp, self.scale = moe, tp, cp, scale
        self.router = Router(moe, cfg.hidden_size, tp)
        self.counter = RoutingCounter(moe, cp)
        self.experts = GroupedExperts(moe.num_experts, cfg.hidden_size,
                                      moe.expert_ffn_hidden_size or ffn, tp, ep)
        local = LocalDispatcher(moe.num_experts, moe.top_k, moe.capacity_factor)
        self.dispatcher: Union[LocalDispatcher, ExpertParallelDispatcher] = (
            ExpertParallelDispatcher(local, ep) if ep.active else local)
        self.shared = (SwiGLUMLP(cfg, tp, ffn=moe.shared_expert_hidden_size)
                       if moe.shared_expert_hidden_size else None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = enter_tp_region(x, self.tp)  # (B, T, C): the whole micro-batch
        tokens = h.reshape(-1, h.shape[-1])  # (N, C), batch-major
        routing = self.router(tokens)
        self.counter.record(routing, expert_capacity(self.moe.capacity_factor, tokens.shape[0],
                                                     self.moe.top_k, self.moe.num_experts))
        y = self.dispatcher.run(tokens, routing, self.experts)  # (N, C)
        y = leave_tp_region(y.view_as(h), self.tp)  # (B, T, C), or (B, T/tp, C) under SP
        if self.shared is not None:
            y = y + self.shared(x)
        return self.with_routing_losses(y, routing)

    def routing_loss(self, routing: Routing) -> torch.Tensor:
        """aux_loss_coeff * load balancing + z_loss_coeff * z-loss."""
        loss = torch.zeros((), device=routing.logits.device)
        if self.moe.aux_loss_coeff:
            loss = loss + self.moe.aux_loss_coeff * load_balancing_loss(routing, self.moe,
                                                                        self.cp)
        if self.moe.z_loss_coeff:
            loss = loss + self.moe.z_loss_coeff * router_z_loss(routing, self.cp)
        return loss

    def with_routing_losses(self, y: torch.Tensor, routing: Routing) -> torch.Tensor:
        """`y`, carrying the routing losses' backward. Every tp rank routes
        alike and the router's grads are summed over tp, so only tp rank 0
        starts that backward (the others' weight is 0)."""
        if not (self.training and torch.is_grad_enabled()):
            return y
        if not (self.moe.aux_loss_coeff or self.moe.z_loss_coeff):
            return y
        weight = self.scale.value if self.tp.rank == 0 else 0.0
        return _RoutingLossGrad.apply(y, self.routing_loss(routing), weight)
