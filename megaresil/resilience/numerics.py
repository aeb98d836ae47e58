"""Numerical faults: the decisions, apart from the trainer (train/numerics.py,
train/replicas.py): non-finite steps, loss spikes, replicas that differ.

A step's loss and global grad norm are checked before its update (the loss
rides in the grad norm's all-reduce, see train/optim.reduce_grad_norm). A
non-finite step is replayed once from the same samples and RNG state; what
each rank contributed to the two attempts (its own loss and squared grad
norm, before any reduction) tells a transient fault, with the ranks whose
recomputation differed, from a persistent one, which rolls the run back to
its newest checkpoint and skips the step's global batch (train/numerics.py
does the replay and the rollback).
"""
from __future__ import annotations

import math
import statistics
from collections import Counter
from dataclasses import dataclass, field
from typing import Hashable, Optional, Sequence

from megaresil.errors import MegaresilError


class PersistentNumericalFault(MegaresilError, RuntimeError):
    """A step stayed non-finite and no rollback is left (or possible): the
    job stops on every rank (fatal), with this one-line reason."""

    fatal = True


@dataclass(frozen=True)
class Figures:
    """One rank's own part of one attempt of a step: its loss (zero on
    pipeline stages that do not compute it) and the squared norm of the
    grads it counts, before any reduction."""
    loss: float
    norm_squared: float

    @property
    def finite(self) -> bool:
        return math.isfinite(self.loss) and math.isfinite(self.norm_squared)


def same_bits(a: float, b: float) -> bool:
    """Equal as recomputations go: the same value, NaN included."""
    return a == b or (math.isnan(a) and math.isnan(b))


def nonfinite_ranks(figures: Sequence[Figures]) -> list[int]:
    """The ranks (indices into `figures`) whose own contribution was non-finite."""
    return [rank for rank, f in enumerate(figures) if not f.finite]


def differing_ranks(first: Sequence[Figures], second: Sequence[Figures]) -> list[int]:
    """The ranks whose two attempts of a step differ: a deterministic
    recomputation gives the same bits, so these ranks computed one wrong."""
    return [rank for rank, (a, b) in enumerate(zip(first, second))
            if not (same_bits(a.loss, b.loss) and same_bits(a.norm_squared, b.norm_squared))]


def what_is_nonfinite(figures: Sequence[Figures]) -> str:
    """Which of the step's figures some rank's own contribution made
    non-finite: "loss", "grad_norm" or both (each rank's own, before the
    reductions spread the NaN to every rank)."""
    bad = [name for name, values in (("loss", [f.loss for f in figures]),
                                     ("grad_norm", [f.norm_squared for f in figures]))
           if not all(math.isfinite(v) for v in values)]
    return " and ".join(bad) or "nothing"


def every_rank_alike(figures: Sequence[Figures]) -> bool:
    """Whether a non-finite step shows on every rank alike: each rank's own
    figures non-finite, and the loss non-finite on every rank that computes
    one or on none (then the gradient norm, which the data-parallel
    reduction shares, on all). A bad batch's samples or a bad rank make
    their own rank's loss non-finite and leave the others' finite."""
    losses = [f.loss for f in figures if f.loss != 0.0]  # 0: a stage without the loss
    nonfinite = sum(not math.isfinite(x) for x in losses)
    return all(not f.finite for f in figures) and nonfinite in (0, len(losses))


def rollback_refusal(step: int, made: int, limit: int,
                     figures: Sequence[Figures] = ()) -> str | None:
    """Why a persistent fault at `step` stops the run instead of rolling
    back, `made` rollbacks into it; None while rollbacks are left.
    `figures`: every rank's own figures of the step's replay: when they
    show every rank alike and earlier rollbacks skipped other batches in
    vain, the fault is the training's own (a divergence), and the fix is
    the learning rate, not the data or a rank."""
    if made < limit:
        return None
    where = (f"step {step} is non-finite again on replay (a persistent fault) and the run has "
             f"made {made} rollback(s), resilience.numerics.max_rollbacks={limit}: stopping.")
    if made and figures and every_rank_alike(figures):
        return (f"{where} Every rank's own figures are non-finite alike and skipping {made} "
                "other batch(es) did not cure it: the training itself diverges (its learning "
                "rate or optimizer state), not one bad batch or rank. Fix: lower optimizer.lr "
                "(or raise optimizer.warmup_steps, lower optimizer.grad_clip) and train again "
                "from a checkpoint before the divergence (checkpoint.allow_recipe_change="
                "[optimizer.lr])")
    return (f"{where} Fix: look for the bad data or rank named in events.jsonl "
            "(nonfinite_detected, step_replayed), or raise resilience.numerics.max_rollbacks")


# --- loss spikes -------------------------------------------------------------------

