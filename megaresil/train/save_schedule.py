"""When the training loop saves a global checkpoint (checkpoint.interval):
every N steps, never (0), or auto: after one measuring save (none on a
resume: the run's records hold the cost), Young/Daly's sqrt(2 x save x
MTBF), capped by checkpoint.max_minutes_at_risk and by a quarter of the run,
and chosen again when a cost moves by more than 2x. train.exit_at_step
always saves; except with 0, so does the last step. A batch ramp's step is
measured as a full-batch step (`full_batch_seconds`): its steps save sooner.

Every rank must save at the same steps: the costs are the slowest rank's
(an all-reduce MAX), combined at steps every rank knows. A generation that
takes its state from the ranks' memory (live replacement) may start past a
save the failure interrupted: `missed` says so, and the loop makes it at once.
docs/checkpoints.md ("When checkpoints are saved", "When auto saves") has
the details.
"""
from __future__ import annotations

import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch
import torch.distributed as dist

from megaresil.config import RecipeConfig
from megaresil.events import read_events
from megaresil.plan.model import young_interval
from megaresil.plan.profile import DEFAULT_PROFILE, job_kinds, load_profile, mtbf_hours

RECHECK_STEPS = 50  # how often the measured step time is compared with the decision's
MOVED = 2.0  # a cost this many times larger or smaller than decided on: decide again
# At most 1/RUN_PARTS of train.steps between saves: Young/Daly's optimum is
# for long runs (a 30-step run was told "every 35 steps", so a crash near its
# end lost it all); a short run then loses at most a quarter of itself to a
# crash, for at most RUN_PARTS saves more than its last.
RUN_PARTS = 4


