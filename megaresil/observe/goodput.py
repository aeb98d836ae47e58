"""Goodput of a run directory, across all its restarts and requeues: where the
wall time went, computed from the run's own records (events.jsonl,
metrics.jsonl) into buckets that add up (productive, startup, restarts,
failed, recomputed, checkpoint, eval, idle, other), none negative.

goodput = productive / (wall - idle): a pause the user chose is not the run's
loss. docs/observability.md ("Goodput", and "How it works") defines each
bucket and how failures, intended stops and idle gaps are told apart.
"""
from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Optional

from megaresil.events import read_events, read_jsonl
from megaresil.run_records import step_seconds
from megaresil.safe_files import write_atomic

INTENDED_STOPS = ("run_finished", "exited", "preempted", "interrupted")
FAILURES = ("hang_detected", "worker_error", "restart")
BUCKETS = ("productive", "startup", "restarts", "failed", "recomputed", "checkpoint", "eval",
           "idle", "other")

# What the run is doing between two of its records. Training time is split
# at each step line; the other states' time goes to one bucket each.
TRAINING, STOPPED, STARTING, RESTARTING = "training", "stopped", "starting", "restarting"
BOOKED = {STOPPED: "idle", STARTING: "startup", RESTARTING: "restarts"}


def launched_at(events: list[dict], records: list[dict]) -> Optional[float]:
    starts = [e["launched_at"] for e in events if e["event"] == "generation_started"]
    if starts:
        return min(starts)
    return records[0]["time"] - step_seconds(records[0]) if records else None


def job_launches(events: list[dict]) -> list[float]:
    """When each job (each command, each requeue) was launched: its workers'
    generations, in-process and agent restarts included, share the time."""
    return sorted({e["launched_at"] for e in events
                   if e["event"] == "generation_started" and "launched_at" in e})


def marks(events: list[dict], records: list[dict]) -> list[tuple[float, str, Optional[int]]]:
    """(time, what, step) of everything that changes what the run is doing:
    a failure detected, an intended stop, a job's launch, a step line, a
    checkpoint saved (a run written before the `exited` event ended at
    train.exit_at_step with only that), in time order."""
    found: list[tuple[float, str, Optional[int]]] = [
        (e["time"], "failure", None) for e in events if e["event"] in FAILURES]
    found += [(e["time"], "stop", None) for e in events if e["event"] in INTENDED_STOPS]
    found += [(e["time"], "saved", e.get("step")) for e in events
              if e["event"] == "checkpoint_saved"]
    found += [(t, "launch", None) for t in job_launches(events)]
    found += [(r["time"], "step", i) for i, r in enumerate(records)]
    order = {"step": 0, "saved": 1, "stop": 2, "failure": 3, "launch": 4}  # at equal times
    return sorted(found, key=lambda m: (m[0], order[m[1]]))


