"""Distributed optimizer (ZeRO-1): optimizer state sharded over data parallelism.

Each parameter is cut along dim 0 into dp equal row blocks (the last ones may
be short or empty), as FSDP2 shards dim 0, so every shard is a rectangle of
the parameter and optimizer state reshards exactly like weights. DP rank r:
reduce-scatters the grads so it holds the averaged grad of its rows, steps
AdamW on those rows only (state for 1/dp of the model), then all-gathers the
updated rows so every rank has the full parameter for the next forward.

Under train.precision=bf16 the model's parameters are bf16 and the optimizer
steps fp32 *main* rows, as Megatron's distributed optimizer does: each shard
then holds its own fp32 copy of the rank's rows (never the whole model in
fp32), its fp32 grad rows come from the reduce-scatter, and the updated rows
travel back as bf16 in the all-gather.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist
import torch.nn as nn


@dataclass
class RowShard:
    """Rows [start, stop) of `param` owned by this DP rank; `view` is what the
    optimizer steps: the rows themselves (shared storage), or their separate
    fp32 main copy when the parameter is bf16."""
    param: nn.Parameter
    start: int
    stop: int
    rows_per_rank: int
    view: nn.Parameter


def shard_rows(rows: int, dp: int, dp_rank: int) -> tuple[int, int, int]:
    per_rank = -(-rows // dp)
    start = min(rows, dp_rank * per_rank)
    return start, min(rows, start + per_rank), per_rank


def make_shard(param: nn.Parameter, dp: int, dp_rank: int, *,
               separate_main: bool = False) -> RowShard:
    """This rank's row shard of `param`. `separate_main`: the shard keeps an
    fp32 copy of its rows (the parameter is about to be cast to bf16)."""
    flat_rows = param.data if param.ndim > 0 else param.data.view(1)
    start, stop, per_rank = shard_rows(flat_rows.shape[0], dp, dp_rank)
    rows = flat_rows[start:stop]
    # Without a separate main copy, a Parameter built on a slice shares the
    # parameter's storage: stepping the shard updates this rank's rows in place.
    view = nn.Parameter(rows.to(torch.float32, copy=True) if separate_main else rows,
                        requires_grad=False)
    return RowShard(param, start, stop, per_rank, view)


def _padded_rows(t: torch.Tensor, rows: int) -> torch.Tensor:
    if t.shape[0] == rows:
        return t
    return torch.cat([t, t.new_zeros(rows - t.shape[0], *t.shape[1:])])


def _rows(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1) if t.ndim == 0 else t


def _row_size(shard: RowShard) -> int:
    """Elements in one row of the shard's parameter."""
    return _rows(shard.param.data)[0].numel()


def _bucketed(shards: list[RowShard], bucket_bytes: int) -> list[list[RowShard]]:
    buckets, current, used = [], [], 0
    for shard in shards:
        current.append(shard)
        used += shard.param.numel() * shard.param.element_size()
        if used >= bucket_bytes:
            buckets.append(current)
            current, used = [], 0
    return buckets + ([current] if current else [])


class DistributedOptimizer:
    """Wraps an optimizer class so it steps only this rank's row shards.

    It is the data-parallel `Reducer` of the grad buffers (parallel/
    data_parallel.py): one reduce-scatter per grad bucket, launched as the
    bucket's grads become final during backward. After the step the updated
    rows travel back in one all-gather per bucket of about `bucket_bytes`.

    `separate_main`: the shards keep fp32 main rows of parameters the caller
    then casts to bf16 (train.precision=bf16; train/precision.py)."""

    def __init__(self, param_groups: list[dict], optimizer_cls, optimizer_kwargs: dict, *,
                 group: Optional[dist.ProcessGroup], dp: int, dp_rank: int,
                 bucket_bytes: int = 25 * 2**20, separate_main: bool = False,
                 mean_over: Optional[int] = None):
        self.group, self.dp, self.dp_rank = group, dp, dp_rank
        self.mean_over = mean_over or dp  # the batches the summed grads came from
        self.separate_main = separate_main
        self.shards: list[RowShard] = []
        inner_groups = []
        for param_group in param_groups:
            shards = [make_shard(p, dp, dp_rank, separate_main=separate_main)
                      for p in param_group["params"]]
            self.shards += shards
            # Ranks past the last row of a small tensor own nothing of it.
            owned = [s.view for s in shards if s.stop > s.start]
            inner_groups.append({**param_group, "params": owned})
        self.inner = optimizer_cls(inner_groups, **optimizer_kwargs)
        self.shard_of = {s.param: s for s in self.shards}
        self.gather_buckets = _bucketed(self.shards, bucket_bytes)
        self.scattered: dict[int, torch.Tensor] = {}  # id(grad bucket) -> this rank's rows

    @property
    def param_groups(self) -> list[dict]:
        return self.inner.param_groups

    # --- Reducer: grads ---------------------------------------------------------------

    def launch(self, bucket) -> dist.Work:
        """Reduce-scatter a grad bucket: rank r receives the mean over
        `mean_over` batches of every parameter's r-th row block, laid end to
        end."""
        shards = [self.shard_of[p] for p in bucket.params]
        # (dp, sum of row blocks): row r holds every parameter's r-th block.
        staged = torch.cat([_padded_rows(_rows(view), s.rows_per_rank * self.dp).reshape(self.dp, -1)
                            for s, view in zip(shards, bucket.views)], dim=1).div_(self.mean_over)
        out = torch.empty_like(staged[0])
        self.scattered[id(bucket)] = out
        return dist.reduce_scatter(out, list(staged.unbind(0)), group=self.group, async_op=True)

    def landed(self, bucket) -> None:
        """Hand each owned row block of the reduced bucket to its shard as its grad."""
        out, offset = self.scattered.pop(id(bucket)), 0
        for param in bucket.params:
            shard = self.shard_of[param]
            width = shard.rows_per_rank * _row_size(shard)
            block = out[offset:offset + width].view(shard.rows_per_rank, *shard.view.shape[1:])
            shard.view.grad = block[: shard.stop - shard.start]
            offset += width

    # --- step and parameters ----------------------------------------------------------

    @torch.no_grad()
    def step(self) -> None:
        self.inner.step()
        self.gather_params()

    @torch.no_grad()
    def gather_params(self) -> None:
        """Every rank's updated rows into the full parameters (in the
        parameters' dtype: bf16 rows travel under train.precision=bf16). Also
        what a checkpoint load of the shards' main rows ends with."""
        pending = []
        for shards in self.gather_buckets:
            mine = torch.cat([_padded_rows(s.view.data.to(s.param.dtype), s.rows_per_rank)
                              .reshape(-1) for s in shards])
            gathered = [torch.empty_like(mine) for _ in range(self.dp)]
            pending.append((shards, gathered, dist.all_gather(gathered, mine, group=self.group,
                                                              async_op=True)))
        for shards, gathered, work in pending:
            work.wait()
            self._scatter_back(shards, gathered)

    @staticmethod
    def _scatter_back(shards: list[RowShard], gathered: list[torch.Tensor]) -> None:
        """Copy every rank's updated rows into the full parameters."""
        offset = 0
        for shard in shards:
            full = _rows(shard.param.data)
            width = shard.rows_per_rank * _row_size(shard)
            blocks = [g[offset:offset + width].view(shard.rows_per_rank, *full.shape[1:])
                      for g in gathered]
            full.copy_(torch.cat(blocks)[: full.shape[0]])
            offset += width

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Drop the shards' grads; the full grads live in the grad buffers."""
        for shard in self.shards:
            shard.view.grad = None