# A robust deviation is the larger of two estimates of a normal sigma from
# the window's absolute deviations from its median: 1.4826 x their median
# (the MAD, blind to outliers) and sqrt(pi / 2) x their mean. The MAD alone
# collapses in a small window where a few losses happen to coincide (3 of 5
# within 0.005 made a healthy demo run's step 249 a 6.2-deviation "spike"),
# the mean does not. And it is at least this fraction of the median: a
# window of near-equal losses must not make every wobble a spike.
MAD_TO_SIGMA = 1.4826
MEAN_ABSOLUTE_TO_SIGMA = math.sqrt(math.pi / 2)
MIN_RELATIVE_DEVIATION = 0.01


@dataclass(frozen=True)
class Spike:
    loss: float
    median: float
    deviation: float  # the robust deviation the threshold multiplies

    @property
    def deviations(self) -> float:
        return (self.loss - self.median) / self.deviation


def find_spike(loss: float, window: Sequence[float], size: int,
               threshold: float) -> Optional[Spike]:
    """`loss` as a spike against the last `size` losses of `window` (None
    while fewer are known): more than `threshold` robust deviations above
    their median. Only upward: a loss that falls fast is no fault."""
    recent = list(window)[-size:]
    if len(recent) < size:
        return None
    median = statistics.median(recent)
    apart = [abs(x - median) for x in recent]
    deviation = max(MAD_TO_SIGMA * statistics.median(apart),
                    MEAN_ABSOLUTE_TO_SIGMA * statistics.fmean(apart),
                    MIN_RELATIVE_DEVIATION * abs(median))
    spike = Spike(loss, median, deviation)
    return spike if spike.deviations > threshold else None


def skip_refusal(step: int, made: int, limit: int, what: str) -> str | None:
    """Why `what` at `step` (a spike to skip) stops the run, `made` skips
    into it; None while skips are left (they share max_rollbacks)."""
    if made < limit:
        return None
    return (f"{what} at step {step} and the run has skipped {made} global batch(es), "
            f"resilience.numerics.max_rollbacks={limit}: stopping. Fix: look at the data of the "
            "samples named in events.jsonl (loss_spike, samples_skipped), raise "
            "resilience.numerics.max_rollbacks, or set resilience.numerics.on_spike=warn")


@dataclass
class LossWatch:
    """What the spike detector and a spike's rollback read besides the
    recipe. It lives in the trainer's Progress, so that every checkpoint
    saves it and live replacement carries it (train/state.py): a resumed or
    replaced run decides as the uninterrupted one would.

    A spike whose batch was skipped (on_spike=skip or rollback) and that
    comes back at the same step with another batch is caused by the state
    (weights, optimizer state, learning rate), not by a batch: skipping more
    batches cannot cure it, so it is applied, as under warn, and so are the
    spikes that follow it in a row. `level_shift` spikes applied in a row
    are a new level, not a spike: the window restarts from their losses."""
    losses: list[float] = field(default_factory=list)  # the window; spikes left out
    starts: list[int] = field(default_factory=list)  # the last applied steps' first samples
    streak: list[float] = field(default_factory=list)  # spikes applied in a row, up to now
    cured_step: Optional[int] = None  # the step whose spike's batch was skipped last

    def state_caused(self, step: int) -> bool:
        """A spike at `step` is the state's: it came back after its batch was
        skipped, or it follows a spike that was applied."""
        return bool(self.streak) or self.cured_step == step

    def applied(self, step: int, first_sample: int, loss: float, spike: bool,
                sizes: "WatchSizes") -> bool:
        """Record an applied step; True when its spike completes a level
        shift (the window then restarts from the streak's losses)."""
        self.starts = (self.starts + [first_sample])[-sizes.skip_window:]
        if self.cured_step is not None and step >= self.cured_step:
            self.cured_step = None  # the run got past the step it skipped a batch of
        if not math.isfinite(loss):
            return False
        if not spike:
            self.streak = []  # the loss came back: those were spikes, not a new level
            self.losses = (self.losses + [loss])[-sizes.window:]
            return False
        self.streak = self.streak + [loss]
        if len(self.streak) < sizes.level_shift:
            return False
        self.losses, self.streak = self.streak[-sizes.window:], []
        return True


@dataclass(frozen=True)
class WatchSizes:
    """resilience.numerics' sizes a LossWatch keeps to."""
    window: int  # spike_window
    skip_window: int  # spike_skip_window
    level_shift: int  # spike_level_shift


# --- replicas that differ (silent data corruption) ----------------------------------

def odd_ones_out(digests: Sequence[Hashable]) -> Optional[list[int]]:
    """The replicas (indices) whose digest differs from the one most of them
    hold; [] when all agree. Two replicas that agree bit for bit are taken
    as healthy (two corruptions do not land on the same state), so at dp >= 3
    a unique most common digest held by two or more wins. None when no
    digest wins (dp = 2, or a tie): only a replay can tell then."""
    ranked = Counter(digests).most_common()
    common, n = ranked[0]
    if n == len(digests):
        return []
    if n < 2 or (len(ranked) > 1 and ranked[1][1] == n):
        return None
    return [i for i, d in enumerate(digests) if d != common]
