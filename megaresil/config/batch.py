"""The global batch of each step, and the rules of train.rampup_batch_size.

Without a ramp every step trains train.global_batch_size samples. With
[START, INCREMENT, SAMPLES] (Megatron-LM's --rampup-batch-size) the batch is
set by the data position alone, the global samples consumed before the step c:

    batch(c) = START + INCREMENT * min(n, c * n // SAMPLES),
    n = (global_batch_size - START) / INCREMENT increments,

so it grows by INCREMENT every SAMPLES / n samples and is the full batch from
c = SAMPLES on. Because it follows the position, not the step, a resume at
any layout continues the ramp where the uninterrupted run stood, and a batch
passed over (resilience.numerics) is the very batch training would have
consumed there. The arithmetic is on integers: Megatron's float division can
round a boundary that falls on a whole sample down.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from megaresil.config.fields import require
from megaresil.config.schema import PipelineSchedule, RecipeConfig, TrainConfig, resolved_schedule

KEY = "train.rampup_batch_size"


@dataclass(frozen=True)
class BatchRamp:
    """[START, INCREMENT, SAMPLES] up to the full batch `final`."""
    start: int
    increment: int
    samples: int
    final: int

    @classmethod
    def of(cls, train: TrainConfig) -> Optional["BatchRamp"]:
        if train.rampup_batch_size is None:
            return None
        start, increment, samples = train.rampup_batch_size
        return cls(start, increment, samples, train.global_batch_size)

    @property
    def increments(self) -> int:
        return (self.final - self.start) // self.increment

    def batch_at(self, consumed_samples: int) -> int:
        steps_up = min(self.increments, consumed_samples * self.increments // self.samples)
        return self.start + self.increment * steps_up

    def end(self) -> int:
        """The first batch start whose batch is the full one (the ramp's
        batches start at 0 and follow one another)."""
        position = 0
        for level in range(self.increments):
            # Level k's batches start below ceil((k+1) * samples / n).
            bound = -(-(level + 1) * self.samples // self.increments)
            batch = self.start + level * self.increment
            position += max(0, -(-(bound - position) // batch)) * batch
        return position


def global_batch_at(train: TrainConfig, consumed_samples: int) -> int:
    """The global batch of the step that starts at `consumed_samples`."""
    ramp = BatchRamp.of(train)
    return train.global_batch_size if ramp is None else ramp.batch_at(consumed_samples)


def batch_start_at_or_below(train: TrainConfig, sample: int) -> int:
    """The last position at or below `sample` where a global batch starts."""
    ramp = BatchRamp.of(train)
    full_from = 0 if ramp is None else ramp.end()
    if sample >= full_from:
        return sample - (sample - full_from) % train.global_batch_size
    position = 0
    while position + global_batch_at(train, position) <= sample:
        position += global_batch_at(train, position)
    return position


def validate_ramp(cfg: RecipeConfig) -> None:
    """Megatron's rules, and each ramp batch's micro-batches fit the pipeline schedule."""
    t, p = cfg.train, cfg.parallel
    if t.rampup_batch_size is None:
        return
    values = list(t.rampup_batch_size)
    require(len(values) == 3 and all(isinstance(v, int) and v > 0 for v in values), KEY,
            f"must be [START, INCREMENT, SAMPLES], three positive integers, got {values}.",
            "write e.g. [8, 8, 1024], or null for no ramp.")
    start, increment, samples = values
    require(start < t.global_batch_size, KEY,
            f"START {start} is not below train.global_batch_size={t.global_batch_size}: "
            "nothing to ramp.", "lower START, or set train.rampup_batch_size=null.")
    require((t.global_batch_size - start) % increment == 0, KEY,
            f"train.global_batch_size - START = {t.global_batch_size - start} is not a "
            f"multiple of INCREMENT {increment}.",
            f"choose an INCREMENT that divides {t.global_batch_size - start}.")
    per_step = t.micro_batch_size * p.dp
    require(start % per_step == 0 and increment % per_step == 0, KEY,
            f"START {start} and INCREMENT {increment} must be multiples of "
            f"micro_batch_size*dp = {t.micro_batch_size}*{p.dp} = {per_step}, so that every "
            "batch of the ramp splits into whole micro-batches.",
            f"use multiples of {per_step}; to resume the ramp later at another dp, multiples "
            "of micro_batch_size times that dp as well.")
    _validate_ramp_pipeline(cfg, start, increment)


def _validate_ramp_pipeline(cfg: RecipeConfig, start: int, increment: int) -> None:
    """The ramp's smallest batch meets what the full one must (config.
    validation's pipeline rules), and every batch between the two does."""
    t, p = cfg.train, cfg.parallel
    if p.pp == 1:
        return
    schedule = resolved_schedule(p)
    per_stage_round = p.pp * t.micro_batch_size * p.dp
    if schedule in (PipelineSchedule.interleaved_1f1b, PipelineSchedule.interleaved_zero_bubble):
        require(start % per_stage_round == 0 and increment % per_stage_round == 0, KEY,
                f"the interleaved schedule needs each step's micro-batches to be a multiple of "
                f"pp={p.pp}, so START {start} and INCREMENT {increment} must be multiples of "
                f"pp*micro_batch_size*dp = {per_stage_round}.",
                f"use multiples of {per_stage_round}.")
    elif schedule == PipelineSchedule.one_f_one_b:
        require(start >= per_stage_round, KEY,
                f"1F1B needs at least pp={p.pp} micro-batches per step, and START {start} "
                f"gives {start // (t.micro_batch_size * p.dp)}.",
                f"raise START to at least {per_stage_round}, or use parallel.schedule=gpipe.")
