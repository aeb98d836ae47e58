"""The compute of one step over a rank's parts (train/build.TrainerParts):
forward and backward over the micro-batches, the gradient syncs, the step's
global figures (loss and grad norm) and the eval forward. What is checked,
applied and recorded around them is the trainer's (train/loop.py)."""
from __future__ import annotations

from typing import Sequence

import torch
import torch.distributed as dist

from megaresil.parallel.data_parallel import all_reduce_sequence_parallel_grads
from megaresil.parallel.grad_groups import Held, StepGrads
from megaresil.parallel.layout import ParallelLayout
from megaresil.parallel.pipeline import sync_tied_embedding_grads
from megaresil.train.batches import Batch, model_loss
from megaresil.train.build import TrainerParts
from megaresil.train.numerics import StepResult
from megaresil.train.optim import local_grad_norm_squared, reduce_grad_norm


def dp_mean(value: torch.Tensor, layout: ParallelLayout) -> float:
    """Mean of a scalar over data-parallel ranks, as a Python float."""
    if layout.dp > 1:
        value = value.clone()
        dist.all_reduce(value, group=layout.group("dp"))
        value /= layout.dp
    return value.item()


def forward_backward(parts: TrainerParts, batches: Sequence[Batch],
                     device: torch.device) -> torch.Tensor:
    """Accumulate grads over micro-batches; returns this rank's mean loss
    (zero on pipeline stages that do not compute it), of whole sequences
    under context parallelism."""
    if parts.pipeline is not None:
        set_moe_loss_scale(parts, 1.0)  # the schedule's backward takes each loss whole
        inputs, targets, samples, documents = zip(*batches)
        with parts.autocast:
            loss = parts.pipeline.train_step(torch.cat(inputs), torch.cat(targets), samples,
                                             documents)
        # The schedule sums the micro-batches' grads; make them the mean.
        parts.grads.fold_all(divisor=len(batches))
        return whole_sequences(parts, loss)
    model = parts.chunks[0]
    set_moe_loss_scale(parts, 1.0 / len(batches))
    total = torch.zeros((), device=device)
    for i, batch in enumerate(batches):
        if i == len(batches) - 1:
            parts.grads.arm()  # overlap the DP reduction with the last backward
        with parts.autocast:
            loss = model(batch.inputs, batch.targets, batch.samples, batch.documents)
            loss = loss / len(batches)
        loss.backward()
        total += loss.detach()
    return whole_sequences(parts, total)


def whole_sequences(parts: TrainerParts, loss: torch.Tensor) -> torch.Tensor:
    """A loss of this rank's slices as the whole sequences' (summed over the
    context-parallel ranks, whose losses are shares: GPT.loss)."""
    return parts.chunks[0].cp.sum(loss)


def set_moe_loss_scale(parts: TrainerParts, value: float) -> None:
    """What the step's backward multiplies each micro-batch's loss by, for
    the routing losses of mixture-of-experts layers to match."""
    for chunk in parts.chunks:
        chunk.moe_loss_scale.value = value


def sync_grads(grads: StepGrads, layout: ParallelLayout) -> list[Held]:
    """Finish the grad reductions; returns per gradient group (param, grad
    this rank steps on)."""
    grads.finish()  # DP mean, or under the distributed optimizer its row shards
    held = grads.held()
    entries = [entry for group in held for entry in group]
    # Linear sums over TP / the embedding group: on whichever grads this
    # rank holds, the same rows on every rank of those groups.
    all_reduce_sequence_parallel_grads(entries, layout.group("tp") if layout.tp > 1 else None)
    sync_tied_embedding_grads(entries, layout.embedding_group)
    return held


def step_figures(held: list[Held], grads: StepGrads, layout: ParallelLayout,
                 loss: torch.Tensor, loss_factor: float = 1.0) -> StepResult:
    """The attempt's global grad norm and data-parallel mean loss, with this
    rank's own loss and squared norm (resilience.numerics reads them)."""
    squares = [local_grad_norm_squared(group, layout) for group in held]
    norm, stage_loss = reduce_grad_norm(squares, layout, sharded_over=grads.sharded_over(),
                                        loss=loss, loss_factor=loss_factor)
    local = sum(squares[1:], squares[0])
    # The norm rides in the loss's data-parallel mean: every rank sees any
    # rank's non-finite value (the loss rode in the norm's all-reduce).
    return StepResult(dp_mean(stage_loss + norm.to(stage_loss.dtype) * 0.0, layout),
                      norm, loss, local)


def zero_grads(parts: TrainerParts) -> None:
    """Ready for the next step's backward, whether or not the update was applied."""
    parts.grads.zero()
    if parts.sharded_optimizer:
        parts.optimizer.zero_grad()


def forward_eval(parts: TrainerParts, batches: Sequence[Batch]) -> torch.Tensor:
    """The mean loss over `batches`, without grads' bookkeeping."""
    if parts.pipeline is None:
        return model_loss(parts.chunks[0], parts.autocast, batches)
    inputs, targets, _, documents = zip(*batches)
    with parts.autocast:
        loss = parts.pipeline.eval_step(torch.cat(inputs), torch.cat(targets), documents)
    return whole_sequences(parts, loss)

