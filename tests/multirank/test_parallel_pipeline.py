"""The pipeline runtime drives any chunk that keeps the `StageChunk` protocol:
a toy model (no GPT) split over two gloo ranks gets the unpipelined loss and
grads, and every chunk is handed its micro-batches' samples and documents in
order, at any micro-batch count from step to step (a batch ramp's) and in eval between."""
from __future__ import annotations

import os
from typing import Optional

import torch
import torch.distributed as dist
import torch.nn as nn

from tests.harness.dist import spawn_ranks
from megaresil.config import ParallelConfig, PipelineSchedule
from megaresil.ports import free_port
from megaresil.parallel.layout import ParallelLayout
from megaresil.parallel.pipeline import Pipeline, virtual_stages

VOCAB, WIDTH, MICRO_BATCH, SEQ = 11, 8, 2, 5
# A step's micro-batches, as a batch ramp's steps have them, with an eval of 4 between.
COUNTS = (2, 4, 6)


class ToyChunk(nn.Module):
    """Embedding on the first chunk, one tanh layer each, a head on the last."""

    def __init__(self, stage: int, stages: int):
        super().__init__()
        torch.manual_seed(stage)  # the same weights on every rank, for the reference
        self.first, self.last = stage == 0, stage == stages - 1
        self.embed = nn.Embedding(VOCAB, WIDTH) if self.first else None
        self.mix = nn.Linear(WIDTH, WIDTH)
        self.head = nn.Linear(WIDTH, VOCAB) if self.last else None
        self.seen: list[tuple[torch.Tensor, object]] = []  # (samples, documents) fed

    def stage_forward(self, x: torch.Tensor, samples: Optional[torch.Tensor],
                      documents: object = None) -> torch.Tensor:
        if samples is not None:
            self.seen.append((samples, documents))
        if self.embed is not None:
            x = self.embed(x)
        x = torch.tanh(self.mix(x))
        return self.head(x) if self.head is not None else x

    def loss(self, output: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return nn.functional.cross_entropy(output.flatten(0, 1), targets.flatten())

    def example_io(self, micro_batch: int, seq_len: int, output_dtype: torch.dtype,
                   device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        hidden = torch.empty(micro_batch, seq_len, WIDTH, device=device)
        tokens = torch.empty(micro_batch, seq_len, dtype=torch.long, device=device)
        logits = torch.empty(micro_batch, seq_len, VOCAB, dtype=output_dtype, device=device)
        return (tokens if self.first else hidden), (logits if self.last else hidden)


def batch(micro_batches: int) -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor]]:
    generator = torch.Generator().manual_seed(7 + micro_batches)
    shape = (MICRO_BATCH * micro_batches, SEQ)
    inputs = torch.randint(VOCAB, shape, generator=generator)
    targets = torch.randint(VOCAB, shape, generator=generator)
    samples = [torch.arange(i * MICRO_BATCH, (i + 1) * MICRO_BATCH) for i in range(micro_batches)]
    return inputs, targets, samples


def reference(stages: int, micro_batches: int) -> tuple[torch.Tensor, list[ToyChunk]]:
    """Mean micro-batch loss and its grads, all chunks in one process."""
    chunks = [ToyChunk(s, stages) for s in range(stages)]
    inputs, targets, _ = batch(micro_batches)
    losses = []
    for x, y in zip(inputs.split(MICRO_BATCH), targets.split(MICRO_BATCH)):
        for chunk in chunks:
            x = chunk.stage_forward(x, None)
        losses.append(chunks[-1].loss(x, y))
    loss = torch.stack(losses).mean()
    loss.backward()
    return loss.detach(), chunks


def check_schedule(schedule: PipelineSchedule, vpp: int) -> None:
    layout = ParallelLayout.from_config(ParallelConfig(pp=2, vpp=vpp), torch.device("cpu"))
    stages = layout.pp * vpp
    mine = virtual_stages(layout)
    chunks = [ToyChunk(s, stages) for s in mine]
    pipeline = Pipeline(chunks, layout, schedule, micro_batch=MICRO_BATCH, seq_len=SEQ)
    for micro_batches in COUNTS:
        for chunk in chunks:
            chunk.zero_grad(set_to_none=True)
            chunk.seen.clear()
        inputs, targets, samples = batch(micro_batches)
        # Opaque to the runtime: each chunk is handed its micro-batch's own.
        documents = [f"documents of micro-batch {i}" for i in range(micro_batches)]
        loss = pipeline.train_step(inputs, targets, samples, documents)
        expected_loss, expected = reference(stages, micro_batches)
        if layout.is_last_stage:
            torch.testing.assert_close(loss, expected_loss)
        for stage, chunk in zip(mine, chunks):
            assert [(s.tolist(), d) for s, d in chunk.seen] == \
                [(s.tolist(), d) for s, d in zip(samples, documents)], stage
            for (name, param), want in zip(chunk.named_parameters(),
                                           expected[stage].parameters()):
                where = f"{schedule.value}, {micro_batches} micro-batches, stage {stage}, {name}"
                torch.testing.assert_close(param.grad, want.grad, msg=lambda m: f"{where}: {m}")
        inputs, targets, _ = batch(4)
        for chunk in chunks:
            chunk.eval()
        pipeline.eval_step(inputs, targets, [None] * 4)
        for chunk in chunks:
            chunk.train()


def _worker(rank: int, port: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE="2", LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    try:
        check_schedule(PipelineSchedule.one_f_one_b, vpp=1)
        check_schedule(PipelineSchedule.interleaved_1f1b, vpp=2)
    finally:
        dist.destroy_process_group()


def test_pipeline_runs_any_stage_chunk_like_the_unpipelined_model():
    spawn_ranks(_worker, (free_port(),), 2)
