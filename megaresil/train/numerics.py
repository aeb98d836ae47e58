"""The trainer's side of resilience.numerics: each step is checked before its
update (train/optim.reduce_grad_norm, Trainer.optimizer_step); a non-finite
step is replayed once from the same samples and RNG state, and one that stays
non-finite rolls the run back to its newest checkpoint and skips the step's
global batch; the layer where routing scores went non-finite is named
(train/routing_watch.py). A loss spike is warned of, skipped, or rolled
back with its data window skipped (on_spike). The decisions are resilience/numerics.py's;
docs/numerics.md tells the whole story."""
from __future__ import annotations

import math
import random
import statistics
from dataclasses import dataclass
from typing import Callable, ContextManager, Optional

import numpy as np
import torch
import torch.distributed as dist

from megaresil.config import RecipeConfig, SpikePolicy, global_batch_at
from megaresil.parallel.layout import ParallelLayout
from megaresil.resilience.numerics import (
    Figures,
    LossWatch,
    PersistentNumericalFault,
    Spike,
    WatchSizes,
    differing_ranks,
    find_spike,
    nonfinite_ranks,
    rollback_refusal,
    skip_refusal,
    what_is_nonfinite,
)
from megaresil.train.checkpointing import TrainCheckpointing
from megaresil.train.progress import Progress
from megaresil.train.routing_watch import RoutingWatch
from megaresil.train.state import configured_skips

Section = Callable[[str, int], ContextManager]


@dataclass
class StepResult:
    """One attempt of a step: its global figures, this rank's own loss and
    squared grad norm (tensors, read only on the rare non-finite path), and
    whether its update was applied."""
    loss: float  # data-parallel mean; non-finite when any rank's loss or grad norm is
    norm: torch.Tensor  # the global grad norm
    local_loss: torch.Tensor
    local_norm_squared: torch.Tensor
    applied: bool = False
    spike: Optional[Spike] = None

    @property
    def finite(self) -> bool:
        return math.isfinite(self.loss)

    @property
    def grad_norm(self) -> float:
        return self.norm.item()


def rng_snapshot() -> tuple:
    """This process's global RNG states, as they are (no conversion: taken every step)."""
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None
    return random.getstate(), np.random.get_state(), torch.get_rng_state(), cuda


def restore_rng(snapshot: tuple) -> None:
    python, numpy_state, cpu, cuda = snapshot
    random.setstate(python)
    np.random.set_state(numpy_state)
    torch.set_rng_state(cpu)
    if cuda is not None:
        torch.cuda.set_rng_state_all(cuda)


def gather_figures(result: StepResult, layout: ParallelLayout) -> list[Figures]:
    """Every rank's own figures of an attempt, in rank order: one small
    all-gather over the world, on the rare non-finite path only."""
    mine = torch.stack([result.local_loss.detach().double().reshape(()),
                        result.local_norm_squared.detach().double().reshape(())])
    if dist.is_initialized() and dist.get_world_size() > 1:
        parts = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
        dist.all_gather(parts, mine)
    else:
        parts = [mine]
    return [Figures(*p.tolist()) for p in parts]


def gather_nonfinite_routing(watch: RoutingWatch) -> list[list]:
    """[rank, layer] for each rank whose routing scores went non-finite in
    the attempt, at that layer (RoutingWatch.first_nonfinite): an
    all-gather over the world, on the non-finite path only."""
    mine = watch.first_nonfinite()
    every: list[Optional[str]] = [mine]
    if dist.is_initialized() and dist.get_world_size() > 1:
        every = [None] * dist.get_world_size()
        dist.all_gather_object(every, mine)
    return [[rank, layer] for rank, layer in enumerate(every) if layer is not None]


