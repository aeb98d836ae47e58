"""A discrete-event simulator of a long run: steps, saves at an interval
(blocking, then durable `total_s` after they start), failures from a seeded
Poisson process per kind (each kind mapped to a recovery path) and/or a trace
of faults at given steps. A failure costs its path's downtime (a failure
during the downtime starts the recovery over) and the work since the newest
save durable at the failure. Deterministic for a seed."""
# mypy: ignore-errors
from __future__ import annotations

import random
from collections import Counter
from dataclasses import dataclass, field

# Trace entries that are not failures: a slow rank until the next restart,
# and a corrupted newest checkpoint that the next recovery must skip.
SLOW, CORRUPT = "slow", "corrupt"


@dataclass
class Setup:
    steps: int  # steps of useful work to finish
    step_s: float
    interval: int  # steps between saves
    blocking_s: float  # the step loop's stall per save
    total_s: float  # a save's start to durable
    restart_s: dict[str, float]  # downtime per recovery path
    startup_s: float = 0.0
    # Paths that begin with a synchronous save: a preemption saves, then exits.
    saving_paths: set[str] = field(default_factory=set)
    # Paths that resume at the step reached (a live replacement takes the
    # state from a peer's memory), not at the newest durable save.
    live_paths: set[str] = field(default_factory=set)


@dataclass
class Kind:
    name: str
    per_s: float  # the job's rate of this kind of failure
    path: str  # its recovery path, a key of Setup.restart_s
    scope: str = "job"  # what it takes out: process | node | job (recovery.py)


@dataclass
class TraceFault:
    step: int  # fires when the run first starts this step
    path: str  # a recovery path, SLOW or CORRUPT
    seconds: float = 0.0  # a slow rank's extra seconds per step


@dataclass
class Result:
    wall_s: float
    productive_s: float
    lost_s: dict[str, float]  # by cause: startup, checkpoint, recompute, slow, restart:<path>
    failures: dict[str, int] = field(default_factory=dict)  # by kind (or path, for a trace)

    @property
    def goodput(self) -> float:
        return self.productive_s / self.wall_s

    def to_dict(self) -> dict:
        return {"wall_s": self.wall_s, "productive_s": self.productive_s,
                "goodput": self.goodput, "lost_s": dict(self.lost_s),
                "failures": dict(self.failures)}


class Run:
    """The simulated run's state; `simulate` drives it."""

    def __init__(self, setup: Setup, kinds: list[Kind], seed: int):
        self.s, self.kinds, self.rng = setup, [k for k in kinds if k.per_s > 0], random.Random(seed)
        self.rate = sum(k.per_s for k in self.kinds)
        self.t, self.done, self.high, self.slow, self.corrupt = setup.startup_s, 0, 0, 0.0, False
        self.saves: list[tuple[int, float]] = []  # (step, durable at)
        self.lost, self.failures = Counter(startup=setup.startup_s), Counter()
        self.next_failure = self.draw_after(self.t)

    def draw_after(self, t: float) -> float:
        return t + self.rng.expovariate(self.rate) if self.rate else float("inf")

    def draw_kind(self) -> Kind:
        return self.rng.choices(self.kinds, weights=[k.per_s for k in self.kinds])[0]

    def advance(self, n: int) -> None:
        """Run n steps: new ones are productive, the rest recomputed."""
        fresh = max(0, self.done + n - max(self.done, self.high))
        self.lost["recompute"] += (n - fresh) * self.s.step_s
        self.lost["slow"] += n * self.slow
        self.t += n * (self.s.step_s + self.slow)
        self.done += n
        self.high = max(self.high, self.done)

    def save(self) -> None:
        started = self.t
        self.t += self.s.blocking_s
        self.lost["checkpoint"] += self.s.blocking_s
        self.saves.append((self.done, started + self.s.total_s))

    def fail(self, path: str, failed_at: float) -> None:
        """Recover from a failure at `failed_at` (= self.t): downtime, failures
        during it starting the recovery over, then back to the newest save
        that was durable when it struck (unless every failure of the chain
        was recovered live: then at the step reached)."""
        live = path in self.s.live_paths
        if path in self.s.saving_paths:
            self.t += self.s.total_s
            self.lost["checkpoint"] += self.s.total_s
            self.saves.append((self.done, self.t))
            failed_at = self.t
        while True:
            end = self.t + self.s.restart_s[path]
            if self.next_failure >= end:
                self.lost[f"restart:{path}"] += end - self.t
                self.t = end
                break
            self.lost[f"restart:{path}"] += self.next_failure - self.t
            self.t = self.next_failure
            kind = self.draw_kind()
            self.failures[kind.name] += 1
            path = kind.path
            live = live and path in self.s.live_paths
            self.next_failure = self.draw_after(self.t)
        self.slow = 0.0
        if live:
            return
        durable = [s for s in self.saves if s[1] <= failed_at]
        if self.corrupt and durable:
            durable.pop()
        self.corrupt = False
        self.saves = durable
        self.done = durable[-1][0] if durable else 0


def simulate(setup: Setup, kinds: list[Kind] = (), trace: list[TraceFault] = (),
             seed: int = 0) -> Result:
    # Stable in step order: faults at one step keep the order they were given in.
    run, pending = Run(setup, list(kinds), seed), sorted(trace, key=lambda f: f.step)
    while run.done < setup.steps:
        boundary = min(setup.steps, (run.done // setup.interval + 1) * setup.interval)
        step_s = setup.step_s + run.slow
        fault = pending[0] if pending and pending[0].step <= boundary else None
        fault_at = run.t + (fault.step - 1 - run.done) * step_s if fault else float("inf")
        if fault and fault_at <= run.next_failure:
            pending.pop(0)
            run.advance(max(0, fault.step - 1 - run.done))
            if fault.path == SLOW:
                run.slow += fault.seconds
            elif fault.path == CORRUPT:
                run.corrupt = True
            else:
                run.failures[fault.path] += 1
                run.fail(fault.path, run.t)
        elif run.next_failure < run.t + (boundary - run.done) * step_s:
            failed_at = run.next_failure
            run.advance(int((failed_at - run.t) / step_s))
            run.lost["recompute"] += failed_at - run.t  # the step it broke
            run.t = failed_at
            kind = run.draw_kind()
            run.failures[kind.name] += 1
            run.next_failure = run.draw_after(run.t)
            run.fail(kind.path, failed_at)
        else:
            run.advance(boundary - run.done)
            if boundary % setup.interval == 0 and boundary < setup.steps:
                run.save()
    return Result(wall_s=run.t, productive_s=setup.steps * setup.step_s,
                  lost_s=dict(run.lost), failures=dict(run.failures))
