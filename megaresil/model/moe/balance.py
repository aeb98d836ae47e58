"""Aux-loss-free load balancing (DeepSeek-V3): each layer's expert bias
moves the top-k choice toward the experts that took fewer tokens.

After an applied optimizer step every rank moves its biases by
rate * sign(mean load - load), the load being the tokens each expert was
chosen for over the step's micro-batches on all data-parallel ranks (the
block counters' sum, train/routing_figures.py), so the bias stays alike on
every replica. A step the numerics guard holds back moves nothing.
"""
from __future__ import annotations

from typing import Iterable, Iterator

import torch
import torch.nn as nn

from megaresil.model.moe.routing import EXPERT_BIAS, Router


def named_state_buffers(chunks: Iterable[nn.Module]) -> Iterator[tuple[str, torch.Tensor]]:
    """(chunk-local name, tensor) of the training state held outside the
    parameters: the expert biases (no gradient, no optimizer state)."""
    for chunk in chunks:
        for name, buffer in chunk.named_buffers():
            if name.rsplit(".", 1)[-1] == EXPERT_BIAS:
                yield name, buffer


class ExpertBalance:
    """The biased routers of a rank's layers, in the order their loads are given."""

    def __init__(self, routers: list[Router], rate: float):
        self.routers, self.rate = routers, rate

    @torch.no_grad()
    def after_step(self, loads: torch.Tensor) -> None:
        """Move each bias by its layer's load (L, E): the step's tokens per
        expert summed over data parallelism, row i the i-th router's."""
        for router, load in zip(self.routers, loads.to(torch.float32)):
            assert router.expert_bias is not None
            load = load.to(router.expert_bias.device)
            router.expert_bias += self.rate * torch.sign(load.mean() - load)