class NumericsGuard:
    """Runs each step through the check: `run(step, attempt)` returns the
    applied attempt, or None after a rollback (the caller goes on from the
    checkpoint's step). Events go out from rank 0, which sees every rank's
    figures."""

    def __init__(self, cfg: RecipeConfig, layout: ParallelLayout, progress: Progress,
                 checkpointing: TrainCheckpointing, events, section: Section,
                 routing_watch: Optional[RoutingWatch] = None):
        """`section`: the supervision's (the rollback's load runs in a
        checkpoint section, under the checkpoint's watchdog budget);
        `routing_watch`: the routers' notes, on every rank of a model with experts."""
        self.cfg, self.layout, self.progress = cfg, layout, progress
        self.routing_watch = routing_watch
        self.checkpointing, self.events, self.section = checkpointing, events, section
        self.settings = cfg.resilience.numerics
        self.rollbacks = 0  # made by this trainer: its metrics lines say so
        self.sizes = WatchSizes(self.settings.spike_window, self.settings.spike_skip_window,
                                self.settings.spike_level_shift)

    def emit(self, event: str, **fields) -> None:
        if self.layout.rank == 0:
            self.events.emit(event, **fields)

    @property
    def watch(self) -> LossWatch:
        return self.progress.watch  # the Progress's: a load replaces it

    def holds_back(self, step: int, result: StepResult) -> bool:
        """Whether the attempt's update must not be applied: a non-finite
        step (checked), or a spike that on_spike skips or rolls back (not one
        the state causes: skipping batches cannot cure that)."""
        if not result.finite:
            return self.settings.enabled
        result.spike = self.spike_in(step, result.loss)
        return result.spike is not None and self.acts_on_spike(step)

    def acts_on_spike(self, step: int) -> bool:
        return self.settings.on_spike != SpikePolicy.warn and not self.watch.state_caused(step)

    def spike_in(self, step: int, loss: float) -> Optional[Spike]:
        """A spike against the loss window, off during the LR warmup."""
        if self.settings.on_spike == SpikePolicy.none or step <= self.cfg.optimizer.warmup_steps:
            return None
        return find_spike(loss, self.watch.losses, self.settings.spike_window,
                          self.settings.spike_threshold)

    def run(self, step: int, attempt: Callable[[], StepResult]) -> Optional[StepResult]:
        rng = rng_snapshot() if self.settings.enabled else None
        first = attempt()
        if first.spike is not None:
            return self.after_spike(step, first, first.spike)
        if first.applied or not self.settings.enabled:
            return self.applied(step, first)
        before = gather_figures(first, self.layout)
        what, where = what_is_nonfinite(before), {}
        routers = gather_nonfinite_routing(self.routing_watch) if self.routing_watch is not None else []
        if routers:
            what, where = f"routing scores, {what}", {"routers": routers}
        self.emit("nonfinite_detected", step=step, what=what, ranks=nonfinite_ranks(before),
                  **where, samples=self.samples(), next=f"update not applied; replaying step {step}")
        assert rng is not None  # taken: the checks are enabled
        restore_rng(rng)
        second = attempt()  # the same samples: the position moves only once a step is applied
        again = gather_figures(second, self.layout)
        differed = differing_ranks(before, again)
        if second.applied:
            self.emit("step_replayed", step=step, outcome="transient", differed_ranks=differed,
                      next="continuing with the replayed step")
            return self.applied(step, second)
        self.emit("step_replayed", step=step, outcome="persistent", differed_ranks=differed,
                  next="rolling back to the newest checkpoint and skipping the step's samples")
        refusal = rollback_refusal(step, self.skips_made(), self.settings.max_rollbacks, again)
        if refusal:
            raise PersistentNumericalFault(refusal)
        self.rollback(step, "nonfinite", [self.progress.consumed_samples])
        return None

    def applied(self, step: int, result: StepResult) -> StepResult:
        """An applied step: its start joins the batches a spike's rollback
        skips, its loss (unless a spike) the window spikes are measured on."""
        median = statistics.median(self.watch.losses) if self.watch.losses else None
        if self.watch.applied(step, self.progress.consumed_samples, result.loss,
                              result.spike is not None, self.sizes):
            self.emit("loss_level_shift", step=step, steps=self.sizes.level_shift,
                      median=median, new_median=statistics.median(self.watch.losses),
                      next=f"the spike window starts again from these {self.sizes.level_shift} "
                      f"losses; spikes are measured once it holds {self.sizes.window}")
        return result

    def after_spike(self, step: int, result: StepResult, spike: Spike) -> Optional[StepResult]:
        policy = self.settings.on_spike
        state_caused = self.watch.state_caused(step)
        fields = dict(step=step, loss=spike.loss, median=spike.median,
                      deviations=round(spike.deviations, 2),
                      threshold=self.settings.spike_threshold, samples=self.samples(),
                      policy=policy.value, state_caused=state_caused)
        if not self.acts_on_spike(step):
            self.emit("loss_spike", **fields, next=self.why_applied(step, state_caused))
            return self.applied(step, result)
        refusal = skip_refusal(step, self.skips_made(), self.settings.max_rollbacks,
                               f"a loss spike ({spike.loss:.4g} against a median of "
                               f"{spike.median:.4g})")
        if refusal:
            raise PersistentNumericalFault(refusal)
        if policy == SpikePolicy.skip:
            self.emit("loss_spike", **fields, next="update not applied; skipping its batch")
            first = self.progress.consumed_samples
            self.progress.skipped = {**self.progress.skipped,
                                     first: global_batch_at(self.cfg.train, first)}
            self.watch.cured_step = step
            self.emit("samples_skipped", step=step, samples=self.samples(),
                      next=f"step {step} trains on the next global batch")
            return None
        self.emit("loss_spike", **fields, next="update not applied; rolling back to the newest "
                  "checkpoint and skipping the spike's data window")
        # The spike's batch and the batches of the steps just before it.
        before = self.watch.starts[len(self.watch.starts) + 1 - self.settings.spike_skip_window:]
        self.rollback(step, "loss_spike", [*before, self.progress.consumed_samples])
        self.watch.cured_step = step  # the checkpoint's watch, loaded, knows nothing of it
        return None

    def why_applied(self, step: int, state_caused: bool) -> str:
        """The loss_spike event's `next` for a spike whose update is applied."""
        if not state_caused or self.settings.on_spike == SpikePolicy.warn:
            return f"update applied (on_spike={self.settings.on_spike.value})"
        if self.watch.cured_step == step:
            return (f"update applied: the spike came back at step {step} with another batch, so "
                    "the state (weights, optimizer state, learning rate), not a batch, causes "
                    "it; skipping more batches cannot cure it, no rollback spent")
        return ("update applied: it follows a spike the state caused, no rollback spent")

    def samples(self) -> list[int]:
        """The global samples of the step at hand: [first, end)."""
        first = self.progress.consumed_samples
        return [first, first + global_batch_at(self.cfg.train, first)]

    def skips_made(self) -> int:
        """Global batches skipped by rollbacks and spikes: those recorded,
        less those the recipe asks for."""
        return len(self.progress.skipped.keys() - configured_skips(self.cfg).keys())

    def rollback(self, step: int, reason: str, skip_starts: list[int]) -> None:
        """Back to the newest checkpoint (restart-from-latest's own choice of
        tier and step), with the global batches starting at `skip_starts`
        recorded as skipped (those after the checkpoint's position)."""
        skipped = dict(self.progress.skipped)
        with self.section("checkpoint", step):
            # The saves in flight are of earlier, checked steps: let them commit first.
            self.checkpointing.wait()
            with self.progress.changing():  # a failure mid-load leaves no step's state
                loaded = self.checkpointing.resume()
            if loaded is None:
                raise PersistentNumericalFault(
                    f"step {step} needs a rollback ({reason}) and there is no checkpoint to roll "
                    "back to: stopping. Fix: save checkpoints (checkpoint.interval) so that a "
                    "rollback has somewhere to go")
        # Each the batch at its start: the batch a ramp trains there.
        new = {first: global_batch_at(self.cfg.train, first) for first in skip_starts
               if first >= self.progress.consumed_samples}
        # The checkpoint's record of skips, and these (not yet saved anywhere).
        self.progress.skipped = {**self.progress.skipped, **skipped, **new}
        self.rollbacks += 1
        counts = (dict(rollback=self.skips_made(), max_rollbacks=self.settings.max_rollbacks)
                  if new else {})
        self.emit("rolled_back", step=step, to_step=self.progress.step, reason=reason, **counts,
                  next=f"training again from step {self.progress.step + 1}")
        for first in sorted(new):
            self.emit("samples_skipped", step=step, samples=[first, first + new[first]],
                      next="the sampler passes over them")
