"""Pipeline parallelism: run this rank's stage chunks with
`torch.distributed.pipelining` schedules (GPipe, 1F1B, interleaved 1F1B,
interleaved zero-bubble), composed with our TP layers and DP grad sync.

The runtime knows no model class: a chunk is anything that keeps the
`StageChunk` protocol (as Megatron-Core's schedules take a forward-step
function). The model's chunk factory is `megaresil.model.chunks`.

Pipeline rank r holds virtual stages r, r+pp, r+2pp, ... (Megatron's
interleaved assignment, which is also the library's default stage-to-rank map).
"""
from __future__ import annotations

from typing import Any, Optional, Protocol, Sequence

import torch
import torch.distributed as dist
import torch.nn as nn

from megaresil.config import PipelineSchedule
from megaresil.parallel.layout import ParallelLayout
from megaresil.parallel.sharding import EMBEDDING_TIE, spec_of


def schedule_class(schedule: PipelineSchedule) -> type:
    """torch's class for `schedule`. Imported here, not at module level:
    torch.distributed.pipelining pulls in torch._dynamo and sympy (about 1 s
    of every worker's start), which a run without pipeline stages never uses."""
    from torch.distributed.pipelining import (
        Schedule1F1B,
        ScheduleGPipe,
        ScheduleInterleaved1F1B,
        ScheduleInterleavedZeroBubble,
    )
    return {PipelineSchedule.gpipe: ScheduleGPipe,
            PipelineSchedule.one_f_one_b: Schedule1F1B,
            PipelineSchedule.interleaved_1f1b: ScheduleInterleaved1F1B,
            PipelineSchedule.interleaved_zero_bubble: ScheduleInterleavedZeroBubble}[schedule]


MULTI_STAGE = (PipelineSchedule.interleaved_1f1b, PipelineSchedule.interleaved_zero_bubble)


def virtual_stages(layout: ParallelLayout) -> list[int]:
    """The virtual stages this pipeline rank holds, in order."""
    return [chunk * layout.pp + layout.pp_rank for chunk in range(layout.vpp)]


