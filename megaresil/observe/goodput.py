"""Goodput of a run directory, across all its restarts and requeues: where the
wall time went, computed from the run's own records (events.jsonl,
metrics.jsonl) into buckets that add up (productive, startup, restarts,
failed, recomputed, checkpoint, eval, idle, other).

goodput = productive / (wall - idle): a pause the user chose is not the run's
loss. docs/observability.md ("Goodput", and "How it works") defines each
bucket and how interruptions and idle gaps are found.
"""
from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Optional

from megaresil.events import read_events, read_jsonl
from megaresil.safe_files import write_atomic

INTERRUPTIONS = ("hang_detected", "worker_error", "preempted", "interrupted", "restart")
INTENDED_STOPS = ("run_finished", "exited", "preempted", "interrupted")
FAILURES = ("hang_detected", "worker_error", "restart")
BUCKETS = ("productive", "startup", "restarts", "failed", "recomputed", "checkpoint", "eval",
           "idle", "other")


def step_seconds(record: dict) -> float:
    if "step_time_s" in record:
        return record["step_time_s"]
    return record["tokens"] / record["tokens_per_s"] / max(record["step"], 1)


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


def idle_gaps(events: list[dict], records: list[dict]) -> list[tuple[float, float]]:
    """(intended stop, next launch) for every job that ended as intended."""
    gaps = []
    for launch in job_launches(events)[1:]:
        before = [r for r in records if r["time"] < launch]
        if not before:
            continue
        last = before[-1]
        window = [e for e in events if last["time"] <= e["time"] < launch]
        stop = next((e["time"] for e in window if e["event"] in INTENDED_STOPS), None)
        if stop is None and not any(e["event"] in FAILURES for e in window):
            # A run written before the `exited` event: it saved its last step and ended.
            stop = next((e["time"] for e in window if e["event"] == "checkpoint_saved"
                         and e.get("step") == last["step"]), None)
        if stop is not None:
            gaps.append((stop, launch))
    return gaps


def interruptions(events: list[dict], records: list[dict]) -> list[tuple[float, int]]:
    """(detection time, index of the first step record after it), in order."""
    found, i = [], 0
    times = sorted([e["time"] for e in events if e["event"] in INTERRUPTIONS]
                   + [stop for stop, _ in idle_gaps(events, records)])
    for t in times:
        while i < len(records) and records[i]["time"] < t:
            i += 1
        if i == len(records):
            break
        if not found or found[-1][1] != i:  # one incident per gap between steps
            found.append((t, i))
    return found


def compute_goodput(events: list[dict], metrics: list[dict], end: Optional[float] = None) -> dict:
    records = sorted((r for r in metrics if "loss" in r), key=lambda r: r["time"])
    start = launched_at(events, records)
    if start is None:
        return {"wall_s": 0.0, "goodput": 0.0, **{f"{b}_s": 0.0 for b in BUCKETS}}
    finished = [e["time"] for e in events if e["event"] == "run_finished"]
    end = end or max([*finished, records[-1]["time"] if records else start])
    spent = dict.fromkeys(BUCKETS, 0.0)
    spent["startup"] = (records[0]["time"] - start) if records else 0.0
    gaps = []  # (last step before, detection, end of the first step after)
    for detected, i in interruptions(events, records):
        gaps.append((records[i - 1]["time"] if i else start, detected, records[i]["time"]))
        spent["restarts"] += records[i]["time"] - detected
        spent["failed"] += max(0.0, detected - gaps[-1][0])
    for stop, launch in idle_gaps(events, records):
        spent["idle"] += launch - stop
        spent["restarts"] -= launch - stop
    warmups = {0} | {i for _, i in interruptions(events, records)}
    last_index = {r["step"]: i for i, r in enumerate(records)}
    for i, record in enumerate(records):
        if i not in warmups:
            bucket = "recomputed" if last_index[record["step"]] != i else "productive"
            spent[bucket] += step_seconds(record)
    # Saves and evals: their own buckets, unless a restart window holds them;
    # those between a failure's last step and its detection leave "failed".
    pauses = [(e["time"], "checkpoint", e.get("blocking_seconds", 0.0)) for e in events
              if e["event"] == "checkpoint_saved"]
    pauses += [(r["time"], "eval", r.get("eval_time_s", 0.0)) for r in metrics
               if "eval_loss" in r and "time" in r]
    for t, bucket, seconds in pauses:
        gap = next((g for g in gaps if g[0] < t <= g[2]), None)
        if gap is None or t <= gap[1]:
            spent[bucket] += seconds
        if gap is not None and t <= gap[1]:
            spent["failed"] = max(0.0, spent["failed"] - seconds)
    wall = end - start
    spent["other"] = wall - sum(v for k, v in spent.items() if k != "other")
    busy = wall - spent["idle"]
    return {"wall_s": wall, "goodput": spent["productive"] / busy if busy > 0 else 0.0,
            **{f"{k}_s": v for k, v in spent.items()},
            "interruptions": len(gaps), "steps": len(last_index),
            "recomputed_steps": len(records) - len(last_index)}


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
