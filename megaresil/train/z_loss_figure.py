"""The step's output z-loss over the job, for the metrics row: the last
chunks' records (model/losses.OutputZLoss) summed over every rank in one
all-reduce a step, only when train.z_loss is on (otherwise no collective,
no field). Tensor-parallel rank 0 gives its record, the other ranks zeros
(every tp rank computes the same z-loss from the same all-reduced
logsumexp); pipeline stages without the output give zeros; the data-parallel
replicas' records add up. The vector has its own all-reduce, not a place in
the grad norm's, for the reason train/routing_figures.py gives."""
from __future__ import annotations

from typing import Iterable, Optional

import torch
import torch.distributed as dist
import torch.nn as nn

from megaresil.model.losses import OutputZLoss
from megaresil.parallel.layout import ParallelLayout


class ZLossFigure:
    """`value`: the last attempt's z-loss, the mean over the step's training
    micro-batches on every data-parallel replica, before the coefficient
    (None before the first, and always when off)."""

    def __init__(self, layout: ParallelLayout, records: list[OutputZLoss], *, on: bool):
        # `on` is the recipe's, not the records': a rank without the output
        # still joins the all-reduce.
        self.layout, self.records, self.on = layout, records, on
        self.value: Optional[float] = None

    @classmethod
    def of(cls, layout: ParallelLayout, chunks: Iterable[nn.Module],
           coefficient: float) -> ZLossFigure:
        """Over this rank's last chunk's record, if it holds the output."""
        records = [m for chunk in chunks for m in chunk.modules() if isinstance(m, OutputZLoss)]
        return cls(layout, records, on=bool(coefficient))

    def begin_step(self) -> None:
        """Forget the record of an attempt that was not applied."""
        for record in self.records:
            record.reset()

    @torch.no_grad()
    def reduce(self) -> None:
        """Sum every rank's record (a collective of every rank, each attempt, when on)."""
        if not self.on:
            return
        vector = torch.zeros(2, dtype=torch.float64, device=self.layout.device)
        if self.layout.tp_rank == 0:
            for record in self.records:
                if record.total is not None:
                    vector[0] += record.total.to(vector.device)
                vector[1] += record.calls
        if self.layout.world_size > 1:
            dist.all_reduce(vector)
        self.value = (vector[0] / vector[1]).item() if vector[1] else None

    def fields(self) -> dict[str, float]:
        """The metrics row's `z_loss` (nothing when off)."""
        return {} if self.value is None else {"z_loss": self.value}
