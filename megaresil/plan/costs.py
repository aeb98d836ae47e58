"""What a run directory says its resilience costs: step time, the blocking and
total seconds of a save per tier, and each outage (a restart or preemption
between two completed steps) with its kind, downtime and recomputed steps."""
from __future__ import annotations

import statistics
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Optional

from megaresil.run_records import (
    COUNT,
    COUNT_OR_NULL,
    FINITE,
    LIST,
    NON_NEGATIVE,
    POSITIVE,
    STEP,
    STEP_RECORD,
    Kind,
    Shape,
    events_of,
    metrics_of,
    one_of,
    step_seconds,
)

# An outage's kind is its costliest recovery: a preemption requeues the whole
# job, a relaunch restarts every worker, a live replacement starts one process
# (the others restart in theirs), an in-process restart keeps them all.
SEVERITY = ("in_process", "replace", "relaunch", "requeue")


@dataclass
class SaveCost:
    tier: str  # global | local
    saves: int
    blocking_s: float  # median seconds the step loop waits per save
    total_s: float  # median seconds until the save is durable
    bytes: int  # bytes per save (all ranks)
    ranks: int = 1  # ranks that wrote them


@dataclass
class Outage:
    kind: str  # in_process | replace | relaunch | requeue
    downtime_s: float  # end of the last step before it to the start of the first step after
    steps_lost: int  # steps done before it and computed again after


@dataclass
class Recovery:
    """The outages of one kind a run measured, averaged."""
    kind: str
    count: int
    downtime_s: float  # mean, as Outage.downtime_s
    steps_lost: float  # mean steps computed again


@dataclass
class RunCosts:
    step_s: float
    steps: int  # the last step reached
    interval: Optional[int]  # steps between global saves, as the saves show
    saves: dict[str, SaveCost] = field(default_factory=dict)
    outages: list[Outage] = field(default_factory=list)
    # Launch to the start of the first step's compute: what a relaunch costs
    # at least (new processes, imports, rendezvous, build), measured on every run.
    startup_s: Optional[float] = None

    def recoveries(self) -> dict[str, Recovery]:
        """The measured outages by kind, in SEVERITY order."""
        found = {}
        for kind in SEVERITY:
            seen = [o for o in self.outages if o.kind == kind]
            if seen:
                found[kind] = Recovery(kind, len(seen),
                                       statistics.fmean(o.downtime_s for o in seen),
                                       statistics.fmean(o.steps_lost for o in seen))
        return found

    def restart_s(self) -> dict[str, float]:
        """Mean downtime per outage kind: the expected cost the planner needs."""
        return {k: r.downtime_s for k, r in self.recoveries().items()}

    def to_dict(self) -> dict:
        return {**asdict(self), "restart_s": self.restart_s()}

    @classmethod
    def from_dict(cls, d: dict) -> "RunCosts":
        """The costs `to_dict` wrote; ValueError naming what is malformed."""
        problem = costs_problem(d)
        if problem:
            raise ValueError(f"its costs {problem}")
        return cls(step_s=d["step_s"], steps=d["steps"], interval=d["interval"],
                   saves={t: SaveCost(**s) for t, s in d["saves"].items()},
                   outages=[Outage(**o) for o in d["outages"]],
                   startup_s=d.get("startup_s"))


# The costs as to_dict writes them (`megaresil plan --json` keeps them).
COSTS = Shape({"step_s": POSITIVE, "steps": COUNT, "interval": COUNT_OR_NULL,
               "saves": Kind("a map", lambda v: isinstance(v, dict)), "outages": LIST},
              {"startup_s": Kind("a finite number >= 0 or null",
                                 lambda v: v is None or NON_NEGATIVE.admits(v)),
               "restart_s": Kind("a map", lambda v: isinstance(v, dict))})
