"""Distributed optimizer (ZeRO-1): optimizer state sharded over data parallelism.

Each parameter is cut along dim 0 into dp equal row blocks (the last ones may
be short or empty), as FSDP2 shards dim 0, so every shard is a rectangle of
the parameter and optimizer state reshards exactly like weights. DP rank r:
reduce-scatters the grads so it holds the averaged grad of its rows, steps
AdamW on those rows only (state for 1/dp of the model), then all-gathers the
updated rows so every rank has the full parameter for the next forward.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn as nn


@dataclass
class RowShard:
    """Rows [start, stop) of `param` owned by this DP rank; `view` shares storage."""
    param: nn.Parameter
    start: int
    stop: int
    rows_per_rank: int
    view: nn.Parameter


def shard_rows(rows: int, dp: int, dp_rank: int) -> tuple[int, int, int]:
    per_rank = -(-rows // dp)
    start = min(rows, dp_rank * per_rank)
    return start, min(rows, start + per_rank), per_rank


def make_shard(param: nn.Parameter, dp: int, dp_rank: int) -> RowShard:
    flat_rows = param.data if param.ndim > 0 else param.data.view(1)
    start, stop, per_rank = shard_rows(flat_rows.shape[0], dp, dp_rank)
    # A Parameter built on a slice shares the parameter's storage: stepping
    # the shard updates this rank's rows of the full parameter in place.
    view = nn.Parameter(flat_rows[start:stop], requires_grad=False)
    return RowShard(param, start, stop, per_rank, view)


def _padded_rows(t: torch.Tensor, rows: int) -> torch.Tensor:
    if t.shape[0] == rows:
        return t
    return torch.cat([t, t.new_zeros(rows - t.shape[0], *t.shape[1:])])


class DistributedOptimizer:
    """Wraps an optimizer class so it steps only this rank's row shards."""

    def __init__(self, param_groups: list[dict], optimizer_cls, optimizer_kwargs: dict, *,
                 group: dist.ProcessGroup, dp: int, dp_rank: int):
        self.group, self.dp, self.dp_rank = group, dp, dp_rank
        self.shards: list[RowShard] = []
        inner_groups = []
        for param_group in param_groups:
            shards = [make_shard(p, dp, dp_rank) for p in param_group["params"]]
            self.shards += shards
            # Ranks past the last row of a small tensor own nothing of it.
            owned = [s.view for s in shards if s.stop > s.start]
            inner_groups.append({**param_group, "params": owned})
        self.inner = optimizer_cls(inner_groups, **optimizer_kwargs)

    @property
    def param_groups(self) -> list[dict]:
        return self.inner.param_groups

    def reduce_scatter_grads(self) -> None:
        """Average each grad over DP and keep this rank's rows as the shard's grad."""
        pending = []
        for shard in self.shards:
            grad = shard.param.grad if shard.param.grad is not None else torch.zeros_like(shard.param)
            grad = grad.reshape(-1) if grad.ndim == 0 else grad
            padded = _padded_rows(grad, shard.rows_per_rank * self.dp) / self.dp
            out = torch.empty_like(padded[: shard.rows_per_rank])
            work = dist.reduce_scatter(out, list(padded.chunk(self.dp)), group=self.group,
                                       async_op=True)
            pending.append((shard, out, work))
        for shard, out, work in pending:
            work.wait()
            shard.view.grad = out[: shard.stop - shard.start]
            shard.param.grad = None

    @torch.no_grad()
    def step(self) -> None:
        self.inner.step()
        self._all_gather_params()

    def _all_gather_params(self) -> None:
        pending = []
        for shard in self.shards:
            mine = _padded_rows(shard.view.data, shard.rows_per_rank)
            gathered = [torch.empty_like(mine) for _ in range(self.dp)]
            pending.append((shard, gathered, dist.all_gather(gathered, mine, group=self.group,
                                                             async_op=True)))
        for shard, gathered, work in pending:
            work.wait()
            full = shard.param.data if shard.param.ndim > 0 else shard.param.data.view(1)
            full.copy_(torch.cat(gathered)[: full.shape[0]])

    def zero_grad(self, set_to_none: bool = True) -> None:
        for shard in self.shards:
            shard.view.grad = None
            shard.param.grad = None
