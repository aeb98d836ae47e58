"""What a job reports to, and asks of, the resilience layer."""
from __future__ import annotations

import os
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Optional

import torch.distributed as dist

from megaresil.fencing import Fence
from megaresil.observe.sections import SectionClock, SectionTime
from megaresil.resilience.faults import FaultInjector
from megaresil.resilience.guardian import die_with_parent
from megaresil.resilience.preemption import PreemptionFlag
from megaresil.resilience.step_faults import StepFaults
from megaresil.resilience.watchdog.monitor import Watchdog
from megaresil.run_lock import launcher_pid
from megaresil.worker_env import WorkerEnv


def end_with_agent(env: WorkerEnv) -> None:
    """A worker of a TorchElastic agent ends when its agent does: a worker
    whose launcher was killed (kill -9, a lost terminal) would otherwise
    train on unsupervised, no hang detected, beside the job a rerun starts.
    Under megaresil's launcher the agent is the lock holder named in the
    environment; under a torchrun of the user's own (or as a Slurm task,
    whose environment says torchrun) it is the parent at start. Outside an
    agent (library use, tests) nothing changes."""
    if env.elastic_run_id is not None:
        die_with_parent(launcher_pid() or os.getppid())


@dataclass
class Supervision:
    """Heartbeats, fault hooks and the preemption flag for one generation.
    The default (all None) supervises nothing: library use and tests."""
    watchdog: Optional[Watchdog] = None
    faults: Optional[FaultInjector] = None
    preemption: Optional[PreemptionFlag] = None
    generation: int = 0  # restarts so far in this run directory
    fence: Optional[Fence] = None  # refuses this generation's writes once the job re-forms
    # Ranks on this rank's node, as its launcher says (None outside one): the
    # local checkpoint tier's nodes unless the recipe names them.
    local_world: Optional[int] = None
    # This rank's state from the generation before, when it lost a peer and
    # waited for its replacement (live replacement): the job's own hand_over.
    carried: Optional[object] = None
    steps: int = 0  # steps completed in this generation
    step: int = 0  # the step the current section belongs to
    last_step: int = 0  # the step number of the last step completed (0: none)
    clock: SectionClock = field(default_factory=SectionClock)
    step_times: dict[str, SectionTime] = field(default_factory=dict)  # the last step's

    @contextmanager
    def section(self, name: str, step: int):
        self.step = step
        if self.watchdog is None:
            with self.clock.measure(name):
                self._enter(name, step)
                yield
            return
        with self.watchdog.section(name, step), self.clock.measure(name):
            self._enter(name, step)
            yield

    def batch_share(self, share: float) -> None:
        """The coming step's global batch over the full one: the watchdog
        scales the budgets of the sections that follow the batch."""
        if self.watchdog is not None:
            self.watchdog.batch_share(share)

    def _enter(self, name: str, step: int) -> None:
        if self.faults is not None:
            self.faults.on_section(name, step)

    def step_faults(self, step: int, position: int) -> StepFaults:
        """The injected faults on this attempt's numbers (none without an injector)."""
        return self.faults.step_faults(step, position) if self.faults is not None else StepFaults()

    def step_done(self) -> None:
        self.steps += 1
        self.last_step = self.step
        self.step_times = self.clock.take()
        if self.watchdog is not None:
            self.watchdog.step_done(self.step_times, first_of_generation=self.steps == 1)

    def preempted(self, group: Optional[dist.ProcessGroup]) -> Optional[str]:
        """Whether any rank was signalled, and how ("preempted",
        "interrupted"): a collective on `group`, which must be a group of the
        calling thread (the training thread's own, never the checkpoint save
        thread's)."""
        return self.preemption.requested_anywhere(group) if self.preemption is not None else None
