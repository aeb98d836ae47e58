"""Deterministic, resumable batching whose whole position is one number:
`consumed_samples`, the global samples consumed so far.

The global batch after `consumed_samples` is the global sample indices
[consumed, consumed + global_batch_size); data-parallel rank r takes the
contiguous r-th slice of it, cut into micro-batches in order. So the batches
do not depend on dp (a run may resume with another dp) and every index is
seen by exactly one rank. A global batch a run skips (`skip_past`) is
recorded with the position, so a resumed run skips it too.
"""
from __future__ import annotations

from typing import Mapping, Protocol, Sequence

import torch


class SampleDataset(Protocol):
    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]: ...


def micro_batches(consumed_samples: int, global_batch_size: int, micro_batch_size: int,
                  dp_rank: int, dp_size: int) -> list[list[int]]:
    """The global sample indices of this rank's micro-batches for one step."""
    _check_batch_layout(consumed_samples, global_batch_size, micro_batch_size, dp_rank, dp_size)
    per_rank = global_batch_size // dp_size
    first = consumed_samples + dp_rank * per_rank
    return [list(range(start, start + micro_batch_size))
            for start in range(first, first + per_rank, micro_batch_size)]


def skip_past(consumed_samples: int, skipped: Mapping[int, int]) -> int:
    """The data position after passing over skipped global batches at
    `consumed_samples`: `skipped` maps a skipped batch's first sample to its
    size (resilience.numerics skips a batch a step stayed non-finite on)."""
    while consumed_samples in skipped:
        consumed_samples += skipped[consumed_samples]
    return consumed_samples


def _check_batch_layout(consumed_samples: int, global_batch_size: int, micro_batch_size: int,
                        dp_rank: int, dp_size: int) -> None:
    if consumed_samples < 0:
        raise ValueError(f"consumed_samples must be >= 0, got {consumed_samples}.")
    if not 0 <= dp_rank < dp_size:
        raise ValueError(f"dp_rank {dp_rank} is outside 0..{dp_size - 1}.")
    per_step = micro_batch_size * dp_size
    if micro_batch_size < 1 or global_batch_size < 1 or global_batch_size % per_step:
        raise ValueError(f"train.global_batch_size: {global_batch_size} is not a positive "
                         f"multiple of micro_batch_size*dp = {micro_batch_size}*{dp_size}. "
                         f"Fix: use a multiple of {per_step}.")


def collate(dataset: SampleDataset, indices: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Stack samples into (inputs, targets), each (batch, seq_len) int64."""
    samples = [dataset[i] for i in indices]
    inputs = torch.stack([inputs for inputs, _ in samples])
    targets = torch.stack([targets for _, targets in samples])
    return inputs, targets
