"""The router of a mixture-of-experts layer: fp32 scores over the experts,
each token's top-k choices and their weights, and the two losses that keep
routing healthy (load balancing, z-loss).

Shapes in comments: N tokens of the micro-batch (B*T, whole under sequence
parallelism too), C hidden, E experts, k choices per token.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

from megaresil.config import MoEConfig, RouterScore
from megaresil.model.losses import z_loss
from megaresil.parallel.context_parallel import CPGroup
from megaresil.parallel.sharding import ShardSpec, set_spec
from megaresil.parallel.tensor_parallel import TPGroup

# The router's bias buffer: its name in keys (`...mlp.router.expert_bias`).
EXPERT_BIAS = "expert_bias"


@dataclass(frozen=True)
class Routing:
    """One micro-batch's routing decision."""
    logits: torch.Tensor  # (N, E) fp32
    scores: torch.Tensor  # (N, E) fp32: softmax or sigmoid of the logits
    experts: torch.Tensor  # (N, k) each token's chosen experts, best first
    weights: torch.Tensor  # (N, k) fp32: what each choice's output is multiplied by


def top_k_routing(logits: torch.Tensor, cfg: MoEConfig,
                  bias: Optional[torch.Tensor] = None) -> Routing:
    """Scores, each token's k best experts and their weights: the chosen
    scores, normalised to sum to 1 when `normalize_top_k`, times
    `routed_scaling_factor`. An expert `bias` (E,) moves the choice only."""
    scores = logits.softmax(-1) if cfg.score_function == RouterScore.softmax else logits.sigmoid()
    if bias is None:
        chosen, experts = scores.topk(cfg.top_k, dim=-1)
    else:
        experts = (scores + bias).topk(cfg.top_k, dim=-1).indices
        chosen = scores.gather(-1, experts)
    if cfg.normalize_top_k:
        chosen = chosen / chosen.sum(-1, keepdim=True)
    return Routing(logits, scores, experts, chosen * cfg.routed_scaling_factor)


def load_balancing_loss(routing: Routing, cfg: MoEConfig,
                        cp: CPGroup = CPGroup()) -> torch.Tensor:
    """E * sum_i f_i * P_i (Switch Transformer, GShard): f_i the share of the
    micro-batch's top-k choices that went to expert i (no gradient), P_i
    expert i's mean score, normalised over the experts per token (sigmoid
    scores do not sum to 1). 1 when balanced, E when one expert takes all.
    Under context parallelism f counts the whole sequences' choices (summed
    over cp) and this rank's P is its share of the mean (every cp rank
    holds as many tokens), so the cp ranks' losses sum to the whole one."""
    N, k = routing.experts.shape
    counts = cp.sum(torch.bincount(routing.experts.flatten(), minlength=cfg.num_experts))
    share = counts / (N * cp.size * k)
    probs = routing.scores
    if cfg.score_function == RouterScore.sigmoid:
        probs = probs / probs.sum(-1, keepdim=True)
    return cfg.num_experts * (share.to(probs.dtype) * probs.mean(0)).sum() / cp.size


def router_z_loss(routing: Routing, cp: CPGroup = CPGroup()) -> torch.Tensor:
    """The z-loss (model/losses.py) of the router's logits: keeps them small.
    Under context parallelism this rank's share of the whole sequences'
    mean (every cp rank holds as many tokens)."""
    return z_loss(torch.logsumexp(routing.logits, dim=-1)) / cp.size


class Router(nn.Module):
    """Logits in fp32 from a linear map of each token; replicated over tp.

    It routes the whole micro-batch on every tp rank, so each rank's routing
    is the single-process routing. The combine weights' gradients reaching it
    are each rank's partial sums over its slice of the experts' width, so its
    gradient is summed over tp (grad_sum_axes, as sequence parallelism's)."""

    expert_bias: Optional[torch.Tensor]

    def __init__(self, cfg: MoEConfig, hidden: int, tp: TPGroup):
        super().__init__()
        self.cfg = cfg
        self.weight = nn.Parameter(torch.empty(cfg.num_experts, hidden))
        set_spec(self.weight, ShardSpec(grad_sum_axes=("tp",) if tp.active else ()))
        # Aux-loss-free balancing's state (model/moe/balance.py): the bias,
        # training state without a gradient, moved by the counts of the
        # block's RoutingCounter. On the CPU under a meta build too: zeros,
        # not drawn (init.materialize).
        on = bool(cfg.bias_update_rate)
        self.register_buffer(EXPERT_BIAS, torch.zeros(cfg.num_experts, device="cpu")
                             if on else None)

    def forward(self, tokens: torch.Tensor) -> Routing:  # (N, C)
        logits = F.linear(tokens.float(), self.weight.float())
        return top_k_routing(logits, self.cfg, self.expert_bias)
