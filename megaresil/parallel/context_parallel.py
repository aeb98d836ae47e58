"""Context parallelism's arithmetic over an explicit `CPGroup`: which part of
each sequence a context-parallel rank holds, where its tokens stand in the
sequence, and the loss share that makes the cp ranks' sum the whole
sequence's mean.

A sequence of T tokens is cut into 2*cp chunks; rank r holds chunks r and
2*cp-1-r, a head and a tail (zig-zag, as Megatron-Core and TorchTitan
balance causal attention): under a causal mask every rank then has the same
number of query-key pairs to compute. The attention over the slices is
model/context_attention.py's.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist

from megaresil.config import ContextComm
from megaresil.parallel.tensor_parallel import IGNORE_TARGET


@dataclass(frozen=True)
class CPGroup:
    group: Optional[dist.ProcessGroup] = None
    size: int = 1
    rank: int = 0
    comm: ContextComm = ContextComm.allgather

    @property
    def active(self) -> bool:
        return self.size > 1

    def chunk_ids(self, rank: Optional[int] = None) -> tuple[int, int]:
        """The global chunk numbers rank `rank` (this one by default) holds, in its order."""
        rank = self.rank if rank is None else rank
        return rank, 2 * self.size - 1 - rank

    def owner(self, chunk: int) -> tuple[int, int]:
        """(rank, its half: 0 the head, 1 the tail) holding global chunk `chunk`."""
        return (chunk, 0) if chunk < self.size else (2 * self.size - 1 - chunk, 1)

    def slice_sequence(self, x: torch.Tensor, dim: int = 1) -> torch.Tensor:
        """This rank's part of `x`, whole sequences along `dim`: its two chunks, in order."""
        if not self.active:
            return x
        chunks = x.chunk(2 * self.size, dim=dim)
        return torch.cat([chunks[i] for i in self.chunk_ids()], dim=dim)

    def positions(self, local_len: int, device: torch.device,
                  rank: Optional[int] = None) -> torch.Tensor:
        """(local_len,) each local token's place in the whole sequence."""
        if not self.active:
            return torch.arange(local_len, device=device)
        c = local_len // 2
        return torch.cat([torch.arange(i * c, (i + 1) * c, device=device)
                          for i in self.chunk_ids(rank)])

    def token_share(self, targets: torch.Tensor) -> Optional[torch.Tensor]:
        """This rank's share of the counted targets of the whole sequences
        (fp32; None without context parallelism). A mean over the rank's
        own counted tokens times its share is its part of the mean over
        every counted token, so the cp ranks' parts (and their grads, which
        the dp x cp gradient group sums) add up to it, whatever share each
        rank holds. (A rank none of whose tokens count, every one an eod
        under data.eod_mask_loss, has a 0/0 mean: a non-finite loss, which
        the numerics check refuses.)"""
        if not self.active:
            return None
        kept = (targets != IGNORE_TARGET).sum().to(torch.float32)
        return kept / self.sum(kept)

    def sum(self, value: torch.Tensor) -> torch.Tensor:
        """`value` summed over the cp ranks (a copy; no grad)."""
        if not self.active:
            return value
        value = value.detach().clone()
        dist.all_reduce(value, group=self.group)
        return value
