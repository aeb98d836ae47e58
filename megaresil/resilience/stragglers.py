"""Straggler detection: which rank is slow, and where.

Every `logging.straggler_interval` steps the ranks all-gather their window's
section times (training-thread CPU and wall) and peak memory; rank 0 compares
each rank with the median of its pipeline stage's ranks, on CPU time, writes
the window to run.dir/stragglers.jsonl and, after `straggler_windows` slow
windows in a row, a `straggler_detected` event. Nothing is aborted.
docs/fault-tolerance-stragglers.md says who is compared with whom, and why."""
from __future__ import annotations

import json
import statistics
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from megaresil.config import LoggingConfig
from megaresil.events import EventLog
from megaresil.observe.memory import peak_memory_mb
from megaresil.observe.sections import SectionTime
from megaresil.parallel.mesh import MeshShape
from megaresil.safe_files import open_nofollow

MIN_EXCESS_S = 0.005  # per step: below this a section's difference is noise, not a straggler
# A rank blocked in a collective still spends CPU there (gloo polls): 2.6 % of a 0.31 s wait
# in a CI run, which at dp=2 put the waiting rank 1.5x over its peer. An excess under this
# share of the rank's own wait in the section is the wait's cost, not a slow rank.
WAIT_CPU_SHARE = 0.1
SKIPPED = ("setup",)
# Uneven by design (rank 0 commits, replicas split the writes): shown, never a straggler.
UNEVEN = ("checkpoint",)


@dataclass
class Window:
    steps: int = 0
    first: int = 0
    times: dict[str, SectionTime] = field(default_factory=dict)

    def add(self, step: int, times: dict[str, SectionTime]) -> None:
        self.first = self.first or step
        self.steps += 1
        for name, spent in times.items():
            mine = self.times.setdefault(name, SectionTime())
            mine.wall_s += spent.wall_s
            mine.cpu_s += spent.cpu_s

    def per_step(self) -> dict:
        return {name: {k: v / self.steps for k, v in asdict(t).items()}
                for name, t in self.times.items() if name not in SKIPPED}


def this_device() -> torch.device:
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def peers(rank: int, world: int, pp: int) -> list[int]:
    """The ranks of `rank`'s pipeline stage (pp is the outermost mesh axis),
    itself included; just [rank] when it is alone in its stage. A table
    that does not split into `pp` stages is one stage."""
    stages = pp if pp and world % pp == 0 else 1
    shape = MeshShape((("pp", stages), ("stage", world // stages)))
    return shape.group_of(("stage",), shape.coords_of(rank))


def judge(table: list[dict], pp: int, threshold: float) -> dict:
    """Ratios to the peers' median per rank and section, relative scores and
    the (rank, section) pairs over the threshold, for one window."""
    world = len(table)
    ratios: dict[int, dict[str, float]] = {}
    scores: dict[int, float] = {}
    slow = []
    for rank, mine in enumerate(table):
        group = peers(rank, world, pp)
        ratios[rank] = {}
        if len(group) == 1:  # alone in its stage: nobody does the same work
            ratios[rank] = dict.fromkeys(mine["sections"], 1.0)
            scores[rank] = 1.0
            continue
        for section, spent in mine["sections"].items():
            median = statistics.median_low(
                table[r]["sections"].get(section, {}).get("cpu_s", 0.0) for r in group)
            ratio = spent["cpu_s"] / median if median > 0 else 1.0
            ratios[rank][section] = ratio
            waited = max(0.0, spent["wall_s"] - spent["cpu_s"])
            if (ratio >= threshold and section not in UNEVEN
                    and spent["cpu_s"] - median >= max(MIN_EXCESS_S, WAIT_CPU_SHARE * waited)):
                slow.append((rank, section, ratio))
        busy = [sum(s["cpu_s"] for s in table[r]["sections"].values()) for r in group]
        mine_busy = sum(s["cpu_s"] for s in mine["sections"].values())
        scores[rank] = min(1.0, statistics.median_low(busy) / mine_busy) if mine_busy else 1.0
    return {"ratios": ratios, "scores": scores, "slow": slow}


class StragglerDetector:
    def __init__(self, cfg: LoggingConfig, *, rank: int, run_dir: Path, events: EventLog,
                 pp: int = 1):
        self.cfg, self.rank, self.pp, self.events = cfg, rank, pp, events
        self.path = Path(run_dir) / "stragglers.jsonl"
        self.window = Window()
        self.streaks: dict[tuple[int, str], int] = {}

    def step_done(self, step: int, times: dict[str, SectionTime], *, warm_up: bool) -> None:
        """After each step on every rank (the same steps everywhere): steps
        with one-off warm-up costs are left out of the window."""
        if not self.cfg.straggler_interval:
            return
        if not warm_up:
            self.window.add(step, times)
        if step % self.cfg.straggler_interval == 0:
            self.exchange(step)

    def restart(self) -> None:
        self.window = Window()

    def exchange(self, step: int) -> None:
        mine = {"steps": self.window.steps, "first": self.window.first,
                "sections": self.window.per_step(),
                "mem_peak_mb": peak_memory_mb(this_device())}
        self.window = Window()
        table: list[Any] = [mine]  # all_gather_object fills it with every rank's
        if dist.is_initialized():
            table = [None] * dist.get_world_size()
            dist.all_gather_object(table, mine)
        if self.rank == 0 and all(t["steps"] for t in table):
            self.report(step, table)

    def report(self, step: int, table: list[dict]) -> None:
        found = judge(table, self.pp, self.cfg.straggler_threshold)
        window = [min(t["first"] for t in table), step]
        line = {"time": time.time(), "window": window, "steps": table[0]["steps"],
                "sections": {r: t["sections"] for r, t in enumerate(table)},
                "ratios": found["ratios"], "scores": found["scores"],
                "mem_peak_mb": {r: t["mem_peak_mb"] for r, t in enumerate(table)}}
        with open_nofollow(self.path) as f:
            f.write(json.dumps(line) + "\n")
        slow_now = {(r, s): ratio for r, s, ratio in found["slow"]}
        self.streaks = {key: self.streaks.get(key, 0) + 1 for key in slow_now}
        for (rank, section), streak in self.streaks.items():
            if streak == self.cfg.straggler_windows:
                self.events.emit("straggler_detected", rank=rank, section=section,
                                 ratio=round(slow_now[(rank, section)], 3), window=window,
                                 score=round(found["scores"][rank], 3))