class Ledger:
    """Walks a run's marks, booking the time since the last one to the
    bucket of what the run was doing (a state machine: training, stopped,
    starting, restarting)."""

    def __init__(self, start: float, records: list[dict], pauses: list[tuple[float, str, float]]):
        self.records, self.pauses = records, sorted(pauses)
        self.spent = dict.fromkeys(BUCKETS, 0.0)
        self.state, self.since, self.interruptions = STARTING, start, 0
        self.last_copy = {r["step"]: i for i, r in enumerate(records)}
        self.last_step: Optional[int] = None  # of the newest step line
        self.saved_at: Optional[float] = None  # when that step was saved, if it was

    def book(self, bucket: str, seconds: float) -> None:
        self.spent[bucket] += max(0.0, seconds)

    def training_until(self, t: float, step_s: float = 0.0) -> float:
        """Books training time since the last mark: `step_s` of it a step's
        own, the saves and evals that ended in it (as much of each as fits:
        an async save's wait at the next update is inside that step's own
        time); returns the rest, for `other` or a failure's `failed`."""
        left = max(0.0, t - self.since) - step_s
        for bucket, seconds in self.pauses_until(t):
            spent = min(seconds, max(0.0, left))
            self.book(bucket, spent)
            left -= spent
        return left

    def pauses_until(self, t: float) -> list[tuple[str, float]]:
        """The saves and evals that ended since the last mark, until t."""
        found = []
        while self.pauses and self.pauses[0][0] <= t:
            _, bucket, seconds = self.pauses.pop(0)
            found.append((bucket, seconds))
        return found

    def move(self, state: str, t: float, booked: Optional[str] = None) -> None:
        """Ends what the run was doing at t. Out of training, the time goes
        to one bucket, the saves and evals in it included."""
        if self.state != TRAINING:
            self.book(booked or BOOKED[self.state], t - self.since)
            self.pauses_until(t)
        self.state, self.since = state, t

    def mark(self, t: float, what: str, number: Optional[int]) -> None:
        """One mark of `marks`: `number` is a step line's index, a save's step."""
        if what == "step":
            assert number is not None  # a step line always has its index
            self.step_line(t, number)
        elif what == "saved" and number == self.last_step and self.state == TRAINING:
            self.saved_at = t
        elif what == "stop" and self.state in (TRAINING, STARTING, RESTARTING):
            self.stopped(t)
        elif what == "failure" and self.state in (TRAINING, STARTING):
            self.failed(t)
        elif what == "launch" and self.state == STOPPED:
            self.move(STARTING, t)
        elif what == "launch" and self.state == TRAINING:
            # The job before ended without a word: after saving its last
            # step (written before the `exited` event), else as a failure
            # found only now.
            if self.saved_at is not None:
                self.stopped(self.saved_at)
                self.move(STARTING, t)
            else:
                self.failed(t)

    def step_line(self, t: float, index: int) -> None:
        record = self.records[index]
        if self.state == TRAINING:
            step_s = min(step_seconds(record), max(0.0, t - self.since))
            self.book("other", self.training_until(t, step_s))
            last = self.last_copy[record["step"]] == index
            self.book("productive" if last else "recomputed", step_s)
        else:  # its warm-up step ends a start, a restart (or a stop the job went on from)
            self.move(TRAINING, t, "other" if self.state == STOPPED else None)
        self.since = t
        self.last_step, self.saved_at = record["step"], None

    def stopped(self, t: float) -> None:
        if self.state == TRAINING:
            self.book("other", self.training_until(t))
        self.move(STOPPED, t)

    def failed(self, t: float) -> None:
        self.interruptions += 1
        if self.state == TRAINING:
            self.book("failed", self.training_until(t))
        self.move(RESTARTING, t)

    def close(self, end: float) -> None:
        if self.state == TRAINING:
            self.book("other", self.training_until(end))
        self.move(TRAINING, end, "other" if self.state == STOPPED else None)


def compute_goodput(events: list[dict], metrics: list[dict], end: Optional[float] = None) -> dict:
    records = sorted((r for r in metrics if "loss" in r), key=lambda r: r["time"])
    start = launched_at(events, records)
    if start is None:
        return {"wall_s": 0.0, "goodput": 0.0, **{f"{b}_s": 0.0 for b in BUCKETS}}
    finished = [e["time"] for e in events if e["event"] == "run_finished"]
    end = end or max([*finished, records[-1]["time"] if records else start])
    pauses = [(e["time"], "checkpoint", e.get("blocking_seconds", 0.0)) for e in events
              if e["event"] == "checkpoint_saved"]
    pauses += [(r["time"], "eval", r.get("eval_time_s", 0.0)) for r in metrics
               if "eval_loss" in r and "time" in r]
    ledger = Ledger(start, records, pauses)
    for t, what, number in marks(events, records):
        if start <= t <= end:
            ledger.mark(t, what, number)
    ledger.close(end)
    spent, wall = ledger.spent, end - start
    busy = wall - spent["idle"]
    return {"wall_s": wall, "goodput": spent["productive"] / busy if busy > 0 else 0.0,
            **{f"{k}_s": v for k, v in spent.items()},
            "interruptions": ledger.interruptions, "steps": len(ledger.last_copy),
            "recomputed_steps": len(records) - len(ledger.last_copy)}


def run_goodput(run_dir: str | Path, end: Optional[float] = None) -> dict:
    run_dir = Path(run_dir)
    metrics_path = run_dir / "metrics.jsonl"
    metrics = read_jsonl(metrics_path) if metrics_path.exists() else []
    return compute_goodput(read_events(run_dir), metrics, end)


def write_goodput(run_dir: str | Path) -> dict:
    """goodput.json of the run so far (the run's end: now)."""
    figures = run_goodput(run_dir, end=time.time())
    write_atomic(Path(run_dir) / "goodput.json", json.dumps(figures, indent=1))
    return figures
