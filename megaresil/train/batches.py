"""A rank's micro-batches of a dataset, read and masked as training reads
them, and the mean loss over a held-out set of global batches: one home
for the trainer's step and eval (train/loop.py) and for `megaresil eval`
on a split, which reads them with the model alone (inference.py)."""
from __future__ import annotations

from typing import Callable, NamedTuple, Optional, Sequence

import torch

from megaresil.config import TrainConfig
from megaresil.data.sampler import SampleDataset, collate, micro_batches
from megaresil.model.gpt import GPT
from megaresil.model.masks import DocumentMasking, Documents
from megaresil.parallel.layout import ParallelLayout
from megaresil.train.precision import ComputeContext


class Batch(NamedTuple):
    """One micro-batch on this rank's device."""
    inputs: torch.Tensor  # (B, T) token ids
    targets: torch.Tensor  # (B, T) token ids; IGNORE_TARGET where data.eod_mask_loss leaves one out
    samples: torch.Tensor  # (B,) global sample indices
    documents: Optional[Documents]  # where its documents lie; None without document masking


def read_batches(dataset: SampleDataset, consumed: int, global_batch: int, micro_batch: int,
                 layout: ParallelLayout, masking: Optional[DocumentMasking]) -> list[Batch]:
    """This DP rank's micro-batches of the `global_batch` samples from
    `consumed` (under context parallelism this rank's chunks of them), their
    documents found (model/masks.py) on the host before they move to the device."""
    indices = micro_batches(consumed, global_batch, micro_batch, layout.data_rank,
                            layout.data_size)
    context = layout.context_parallel()
    batches = []
    for idx in indices:
        inputs, targets = collate(dataset, idx)
        documents = None
        if masking is not None:
            targets, documents = masking.apply(inputs, targets)
        # Context parallelism: this rank's chunks of each sequence.
        inputs, targets = context.slice_sequence(inputs), context.slice_sequence(targets)
        documents = None if documents is None else documents.context_slice(context)
        batches.append(Batch(inputs.to(layout.device), targets.to(layout.device),
                             torch.tensor(idx),
                             None if documents is None else documents.to(layout.device)))
    return batches


def held_out_loss(dataset: SampleDataset, train: TrainConfig, layout: ParallelLayout,
                  masking: Optional[DocumentMasking],
                  forward: Callable[[Sequence[Batch]], torch.Tensor]) -> torch.Tensor:
    """This rank's mean loss over the first train.eval_batches global batches
    of `dataset` (full batches of train.global_batch_size); `forward`: the mean
    loss over one global batch's micro-batches on this rank."""
    g = train.global_batch_size
    return torch.stack([forward(read_batches(dataset, i * g, g, train.micro_batch_size, layout,
                                             masking))
                        for i in range(train.eval_batches)]).mean()


def model_loss(model: GPT, autocast: ComputeContext, batches: Sequence[Batch]) -> torch.Tensor:
    """The mean loss of a whole model (no pipeline) over `batches`, of the
    whole sequences under context parallelism (the cp ranks' shares summed)."""
    with autocast:
        loss = torch.stack([model(x, y, None, d) for x, y, _, d in batches]).mean()
    return model.cp.sum(loss)
