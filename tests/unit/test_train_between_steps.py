"""The decisions between two steps (train/between_steps.py) against an oracle
transcribed from the loop's inline code before they had a module of their
own: for every combination of the facts, the same actions in the same order."""
import itertools
from typing import Optional

from megaresil.config import TrainConfig
from megaresil.train.between_steps import AfterStep, StepFacts, decide, eval_due

STEPS = 8


def oracle(step: int, saving: bool, saving_local: bool, stopping: Optional[str],
           replicas_due: bool, rolled_back: bool, t: TrainConfig) -> list[str]:
    """The actions of Trainer.run's body after a step, as it was written inline."""
    actions = []
    if replicas_due:
        actions.append("check_replicas")
        if rolled_back:
            return actions
    if t.eval_batches != 0 and (step == t.steps
                                or (t.eval_interval > 0 and step % t.eval_interval == 0)):
        actions.append("evaluate")
    if stopping:
        actions.append("save")
        actions.append(f"stop:{stopping}")
        return actions
    if saving:
        actions.append("save")
    if saving_local:
        actions.append("save_local")
    if step == t.exit_at_step:
        actions.append("stop:exited")
    return actions


def performed(after: AfterStep, rolled_back: bool) -> list[str]:
    """The actions the loop performs for `after`, in its order."""
    actions = []
    if after.check_replicas:
        actions.append("check_replicas")
        if rolled_back:
            return actions
    if after.evaluate:
        actions.append("evaluate")
    if after.save:
        actions.append("save")
    if after.save_local:
        actions.append("save_local")
    if after.stop:
        actions.append(f"stop:{after.stop}")
    return actions


def test_every_combination_of_facts_acts_as_the_inline_code_did():
    trains = [TrainConfig(steps=STEPS, eval_batches=batches, eval_interval=interval,
                          exit_at_step=exit_at)
              for batches, interval, exit_at in itertools.product((0, 2), (0, 3), (None, 4, STEPS))]
    for step, saving, saving_local, stopping, replicas_due, rolled_back, t in itertools.product(
            range(1, STEPS + 1), (False, True), (False, True), (None, "preempted", "interrupted"),
            (False, True), (False, True), trains):
        facts = StepFacts(step, saving, saving_local, stopping)
        after = decide(facts, replicas_due=replicas_due, train=t)
        assert performed(after, rolled_back) == oracle(
            step, saving, saving_local, stopping, replicas_due, rolled_back, t), (facts, t)


def test_the_replicas_are_compared_in_full_before_any_save():
    for saving, saving_local, stopping in itertools.product((False, True), (False, True),
                                                            (None, "preempted")):
        facts = StepFacts(5, saving, saving_local, stopping)
        assert facts.about_to_save == (saving or saving_local or stopping is not None)


def test_a_preemption_skips_the_local_save_and_stops_after_the_global_one():
    after = decide(StepFacts(3, save_due=False, local_save_due=True, preempted="preempted"),
                   replicas_due=False, train=TrainConfig(steps=STEPS, exit_at_step=3))
    assert (after.save, after.save_local, after.stop) == (True, False, "preempted")


def test_eval_runs_at_its_interval_and_at_the_last_step_unless_off():
    t = TrainConfig(steps=STEPS, eval_batches=1, eval_interval=3)
    assert [s for s in range(1, STEPS + 1) if eval_due(s, t)] == [3, 6, STEPS]
    assert not any(eval_due(s, TrainConfig(steps=STEPS, eval_batches=0, eval_interval=1))
                   for s in range(1, STEPS + 1))
