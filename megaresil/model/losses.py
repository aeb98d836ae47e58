"""The z-loss: one formula for the output logits' (`OutputZLoss`, on a last
chunk) and a mixture-of-experts router's (model/moe/routing.py)."""
from __future__ import annotations

from typing import Optional, Union

import torch
import torch.nn as nn


def z_loss(logsumexp: torch.Tensor) -> torch.Tensor:
    """Mean over tokens of logsumexp(logits)^2, in fp32 (PaLM's output z-loss,
    ST-MoE's router z-loss): it pulls each token's softmax normaliser towards
    1, so the logits do not drift large. `logsumexp` (N,): each token's, over
    all of its logits (the whole vocabulary, or every expert)."""
    return logsumexp.float().square().mean()


class OutputZLoss(nn.Module):
    """A last chunk's z-loss on its output logits: `coefficient`
    (train.z_loss; 0 is off) and the step's record of it, `total` (the
    z-losses of its training micro-batches summed, before the coefficient,
    fp64) over `calls` micro-batches, forgotten by `reset` before each
    attempt. No parameters, no checkpoint keys."""

    def __init__(self, coefficient: float = 0.0):
        super().__init__()
        self.coefficient = coefficient
        self.total: Optional[torch.Tensor] = None
        self.calls: Union[int, torch.Tensor] = 0  # a tensor once shares are counted

    def reset(self) -> None:
        self.total, self.calls = None, 0

    def applies(self) -> bool:
        """On, in a training forward that builds a graph (eval reports the
        cross-entropy alone)."""
        return bool(self.coefficient) and self.training and torch.is_grad_enabled()

    def added_to(self, loss: torch.Tensor, logsumexp: torch.Tensor,
                 share: Optional[torch.Tensor] = None) -> torch.Tensor:
        """`loss` (a micro-batch's mean cross-entropy) carrying the gradient of
        coefficient * z_loss(logsumexp), its value unchanged: the reported
        loss stays the cross-entropy, comparable to eval and to a run without
        the z-loss, and the z-loss is reported on its own. A non-finite z-loss
        still makes the value NaN (x - x), for the numerics checks to see.
        `share`: a context-parallel rank's share of the counted tokens
        (CPGroup.token_share): both losses, and the record, are that share
        of the whole sequences' (the cp ranks' records add up to one call's)."""
        z = z_loss(logsumexp)
        with torch.no_grad():
            figure = z.double() if share is None else z.double() * share.double()
            self.total = figure if self.total is None else self.total + figure
            self.calls = self.calls + (1 if share is None else share.double())
        term = self.coefficient * z
        total = loss + (term - term.detach())
        return total if share is None else total * share
