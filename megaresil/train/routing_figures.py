"""The step's routing figures of a mixture-of-experts model: every rank's
layer counters (model/moe/counting.py) summed over the job in one
all-reduce, which the expert bias moves by (model/moe/balance.py) and the
metrics row reads (`fields`).

One vector holds every MoE layer of the model, a row per layer: a rank
fills the rows of the layers it holds, from tensor-parallel rank 0 only
(every tp rank routes the same tokens), zeros elsewhere; the all-reduce over
the world then brings other pipeline stages' layers to the logging rank and
sums each layer over the data-parallel replicas (at ep>1 too: each rank
routes its own tokens over all experts). The counts are integers in fp64,
exact whatever the sum's order, so the bias moves exactly as a per-rank
count summed over dp moves it. The vector has its own all-reduce, not a
place in the grad norm's: a longer vector changes how gloo's ring cuts it,
and so the order the norm's squares are summed in over 3 or more ranks.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable, Optional

import torch
import torch.distributed as dist
import torch.nn as nn

from megaresil.config import RecipeConfig
from megaresil.model.moe import ExpertBalance, MoEBlock, has_experts
from megaresil.model.moe.counting import AUX_LOSS, CALLS, DROPPED, FIGURES, Z_LOSS
from megaresil.parallel.layout import ParallelLayout


@dataclass(frozen=True)
class CountedLayer:
    """A MoE layer this rank holds and its row in the model's vector."""
    row: int
    block: MoEBlock


def moe_layer_ids(cfg: RecipeConfig) -> list[int]:
    """The model's global layer ids that have experts, in order."""
    return [i for i in range(cfg.model.num_layers) if has_experts(cfg.model.moe, i)]


def counted_layers(chunks: Iterable[nn.Module], layer_ids: list[int]) -> list[CountedLayer]:
    """This rank's MoE blocks, found by their names (`layers.<global id>.mlp`)."""
    rows = {layer: row for row, layer in enumerate(layer_ids)}
    return [CountedLayer(rows[int(name.split(".")[1])], module)
            for chunk in chunks for name, module in chunk.named_modules()
            if isinstance(module, MoEBlock)]


class RoutingFigures:
    """A rank's MoE layers, the expert bias over those that have one, and
    `totals`: the last attempt's sums over the job, (L, E + FIGURES) on the
    CPU, every MoE layer of the model (None before the first)."""

    def __init__(self, cfg: RecipeConfig, layout: ParallelLayout, layers: list[CountedLayer]):
        self.cfg, self.layout, self.layers = cfg, layout, layers
        self.layer_ids = moe_layer_ids(cfg)
        self.biased = [layer for layer in layers if layer.block.router.expert_bias is not None]
        self.balance = ExpertBalance([layer.block.router for layer in self.biased],
                                     cfg.model.moe.bias_update_rate)
        self.totals: Optional[torch.Tensor] = None

    @classmethod
    def of(cls, cfg: RecipeConfig, layout: ParallelLayout,
           chunks: Iterable[nn.Module]) -> RoutingFigures:
        return cls(cfg, layout, counted_layers(chunks, moe_layer_ids(cfg)))

    def begin_step(self) -> None:
        """Forget the counts of an attempt that was not applied."""
        for layer in self.layers:
            layer.block.counter.reset()

    @torch.no_grad()
    def reduce(self) -> None:
        """Sum every rank's counters into `totals` (a collective of every
        rank, each attempt; nothing on a dense model)."""
        if not self.layer_ids:
            return
        width = self.cfg.model.moe.num_experts + FIGURES
        vector = torch.zeros(len(self.layer_ids), width, dtype=torch.float64,
                             device=self.layout.device)
        if self.layout.tp_rank == 0:
            for layer in self.layers:
                vector[layer.row] = layer.block.counter.totals
        if self.layout.world_size > 1:
            dist.all_reduce(vector)
        self.totals = vector.cpu()

    def after_step(self) -> None:
        """Move the expert biases by the step's summed tokens per expert."""
        if self.biased and self.totals is not None:
            E = self.cfg.model.moe.num_experts
            self.balance.after_step(self.totals[[layer.row for layer in self.biased], :E])

    def fields(self, step: int) -> dict[str, Any]:
        """The metrics row's routing fields (none on a dense model): the
        losses' means over layers and micro-batches, before their
        coefficients; the share of choices dropped; the worst layer's
        busiest expert over its mean (`moe_imbalance`, 1.0 balanced); and at
        each logging.log_interval-th step and the last, `moe_load`: every
        layer's tokens per expert over the step ({layer id: [counts]})."""
        if self.totals is None:
            return {}
        E = self.cfg.model.moe.num_experts
        choices, figures = self.totals[:, :E], self.totals[:, E:]
        calls = figures[:, CALLS].sum()
        row: dict[str, Any] = {
            "moe_aux_loss": (figures[:, AUX_LOSS].sum() / calls).item(),
            "moe_z_loss": (figures[:, Z_LOSS].sum() / calls).item(),
            "moe_dropped_share": (figures[:, DROPPED].sum() / choices.sum()).item(),
            "moe_imbalance": (choices.max(1).values / choices.mean(1)).max().item()}
        if step % self.cfg.logging.log_interval == 0 or step == self.cfg.train.steps:
            row["moe_load"] = {str(layer): [int(c) for c in counts.tolist()]
                               for layer, counts in zip(self.layer_ids, choices)}
        return row