def longest_interval(run_steps: int) -> int:
    """The most steps auto puts between saves in a run of `run_steps`."""
    return max(1, run_steps // RUN_PARTS)


def job_mtbf_hours(cfg: RecipeConfig) -> float:
    """resilience.mtbf_hours, or the planner's cluster profile scaled to this job's GPUs."""
    if cfg.resilience.mtbf_hours:
        return cfg.resilience.mtbf_hours
    return mtbf_hours(job_kinds(load_profile(), cfg.parallel.world_size))


def mtbf_source(cfg: RecipeConfig) -> str:
    """Where job_mtbf_hours came from, as the interval's line names it: a
    figure of a 16k-GPU fleet is not a measure of this cluster."""
    if cfg.resilience.mtbf_hours:
        return "resilience.mtbf_hours"
    seen = load_profile()["observed"]
    return (f"the {DEFAULT_PROFILE.stem} profile's failures on {seen['gpus']:,} GPUs over "
            f"{seen['days']} days, scaled to {plural(cfg.parallel.world_size, 'rank')}; set "
            "resilience.mtbf_hours for your cluster")


def plural(count: int, noun: str) -> str:
    """A count and its noun, as the console's lines say it: "1 step", "7 steps"."""
    return f"{count} {noun}{'' if count == 1 else 's'}"


def recorded_save_s(run_dir: Path) -> Optional[float]:
    """What a save cost when the run last chose its interval (its newest
    `checkpoint_interval` event), or None when it never did."""
    chosen = [e for e in read_events(run_dir) if e["event"] == "checkpoint_interval"]
    return chosen[-1]["save_s"] if chosen else None


def never_saving_warning(cfg: RecipeConfig) -> Optional[str]:
    """The start-up line for checkpoint.interval=0."""
    if cfg.checkpoint.interval != 0:
        return None
    return ("megaresil: warning: checkpoint.interval=0: no checkpoint is saved, not even at "
            "the last step (only at train.exit_at_step, a preemption or Ctrl-C); a lost process "
            "loses all its work. Fix: leave checkpoint.interval at auto, or give N steps.")


def full_batch_seconds(seconds: float, global_batch: int, full_batch: int) -> float:
    """A step's time had it trained the full batch: linear in the samples.
    A step's fixed costs scale up with it, so a ramp's step is over- rather
    than underestimated (saves come sooner, never later)."""
    return seconds * full_batch / global_batch


@dataclass(frozen=True)
class Decision:
    """An auto interval, the measurements it was chosen from and why."""
    steps: int
    save_s: float
    step_s: float
    mtbf_h: float
    mtbf_from: str
    why: str = "Young/Daly"

    @classmethod
    def choose(cls, save_s: float, step_s: float, mtbf_h: float, max_minutes: float,
               run_steps: int, mtbf_from: str = "resilience.mtbf_hours") -> "Decision":
        seconds = young_interval(save_s, mtbf_h * 3600)
        why = "Young/Daly"
        if seconds > max_minutes * 60:
            seconds, why = max_minutes * 60, "capped at checkpoint.max_minutes_at_risk"
        steps = max(1, int(seconds / max(step_s, 1e-9)))
        if steps > longest_interval(run_steps):
            steps, why = longest_interval(run_steps), "capped at a quarter of train.steps"
        return cls(steps, save_s, step_s, mtbf_h, mtbf_from, why)

    @property
    def capped(self) -> bool:
        return self.why != "Young/Daly"

    def moved(self, save_s: float, step_s: float) -> bool:
        return any(new > MOVED * old or old > MOVED * new
                   for new, old in ((save_s, self.save_s), (step_s, self.step_s)))

    def line(self) -> str:
        minutes = self.steps * self.step_s / 60
        return (f"checkpoint every {plural(self.steps, 'step')} (~{minutes:.1f} min): save "
                f"{self.save_s:.1f} s, step {self.step_s:.2f} s, MTBF {self.mtbf_h:.1f} h "
                f"({self.mtbf_from}), {self.why}")

    def fields(self) -> dict:
        return {"interval_steps": self.steps, "save_s": self.save_s, "step_s": self.step_s,
                "mtbf_hours": self.mtbf_h, "mtbf_from": self.mtbf_from, "capped": self.capped,
                "why": self.why}


def slowest_rank(*values: float) -> list[float]:
    """The largest of each value over all ranks (a collective on the world group)."""
    t = torch.tensor(values, dtype=torch.float64)
    if dist.is_initialized():
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.tolist()


class SaveSchedule:
    """Which steps are saved; told each step's time and each save's cost."""

    def __init__(self, cfg: RecipeConfig, start_step: int, *, events, rank: int,
                 last_saved: Optional[int] = None):
        """`last_saved`: the step of the newest global checkpoint, where it
        is older than `start_step` (a state from the ranks' memory)."""
        self.cfg, self.events, self.rank = cfg, events, rank
        self.interval = cfg.checkpoint.interval
        self.last_saved = start_step if last_saved is None else last_saved
        self.last_check = start_step
        # Decided after the calibration steps (a process's first steps carry
        # warm-up costs), by a measuring save there unless the cost is known.
        calibration = max(1, cfg.resilience.watchdog.calibration_steps)
        self.measure_at = start_step + calibration + 1 if self.interval == "auto" else None
        self.step_times: list[float] = []
        self.save_s = self._known_save_s(start_step)
        self.decision: Optional[Decision] = None

    def _known_save_s(self, start_step: int) -> Optional[float]:
        """On a resume, the save cost the run's records hold: no measuring
        save at every resume (the next save checks it). Every rank must
        agree whether there is one, so the largest over ranks is taken."""
        if self.interval != "auto" or start_step == 0:
            return None
        recorded = recorded_save_s(Path(self.cfg.run.dir))
        known = slowest_rank(-1.0 if recorded is None else recorded)[0]
        return known if known >= 0 else None

    def due(self, step: int) -> bool:
        t = self.cfg.train
        if step == t.exit_at_step:
            return True
        if self.interval == 0:
            return False
        if step == t.steps:
            return True
        if isinstance(self.interval, int):  # else "auto"
            return step % self.interval == 0
        if step == self.measure_at and self.decision is None:
            return True  # the measuring save
        return self.decision is not None and step - self.last_saved >= self.decision.steps

    def missed(self, step: int) -> bool:
        """Whether a save due at a step after the newest checkpoint, up to
        `step`, is missing: live replacement interrupted it (the ranks' memory
        went on from there). An auto interval's own steps are not known
        across generations: its measuring save comes within the watchdog's
        calibration steps."""
        t, after = self.cfg.train, self.last_saved
        if t.exit_at_step is not None and after < t.exit_at_step <= step:
            return True
        if self.interval == 0:
            return False
        if after < t.steps <= step:
            return True
        return isinstance(self.interval, int) and step // self.interval * self.interval > after

    def step_done(self, step: int, seconds: float, global_batch: int,
                  first_of_process: bool) -> None:
        """Each step's time (but a process's first: its warm-up) and the
        global batch it trained; a known save cost is decided on after the
        calibration steps; every RECHECK_STEPS steps an auto decision is
        checked against it."""
        if not first_of_process:
            full = full_batch_seconds(seconds, global_batch, self.cfg.train.global_batch_size)
            self.step_times = (self.step_times + [full])[-RECHECK_STEPS:]
        if self.decision is None and self.save_s is not None and step == self.measure_at:
            self._measure(step)
        elif self.decision is not None and step - self.last_check >= RECHECK_STEPS:
            self._measure(step)

    def saved(self, step: int, seconds: float) -> None:
        """A save at `step` held the loop for `seconds` on this rank."""
        self.last_saved, self.save_s = step, seconds
        if self.interval == "auto" and step < self.cfg.train.steps:
            self._measure(step)

    def _measure(self, step: int) -> None:
        """Combine this rank's costs over the world; decide when there is no
        decision yet or a cost moved by more than MOVED."""
        self.last_check = step
        step_s = statistics.median(self.step_times) if self.step_times else 0.0
        save_s, step_s = slowest_rank(self.save_s or 0.0, step_s)
        if step_s <= 0:
            return
        if self.decision is None or self.decision.moved(save_s, step_s):
            self.decision = Decision.choose(save_s, step_s, job_mtbf_hours(self.cfg),
                                            self.cfg.checkpoint.max_minutes_at_risk,
                                            self.cfg.train.steps, mtbf_source(self.cfg))
            if self.rank == 0:  # the launcher prints its line
                self.events.emit("checkpoint_interval", step=step, line=self.decision.line(),
                                 **self.decision.fields())
