"""What a mixture-of-experts layer's routing did over one step's training
micro-batches, counted where it happens (`RoutingCounter`): the choices each
expert was given, those the capacity factor dropped, and the load-balancing
and z losses' values. The trainer sums the counters over the ranks once a
step (train/routing_figures.py); the expert bias (balance.py) and the
metrics read that one sum.

Counts are taken as forward computes them: eval forwards, forwards without
grad and activation recomputation's second pass count nothing, and nothing
counted reaches the graph.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn as nn

from megaresil.compat import in_backward
from megaresil.config import MoEConfig
from megaresil.model.moe.routing import Routing, load_balancing_loss, router_z_loss
from megaresil.parallel.context_parallel import CPGroup

# After the E choice counts in a counter's `totals`: choices dropped by the
# capacity, the sums of the two losses (before their coefficients), and the
# micro-batches they are summed over.
DROPPED, AUX_LOSS, Z_LOSS, CALLS = range(4)
FIGURES = 4


class RoutingCounter(nn.Module):
    """A layer's routing over a step: `totals` (E + FIGURES,) fp64, exact for
    counts (integers below 2^53), zeroed by `reset` before each attempt."""

    totals: torch.Tensor

    def __init__(self, cfg: MoEConfig, cp: CPGroup = CPGroup()):
        super().__init__()
        self.cfg, self.cp = cfg, cp
        # Built on the CPU under a meta build too (init.materialize moves it);
        # not persistent: no checkpoint key.
        self.register_buffer("totals", torch.zeros(cfg.num_experts + FIGURES,
                                                   dtype=torch.float64, device="cpu"),
                             persistent=False)

    @property
    def choices(self) -> torch.Tensor:
        """(E,) the step's top-k choices of each expert, dropped ones included."""
        return self.totals[:self.cfg.num_experts]

    def reset(self) -> None:
        self.totals.zero_()

    def counting(self) -> bool:
        """A training forward's first pass (not eval, not recomputation)."""
        return self.training and torch.is_grad_enabled() and not in_backward()

    def record(self, routing: Routing, capacity: Optional[int]) -> None:
        """Add one micro-batch's routing; `capacity`: the rows each expert
        takes (None: dropless)."""
        if self.counting():
            with torch.no_grad():
                self._add(routing, capacity)

    def _add(self, routing: Routing, capacity: Optional[int]) -> None:
        E = self.cfg.num_experts
        counts = torch.bincount(routing.experts.flatten(), minlength=E)  # (E,)
        self.choices.add_(counts)
        figures = self.totals[E:]
        if capacity is not None:
            figures[DROPPED] += (counts - capacity).clamp(min=0).sum()
        figures[AUX_LOSS] += load_balancing_loss(routing, self.cfg, self.cp).double()
        figures[Z_LOSS] += router_z_loss(routing, self.cp).double()
        # The cp ranks' losses are shares of one micro-batch's: together one call.
        figures[CALLS] += 1 / self.cp.size
