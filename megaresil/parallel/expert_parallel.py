"""Expert parallelism's collectives over an explicit `EPGroup`: the ranks of
one expert-parallel group hold different experts and swap routed rows by
all-to-all, each rank sending every peer the rows of the peer's experts.

The all-to-all is an autograd function whose backward is the reverse
all-to-all, so a row's gradient goes back to the rank its token came from.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class EPGroup:
    group: Optional[dist.ProcessGroup] = None
    size: int = 1
    rank: int = 0

    @property
    def active(self) -> bool:
        return self.size > 1


def exchange_counts(send: torch.Tensor, ep: EPGroup) -> torch.Tensor:
    """(ep, n) counts, row r for rank r, in; row r of what rank r sent here out."""
    received = torch.empty_like(send)
    dist.all_to_all_single(received, send.contiguous(), group=ep.group)
    return received


def _all_to_all(rows: torch.Tensor, send: list[int], receive: list[int],
                ep: EPGroup) -> torch.Tensor:
    out = rows.new_empty((sum(receive), *rows.shape[1:]))
    dist.all_to_all_single(out, rows.contiguous(), output_split_sizes=receive,
                           input_split_sizes=send, group=ep.group)
    return out


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, rows: torch.Tensor, send: list[int], receive: list[int],
                ep: EPGroup) -> torch.Tensor:
        ctx.send, ctx.receive, ctx.ep = send, receive, ep
        return _all_to_all(rows, send, receive, ep)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Optional[torch.Tensor], None, None, None]:
        return _all_to_all(grad, ctx.receive, ctx.send, ctx.ep), None, None, None


def all_to_all(rows: torch.Tensor, send: list[int], receive: list[int],
               ep: EPGroup) -> torch.Tensor:
    """`rows` cut along dim 0 into `send[r]` rows for each rank r; out: the
    `receive[r]` rows from each rank r, in rank order."""
    return _AllToAll.apply(rows, send, receive, ep)
