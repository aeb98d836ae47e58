"""The trainer's side of the checkpoint: its state as a
`checkpoint.state.TrainingState`.

The checkpoint sees the model chunks' parameters, the optimizer through
`AdamState` (any AdamW implementation used here), the data position, this
rank's RNG and the watchdog's calibration, and nothing else of the trainer.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, Iterable, Mapping, Optional, Sequence

import torch
import torch.nn as nn

from megaresil.checkpoint.keys import MOMENTS, WEIGHTS, moment_key
from megaresil.checkpoint.state import RunRecord, layout_record
from megaresil.config import RecipeConfig, to_dict
from megaresil.parallel.distributed_optimizer import RowShard
from megaresil.parallel.layout import ParallelLayout
from megaresil.parallel.random import capture_rng_state, restore_rng_state
from megaresil.resilience.numerics import LossWatch
from megaresil.train.optim import AdamState, like
from megaresil.train.progress import Progress

if TYPE_CHECKING:
    from megaresil.resilience.watchdog.monitor import Watchdog

# The RunRecord.extra field that carries the watchdog's calibration, so a
# restart does not recalibrate from zero.
WATCHDOG = "watchdog"
# The RunRecord.extra field of the global batches the run skipped after a
# persistent non-finite step: [[first sample, samples], ...].
SKIPPED = "skipped_batches"
# The RunRecord.extra fields of the spike detector's LossWatch: its loss
# window, the first samples of the last applied steps (a spike's rollback
# skips their batches), the spikes applied in a row up to the step, and the
# step whose spike's batch was skipped last.
LOSSES = "loss_window"
STARTS = "recent_batch_starts"
STREAK = "spike_streak"
CURED = "spike_skipped_at_step"


def configured_skips(cfg: RecipeConfig) -> dict[int, int]:
    """resilience.numerics.skip_batches, as Progress.skipped holds them."""
    return {int(first): int(n) for first, n in cfg.resilience.numerics.skip_batches}


def watch_record(watch: LossWatch) -> dict:
    """The LossWatch's RunRecord.extra fields (those with something to say)."""
    fields = {LOSSES: list(watch.losses), STARTS: list(watch.starts),
              STREAK: list(watch.streak), CURED: watch.cured_step}
    return {key: value for key, value in fields.items() if value not in ([], None)}


def watch_from(extra: Mapping) -> LossWatch:
    """The LossWatch a RunRecord.extra saved (empty where a field is missing:
    a checkpoint of an older version)."""
    cured = extra.get(CURED)
    return LossWatch(losses=[float(x) for x in extra.get(LOSSES, [])],
                     starts=[int(x) for x in extra.get(STARTS, [])],
                     streak=[float(x) for x in extra.get(STREAK, [])],
                     cured_step=None if cured is None else int(cured))


class LiveTrainingState:
    """One rank's training state (implements checkpoint.state.TrainingState).
    Holds the trainer's live objects: saving reads them, loading fills them."""

    def __init__(self, cfg: RecipeConfig, layout: ParallelLayout,
                 named_params: list[tuple[str, nn.Parameter]], optimizer, position: Progress,
                 watchdog: Optional[Watchdog] = None,
                 after_load: Optional[Callable[[], None]] = None,
                 named_buffers: Sequence[tuple[str, torch.Tensor]] = (),
                 param_shards: Optional[Mapping[int, RowShard]] = None):
        """`named_params`: what is saved under each key (under bf16, the fp32
        main copies); `after_load` runs once loaded tensors are in place (it
        copies main weights into a bf16 model); `named_buffers`: the state
        held outside the parameters (the expert biases); `param_shards`: under
        sharded data parallelism, each parameter's rows on this rank
        (parallel/fsdp.row_shards)."""
        self.cfg, self.layout, self.named_params = cfg, layout, named_params
        self.buffers = list(named_buffers)
        self.after_load = after_load
        self.model_config = cfg.model
        self.optimizer = AdamState(optimizer, param_shards)
        self.position = position  # step and consumed samples, updated by the loop
        self.watchdog = watchdog
        self.recipe = to_dict(cfg)  # once: converting the config takes ~0.1 s, saves are frequent

    def named_parameters(self) -> Iterable[tuple[str, nn.Parameter]]:
        return iter(self.named_params)

    def named_buffers(self) -> Iterable[tuple[str, torch.Tensor]]:
        return iter(self.buffers)

    def layout_record(self) -> dict:
        return layout_record(self.layout, self.optimizer.sharded)

    def run_record(self) -> RunRecord:
        extra: dict[str, Any] = ({WATCHDOG: self.watchdog.calibration()}
                                 if self.watchdog is not None else {})
        if self.position.skipped:
            extra[SKIPPED] = [[first, n] for first, n in sorted(self.position.skipped.items())]
        extra.update(watch_record(self.position.watch))
        return RunRecord(step=self.position.step, layout=self.layout_record(),
                        recipe=self.recipe, consumed_samples=self.position.consumed_samples,
                        optimizer_steps=self.optimizer.step_count(), extra=extra)

    def adopt(self, whole: Mapping[str, torch.Tensor]) -> None:
        """Take a previous generation's tensors of this rank (`whole`, by
        key: weights and moments, each whole) as this state's storage
        where they fit, instead of a load copying them in; what it does not
        take is loaded as ever. Not under the distributed optimizer: its
        row shards are views of the storage the parameters had at build."""
        if self.optimizer.sharded:
            return
        for key, param in self.named_params:
            self.optimizer.adopt(param, {m: whole.get(moment_key(m, key)) for m in MOMENTS})
            weight = whole.get(f"{WEIGHTS}{key}")
            if weight is not None and like(weight, param):
                param.data = weight

    def rng_state(self) -> dict:
        return capture_rng_state()

    def restore(self, saved: RunRecord) -> None:
        if self.after_load is not None:
            self.after_load()
        self.optimizer.set_step_count(saved.optimizer_steps)
        self.position.step = saved.step
        self.position.consumed_samples = saved.consumed_samples
        self.position.skipped = {**configured_skips(self.cfg),
                                 **{first: n for first, n in saved.extra.get(SKIPPED, [])}}
        self.position.watch = watch_from(saved.extra)
        if self.watchdog is not None and WATCHDOG in saved.extra:
            self.watchdog.restore_calibration(saved.extra[WATCHDOG])
        rng = saved.rank_state(self.layout_record(), self.layout.rank)
        if rng is not None:
            restore_rng_state(rng)
