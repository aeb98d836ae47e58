"""The rects of every rank of a parallel layout, planned without processes.

Each (pipeline rank, tensor rank) builds its model chunks on the meta device
with the trainer's own code (`build_chunks`; the TP layers mark their shards),
and each rank describes its state with the trainer's own function
(`keys.state_rects`; for moments, each gradient group's ZeRO-1 rule and the
distributed optimizer's `make_shard`),
so a planned rank's rects are exactly what that rank would save.
"""
from __future__ import annotations

from typing import Callable, Optional

import torch
import torch.nn as nn

from megaresil.checkpoint.keys import MOMENTS, HeldMoments, MomentsOf, state_rects
from megaresil.checkpoint.sharded import Rect, assign_writers
from megaresil.checkpoint.state import layout_record
from megaresil.config import RecipeConfig
from megaresil.model.chunks import build_chunks
from megaresil.model.moe import named_state_buffers
from megaresil.parallel.distributed_optimizer import RowShard, make_shard
from megaresil.parallel.fsdp import planned_rows
from megaresil.parallel.grad_groups import shards_over_dp, zero1
from megaresil.parallel.layout import ParallelLayout
from megaresil.parallel.sharding import spec_of


def planned_ranks(cfg: RecipeConfig) -> list[ParallelLayout]:
    """Every rank of the recipe's layout, in global rank order."""
    return [ParallelLayout.planned(cfg.parallel, rank) for rank in range(cfg.parallel.world_size)]


def distributed_optimizer(cfg: RecipeConfig) -> bool:
    """Whether a trainer of this recipe shards its optimizer (as its gradient
    groups decide, or FSDP2 under sharded data parallelism)."""
    return (cfg.parallel.dp_shard > 1
            or shards_over_dp(cfg.optimizer, ParallelLayout.planned(cfg.parallel, 0)))


def recipe_layout(cfg: RecipeConfig) -> dict:
    """The `layout_record` a trainer of this recipe writes into its manifests."""
    return layout_record(planned_ranks(cfg)[0], distributed_optimizer(cfg))


def _planned_moments(cfg: RecipeConfig, rank: ParallelLayout) -> MomentsOf:
    """Moments shaped as the trainer's optimizer holds them: like the
    parameter, or, where its gradient group shards (ZeRO-1), its row shard
    over the group's data-parallel ranks."""

    rows = _planned_rows(cfg, rank)

    def held(param: nn.Parameter) -> Optional[HeldMoments]:
        if rows is not None:
            shard = rows(param)
            return None if shard.stop <= shard.start else ({m: shard.view for m in MOMENTS}, shard)
        axes = spec_of(param).replicated_over
        if not zero1(cfg.optimizer, rank.size(*axes)):
            return {moment: param for moment in MOMENTS}, None
        shard = make_shard(param, rank.size(*axes), rank.index_over(axes))
        return None if shard.stop <= shard.start else ({m: shard.view for m in MOMENTS}, shard)

    return held


def _planned_rows(cfg: RecipeConfig,
                  rank: ParallelLayout) -> Optional[Callable[[nn.Parameter], RowShard]]:
    """Under sharded data parallelism, a parameter's rows on `rank`: its
    weights and moments there (parallel/fsdp.row_shards); else None."""
    if cfg.parallel.dp_shard == 1:
        return None
    return lambda param: planned_rows(param, rank)


RankState = tuple[list[tuple[str, nn.Parameter]], list[tuple[str, torch.Tensor]]]


def _chunk_state(cfg: RecipeConfig, rank: ParallelLayout) -> RankState:
    """A rank's (parameters, state buffers), by key."""
    with torch.device("meta"):  # shapes and TP marks only, no memory
        chunks = build_chunks(cfg.model, rank, cfg.train.seed)
    return ([named for chunk in chunks for named in chunk.named_parameters()],
            list(named_state_buffers(chunks)))


def planned_rects(cfg: RecipeConfig, *, weights_only: bool) -> list[list[Rect]]:
    """Per global rank, the rects it would save (meta tensors: shapes only).
    Ranks that differ only in their expert-data-parallel coordinate (edp:
    dp at ep = 1) share one model build."""
    models: dict[tuple[int, int, int], RankState] = {}
    per_rank = []
    for rank in planned_ranks(cfg):
        where = (rank.pp_rank, rank.tp_rank, rank.coordinate("ep"))
        if where not in models:
            models[where] = _chunk_state(cfg, rank)
        params, buffers = models[where]
        moments = None if weights_only else _planned_moments(cfg, rank)
        per_rank.append(state_rects(params, cfg.model, moments, include_copies=False,
                                    main_rows=_planned_rows(cfg, rank), named_buffers=buffers))
    return per_rank


def writer_share(per_rank: list[list[Rect]]) -> list[tuple[int, Rect]]:
    """(writing rank, rect) for every distinct rect: one replica of each,
    chosen as the trainer chooses (`assign_writers`), so bytes per rank are
    balanced the same way a save at that layout balances them."""
    writers = assign_writers([[(r.identity(), r.nbytes) for r in rects] for rects in per_rank],
                             len(per_rank))
    return [(rank, rect) for rank, rects in enumerate(per_rank) for rect in rects
            if writers[rect.identity()] == rank]