class StageChunk(Protocol):
    """What the runtime needs of one virtual stage's chunk, an nn.Module
    (its parameters are what the stage trains)."""

    first: bool  # takes the model's inputs
    last: bool  # its output is what `loss` reads
    training: bool

    def stage_forward(self, x: torch.Tensor, samples: Optional[torch.Tensor],
                      documents: Any) -> torch.Tensor:
        """The previous stage's output (the model's inputs when first) in,
        this stage's output out; `samples`, the micro-batch's global sample
        indices (None in eval), seed dropout; `documents`, where the
        micro-batch's documents lie (None without document masking), the
        same on every stage."""

    def loss(self, output: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Mean loss of one micro-batch, from a last chunk's output."""

    def example_io(self, micro_batch: int, seq_len: int, output_dtype: torch.dtype,
                   device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """Tensors shaped and typed as this chunk's input and output for one
        micro-batch (a last chunk's output in `output_dtype`)."""


# What a micro-batch brings a chunk besides the stage's input: its global
# sample indices (None in eval) and its documents (None without document masking).
Extras = tuple[Optional[torch.Tensor], Any]


class MicroBatchFeed:
    """Hands a chunk the extras of the micro-batch it is about to run. Every
    schedule runs a chunk's forwards in micro-batch order, so a cursor
    suffices; `finish` checks none was skipped."""

    def __init__(self) -> None:
        self.extras: list[Extras] = []
        self.cursor = 0

    def load(self, extras: list[Extras]) -> None:
        self.extras, self.cursor = extras, 0

    def next(self) -> Extras:
        extras = self.extras[self.cursor]
        self.cursor += 1
        return extras

    def finish(self) -> None:
        if self.cursor != len(self.extras):
            raise RuntimeError(f"pipeline ran {self.cursor} forwards for "
                               f"{len(self.extras)} micro-batches")


class _StageModule(nn.Module):
    """What a PipelineStage runs: one chunk, fed its micro-batch's extras."""

    def __init__(self, chunk: StageChunk, feed: MicroBatchFeed):
        super().__init__()
        self.chunk, self.feed = chunk, feed

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        samples, documents = self.feed.next()
        return self.chunk.stage_forward(x, samples, documents)


def example_io(chunk: StageChunk, micro_batch: int, seq_len: int, output_dtype: torch.dtype,
               device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Example input and output of a chunk for one micro-batch. Given up front,
    they spare the stage its shape-inference forward, which would run the
    chunk (and its TP collectives) an extra time on uninitialised data."""
    example_in, example_out = chunk.example_io(micro_batch, seq_len, output_dtype, device)
    # requires_grad tells the stage that grads flow back through activations
    # (token ids take none).
    return (example_in.requires_grad_(example_in.is_floating_point()),
            example_out.requires_grad_(example_out.is_floating_point()))


class Pipeline:
    """This rank's stage chunks under `schedule`, run for any number of
    micro-batches: a step's count follows its global batch (a batch ramp's
    grow), and torch's schedules and stages are built for one count, so one
    set is built per count as it first comes (the stages then prepare their
    buffers for it). The newest training count's set and the eval count's
    are kept; a ramp only grows, so an older one is not needed again."""

    def __init__(self, chunks: Sequence[StageChunk], layout: ParallelLayout,
                 schedule: PipelineSchedule, *, micro_batch: int,
                 seq_len: int, output_dtype: torch.dtype = torch.float32,
                 scale_grads: bool = True):
        """`output_dtype`: what the last chunk's output comes out as (under
        autocast, its dtype). `scale_grads`: leave the grads as the mean over
        micro-batches; off, as their sum (for a caller that scales them itself)."""
        self.layout, self.chunks, self.kind = layout, list(chunks), schedule
        self.micro_batch, self.seq_len, self.output_dtype = micro_batch, seq_len, output_dtype
        self.scale_grads = scale_grads
        self.feeds = [MicroBatchFeed() for _ in chunks]
        self.last_chunk = chunks[-1] if chunks[-1].last else None
        self.has_first = chunks[0].first
        self.schedules: dict[int, Any] = {}  # micro-batches -> torch's schedule
        self.trained: Optional[int] = None  # the micro-batches of the newest training step
        self.evaluated: Optional[int] = None

    def schedule_for(self, n_microbatches: int, *, training: bool) -> Any:
        """torch's schedule over this rank's stages for `n_microbatches`."""
        if training:
            self.trained = n_microbatches
        else:
            self.evaluated = n_microbatches
        for count in [c for c in self.schedules if c not in (self.trained, self.evaluated)]:
            del self.schedules[count]
        if n_microbatches not in self.schedules:
            self.schedules[n_microbatches] = self._build(n_microbatches)
        return self.schedules[n_microbatches]

    def _build(self, n_microbatches: int) -> Any:
        from torch.distributed.pipelining import PipelineStage  # see schedule_class
        stages = []
        for chunk, feed, v in zip(self.chunks, self.feeds, virtual_stages(self.layout)):
            example_in, example_out = example_io(chunk, self.micro_batch, self.seq_len,
                                                 self.output_dtype, self.layout.device)
            stages.append(PipelineStage(_StageModule(chunk, feed), stage_index=v,
                                        num_stages=self.layout.pp * self.layout.vpp,
                                        device=self.layout.device, input_args=example_in,
                                        output_args=example_out,
                                        group=self.layout.group("pp")))
        target = stages if self.kind in MULTI_STAGE else stages[0]
        return schedule_class(self.kind)(target, n_microbatches=n_microbatches,
                                         loss_fn=self._loss, scale_grads=self.scale_grads)

    def _loss(self, output: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        assert self.last_chunk is not None  # the schedule computes the loss on the last stage only
        return self.last_chunk.loss(output, targets)

    def _run(self, training: bool, inputs: torch.Tensor, targets: torch.Tensor,
             extras: list[Extras]) -> torch.Tensor:
        schedule = self.schedule_for(len(targets) // self.micro_batch, training=training)
        run = schedule.step if training else schedule.eval
        for feed in self.feeds:
            feed.load(extras)
        losses: list[torch.Tensor] = []
        args = (inputs,) if self.has_first else ()
        run(*args, target=targets if self.last_chunk is not None else None, losses=losses)
        for feed in self.feeds:
            feed.finish()
        if not losses:  # only the last stage computes the loss
            return torch.zeros((), device=self.layout.device)
        return torch.stack([loss.detach() for loss in losses]).mean()

    def train_step(self, inputs: torch.Tensor, targets: torch.Tensor,
                   samples: Sequence[torch.Tensor], documents: Sequence[Any]) -> torch.Tensor:
        """Forward and backward of all micro-batches, m = len(targets) /
        micro_batch (grads scaled by 1/m unless built with scale_grads=False),
        each with its samples and documents; returns the mean micro-batch loss
        (zero off the last stage)."""
        return self._run(True, inputs, targets, list(zip(samples, documents)))

    @torch.no_grad()
    def eval_step(self, inputs: torch.Tensor, targets: torch.Tensor,
                  documents: Sequence[Any]) -> torch.Tensor:
        return self._run(False, inputs, targets,
                         [(None, micro_batch) for micro_batch in documents])


def sync_tied_embedding_grads(entries: list[tuple[nn.Parameter, torch.Tensor]],
                              group: Optional[dist.ProcessGroup]) -> None:
    """Sum the grads of the embedding and its copy on the last stage. `entries`
    pairs each param with the grad this rank holds of it (the same rows on
    both stages)."""
    for param, grad in entries:
        if spec_of(param).tie == EMBEDDING_TIE and group is not None:
            dist.all_reduce(grad, group=group)
