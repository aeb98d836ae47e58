"""What the loop does between two steps, decided from plain facts (`decide`):
compare the data-parallel replicas, evaluate, save to either tier, stop.
The loop gathers the facts and performs the actions in `AfterStep`'s order:
replicas (a rollback goes straight on to the next step), eval, the global
save, the local save, then the stop; a preemption stops after the global
save, without the local one."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from megaresil.config import TrainConfig

EXITED = "exited"  # the outcome at train.exit_at_step


@dataclass(frozen=True)
class StepFacts:
    """What is due after `step`, gathered in this order (the preemption's
    is a collective): the global tier's save, the local tier's, and how any
    rank was signalled ("preempted", "interrupted"), if it was."""
    step: int
    save_due: bool
    local_save_due: bool
    preempted: Optional[str]

    @property
    def about_to_save(self) -> bool:
        """Whether a save of either tier follows: the replicas it is made of
        are compared in full first."""
        return self.save_due or self.local_save_due or bool(self.preempted)


@dataclass(frozen=True)
class AfterStep:
    """The actions after a step, in the order the loop performs them."""
    check_replicas: bool
    evaluate: bool
    save: bool
    save_local: bool
    stop: Optional[str]  # the outcome the run ends with now, if it ends


def eval_due(step: int, train: TrainConfig) -> bool:
    """At train.eval_interval and at the last step, unless eval is off."""
    if train.eval_batches == 0:
        return False
    return step == train.steps or (train.eval_interval > 0 and step % train.eval_interval == 0)


def decide(facts: StepFacts, *, replicas_due: bool, train: TrainConfig) -> AfterStep:
    """The actions after `facts.step`; `replicas_due`: the replica check's
    own schedule, asked with `facts.about_to_save`."""
    evaluate = eval_due(facts.step, train)
    if facts.preempted:
        return AfterStep(replicas_due, evaluate, save=True, save_local=False,
                         stop=facts.preempted)
    return AfterStep(replicas_due, evaluate, save=facts.save_due, save_local=facts.local_save_due,
                     stop=EXITED if facts.step == train.exit_at_step else None)
