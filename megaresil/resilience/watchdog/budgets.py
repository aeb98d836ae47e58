"""Per-section budgets, calibrated from measured durations. Pure: it is told
the durations, it reads no clock and starts no thread.

A budget is `factor` x the slowest observed duration of a section (never
under `floor_s`; step 1's one-off warm-up costs are not observed), once
`calibration_steps` steps were seen; before that, `initial_timeout_s`. Setup
and checkpoint have budgets of their own; the checkpoint section is also
watched for silent peers from its calibrated budget (`silence_budget`). The hard limit, past which even a
computing rank is hung, is `slow_limit_factor` x the budget (an aborted rank
gets it to leave, setup's cut to SETUP_ABORT_S). A calibration holds only on
what it was measured on (world, workload, machine kind). The sections that
follow the step's global batch (BATCH_SECTIONS; a batch ramp's grows) keep a
full batch's durations and are budgeted for the step's (`batch_share`)."""
from __future__ import annotations

from megaresil.config import WatchdogConfig

# In setup, the hard limit is the setup budget (minutes: a first build, a
# large checkpoint's load), but the abort frees a rank loading for seconds at
# its next bytecode; one still there after this long waits in a process
# group's formation for a peer that left it (a store wait no abort ends: 300 s
# at the group's timeout, seen in a soak on nodes in namespaces).
SETUP_ABORT_S = 30.0
# The sections whose work is proportional to the step's global batch.
BATCH_SECTIONS = ("data", "forward_backward")


class Budgets:
    def __init__(self, cfg: WatchdogConfig, measured_on: dict):
        self.cfg = cfg
        self.measured_on = measured_on  # world size, the caller's workload, machine kind
        self.slowest: dict[str, float] = {}
        self.steps_seen = 0
        self.batch_share = 1.0  # the current step's global batch over the full one

    def observe(self, section: str, step: int, seconds: float) -> None:
        """A section of `step` took `seconds`."""
        if step > 1:  # step 1 carries one-off warm-up costs
            full = seconds / self._share(section)
            self.slowest[section] = max(self.slowest.get(section, 0.0), full)

    def step_done(self) -> None:
        self.steps_seen += 1

    def budget(self, section: str) -> float:
        if section == "setup":
            return self.cfg.setup_timeout_s
        if section == "checkpoint":
            return self.cfg.checkpoint_timeout_s
        return self._calibrated(section)

    def silence_budget(self, section: str) -> float:
        """From when a peer whose heartbeat stopped is a hang. The
        checkpoint's own budget is long because a slow filesystem is no
        hang; a peer killed or cut off during a save is one, and would
        otherwise hold the job for that whole budget."""
        if section == "checkpoint":
            return min(self.budget(section), self._calibrated(section))
        return self.budget(section)

    def _calibrated(self, section: str) -> float:
        if self.steps_seen < self.cfg.calibration_steps or section not in self.slowest:
            return self.cfg.initial_timeout_s
        return max(self.cfg.floor_s,
                   self.cfg.factor * self.slowest[section] * self._share(section))

    def _share(self, section: str) -> float:
        """What a section's duration is scaled by: the step's share of the
        full batch where its work follows the batch, else 1. A step's fixed
        costs scale with it, which leaves a ramp's budgets looser, not tighter."""
        return self.batch_share if section in BATCH_SECTIONS else 1.0

    def slow_limit(self, section: str) -> float:
        """Past this even a computing culprit is hung; the collective timeout."""
        return self.cfg.slow_limit_factor * self.budget(section)

    def abort_limit(self, section: str) -> float:
        """How long an aborted rank may take to leave `section` before it
        exits for a relaunch (SETUP_ABORT_S says why setup's is short)."""
        limit = self.slow_limit(section)
        return min(limit, SETUP_ABORT_S) if section == "setup" else limit

    def calibration(self) -> dict:
        """What a checkpoint keeps, so a restart does not calibrate from zero."""
        return {"slowest": dict(self.slowest), "steps_seen": self.steps_seen,
                "measured_on": self.measured_on}

    def restore(self, saved: dict) -> bool:
        """Take a checkpoint's calibration; False (nothing taken) when it was
        measured on another world, workload or machine: 8 ranks' budgets say
        nothing of 1 rank's step time."""
        if saved.get("measured_on") != self.measured_on:
            return False
        for name, seconds in saved.get("slowest", {}).items():
            self.slowest[name] = max(self.slowest.get(name, 0.0), seconds)
        self.steps_seen = max(self.steps_seen, saved.get("steps_seen", 0))
        return True


def what_differs(saved: dict, now: dict, prefix: str = "") -> str:
    """`world 1 -> 2, workload.layout ...`: where two measured_on records
    part, for a line a person reads (not the two whole records)."""
    parts = []
    for key in sorted(set(saved) | set(now)):
        old, new = saved.get(key), now.get(key)
        if old == new:
            continue
        if isinstance(old, dict) and isinstance(new, dict):
            parts.append(what_differs(old, new, f"{prefix}{key}."))
        else:
            parts.append(f"{prefix}{key} {old} -> {new}")
    return ", ".join(parts)

