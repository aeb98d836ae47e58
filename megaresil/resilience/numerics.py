"""Non-finite loss and gradients: the decisions, apart from the trainer.

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
from dataclasses import dataclass
from typing import Sequence


class PersistentNumericalFault(RuntimeError):
    """A step stayed non-finite and no rollback is left (or possible): the
    job stops on every rank (restart.FATAL), with this one-line reason."""


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


def rollback_refusal(step: int, made: int, limit: int) -> str | None:
    """Why a persistent fault at `step` stops the run instead of rolling
    back, `made` rollbacks into it; None while rollbacks are left."""
    if made < limit:
        return None
    return (f"step {step} is non-finite again on replay (a persistent fault) and the run has "
            f"made {made} rollback(s), resilience.numerics.max_rollbacks={limit}: stopping. "
            "Fix: look for the bad data or rank named in events.jsonl (nonfinite_detected, "
            "step_replayed), or raise resilience.numerics.max_rollbacks")