SAVE_COST = Shape({"tier": one_of("global", "local"), "saves": COUNT,
                   "blocking_s": NON_NEGATIVE, "total_s": NON_NEGATIVE, "bytes": NON_NEGATIVE},
                  {"ranks": STEP})
OUTAGE = Shape({"kind": one_of(*SEVERITY), "downtime_s": FINITE, "steps_lost": COUNT})


def costs_problem(d) -> Optional[str]:
    """What makes `d` other than the costs to_dict writes, or None."""
    parts = [("", d, COSTS)]
    if isinstance(d, dict) and COSTS.problem(d) is None:
        parts += [(f"saves[{tier!r}] ", save, SAVE_COST) for tier, save in d["saves"].items()]
        parts += [(f"outages[{i}] ", outage, OUTAGE) for i, outage in enumerate(d["outages"])]
    for where, part, shape in parts:
        problem = (shape.problem(part) or shape.unknown(part) if isinstance(part, dict)
                   else "is not a JSON object")
        if problem:
            return where + problem
    return None


def read_costs(run_dir: str | Path) -> RunCosts:
    run_dir = Path(run_dir)
    records = [r for r in metrics_of(run_dir, STEP_RECORD.needing("tokens")) if "loss" in r]
    if not records:
        raise ValueError(f"{run_dir}/metrics.jsonl has no step: run some steps first "
                         "(megaresil train ... run.dir={run_dir})")
    events = events_of(run_dir)
    saves = {tier: save_cost(tier, events, name) for tier, name in
             (("global", "checkpoint_saved"), ("local", "local_checkpoint_saved"))}
    global_steps = sorted({e["step"] for e in events if e["event"] == "checkpoint_saved"})
    # The commonest gap: preemption saves and restarts add odd ones.
    gaps = [b - a for a, b in zip(global_steps, global_steps[1:]) if b > a]
    # The mean: the expected step time, slow steps after restarts included.
    return RunCosts(step_s=statistics.fmean(step_seconds(r) for r in records),
                    steps=max(r["step"] for r in records),
                    interval=statistics.mode(gaps) if gaps else None,
                    saves={t: s for t, s in saves.items() if s is not None},
                    outages=outages(records, events),
                    startup_s=startup_seconds(records, events))


def startup_seconds(records: list[dict], events: list[dict]) -> Optional[float]:
    """The first launch's start-up: its processes' creation to the start of
    the first step's compute (None when the run recorded no launch time)."""
    launched = [e["launched_at"] for e in events if e["event"] == "generation_started"]
    if not launched:
        return None
    first = min(records, key=lambda r: r["time"])
    return max(0.0, first["time"] - step_seconds(first) - min(launched))


def save_cost(tier: str, events: list[dict], name: str) -> Optional[SaveCost]:
    saved = [e for e in events if e["event"] == name and e.get("rank", 0) == 0]
    if not saved:
        return None
    return SaveCost(tier=tier, saves=len(saved),
                    blocking_s=statistics.median(e["blocking_seconds"] for e in saved),
                    total_s=statistics.median(e["seconds"] for e in saved),
                    bytes=int(statistics.median(e["bytes"] for e in saved)),
                    ranks=len(saved[-1].get("bytes_per_rank") or [0]))


def outages(records: list[dict], events: list[dict]) -> list[Outage]:
    """One per pair of consecutive step records with a restart or preemption
    between them (faults on the way to recovery fold into the same outage)."""
    found = []
    triggers = [e for e in events if e["event"] in ("restart", "preempted")]
    for before, after in zip(records, records[1:]):
        inside = [e for e in triggers if before["time"] < e["time"] < after["time"]]
        if not inside:
            continue
        kinds = ["requeue" if e["event"] == "preempted" else e["kind"] for e in inside]
        found.append(Outage(kind=max(kinds, key=SEVERITY.index),
                            downtime_s=after["time"] - step_seconds(after) - before["time"],
                            steps_lost=max(0, before["step"] - (after["step"] - 1))))
    return found
