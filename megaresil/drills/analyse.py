"""What a drill's runs say, from their own records (events.jsonl,
metrics.jsonl): how a run got over each fault (detection, restart, steps and
time lost), alarms with no fault behind them, and whether the final state
equals the fault-free reference's."""
from __future__ import annotations

import statistics
from dataclasses import asdict
from pathlib import Path
from typing import Optional, Sequence, TypeGuard

from megaresil.checkpoint.format import committed_checkpoints, step_dir_name
from megaresil.checkpoint.offline.diff import diff_checkpoints
from megaresil.config import RecipeConfig
from megaresil.drills.run import Launch, step_records
from megaresil.drills.scenarios import Scenario
from megaresil.events import read_events
from megaresil.resilience.faults import fault_id

DETECTIONS = ("hang_detected", "worker_error", "preempted", "nonfinite_detected")
# The numerical checks' alarms, which need no restart.
NUMERIC_ALARMS = ("nonfinite_detected", "loss_spike", "silent_corruption_detected")
ALARMS = ("hang_detected", "worker_error", *NUMERIC_ALARMS)
NUMERIC_KINDS = ("nan", "spike", "bitflip", "router_nan")
# What says a fault of each kind was noticed (a restart also counts, except
# for a corrupted checkpoint: only skipping it on a load shows it was seen).
# A corrupted local shard is seen where the load takes its rank's shard from
# a replica (or leaves the local tier for the global one): see local_repair;
# a lost node needs that as well as the restart.
DETECTED_BY = {"kill": DETECTIONS, "raise": ("worker_error",), "hang": ("hang_detected",),
               "sigterm": ("preempted",), "corrupt_checkpoint": ("checkpoint_skipped",),
               "slow": (), "lose_local_node": DETECTIONS, "corrupt_local_checkpoint": (),
               "nan": ("nonfinite_detected",), "router_nan": ("nonfinite_detected",),
               "spike": ("loss_spike",),
               "bitflip": ("silent_corruption_detected", "nonfinite_detected", "loss_spike")}
CORRUPTIONS = ("corrupt_checkpoint", "corrupt_local_checkpoint")  # no restart of their own
NO_ALARM_KINDS = ("slow", "slow-link")  # slow, not hung: any alarm is a false one


def measure_recovery(events: list[dict], steps: list[dict], fault_time: float,
                     detections=DETECTIONS) -> dict:
    """How the run got over a fault at `fault_time`: when it was detected (the
    first of `detections` after it, else the first restart), how it restarted,
    which step it reloaded, when it next completed a step, and how many steps
    done before the fault had to be redone."""
    after = [e for e in events if e["time"] >= fault_time]
    restarts = [e for e in after if e["event"] == "restart"]
    detected = min((e["time"] for e in after if e["event"] in detections),
                   default=restarts[0]["time"] if restarts else None)
    loaded = next((e for e in after if e["event"] == "checkpoint_loaded"), None)
    first_after = next((r for r in steps if detected and r["time"] > detected), None)
    before = [r["step"] for r in steps if r["time"] < fault_time]
    return {"detected_at": detected, "restart_kind": restarts[0]["kind"] if restarts else None,
            "loaded_step": loaded["step"] if loaded else None,
            "first_step_after_at": first_after["time"] if first_after else None,
            "last_step_before": max(before, default=0),
            "steps_lost": max(0, max(before) - loaded["step"]) if before and loaded else 0}


# --- a chaos scenario ----------------------------------------------------------------

def analyse_scenario(reference: Path, faulted: Path, scenario: Scenario,
                     fault_time: Optional[float] = None) -> dict:
    events = read_events(faulted)
    metrics = step_records(faulted)
    if fault_time is None:
        fault_time = min((e["time"] for e in events if e["event"] == "fault_injected"),
                         default=None)
    # What shows these faults were noticed, besides the restart-making detections.
    detections = tuple({*DETECTIONS,
                        *(d for f in scenario.faults for d in DETECTED_BY[f["kind"]])})
    recovery = (measure_recovery(events, metrics, fault_time, detections)
                if fault_time is not None
                else measure_recovery([], [], 0.0))
    detected, first_after = recovery["detected_at"], recovery["first_step_after_at"]
    ref_final = step_records(reference)[-1]
    final = metrics[-1]
    # Losing a node changes the layout (dp shrinks): equal within 1e-5 then.
    tolerance = 1e-5 * abs(ref_final["loss"]) if scenario.nodes > 1 else 0.0
    equal = (final["step"] == ref_final["step"]
             and abs(final["loss"] - ref_final["loss"]) <= tolerance)
    hangs = [e for e in events if e["event"] == "hang_detected"]
    return {
        "scenario": scenario.name,
        "recovered": final["step"] == ref_final["step"],
        "detection_latency_s": None if detected is None or fault_time is None
        else detected - fault_time,
        "restart_time_s": None if first_after is None or detected is None
        else first_after - detected,
        "steps_lost": recovery["steps_lost"],
        "final_loss": final["loss"], "reference_final_loss": ref_final["loss"],
        "final_loss_equal": equal,
        "restart_kind": recovery["restart_kind"] or
        ("requeue" if scenario.requeue_after_exit else "none"),
        "hang_detected": len(hangs), "culprit_ranks": hangs[0]["culprit_ranks"] if hangs else [],
        "checkpoints_skipped": [e["path"] for e in events if e["event"] == "checkpoint_skipped"],
        "stragglers": sorted({e["rank"] for e in events if e["event"] == "straggler_detected"}),
        "stale_writes": stale_writes(events, metrics),
        "fenced": sum(e["event"] == "fenced" for e in events),
        "excluded_nodes": [e["host"] for e in events if e["event"] == "node_excluded"],
        # Processes replaced one by one, and relaunches of all (a run with
        # replacements and no relaunch kept every other rank's process).
        "replacements": sum(e["event"] == "restart" and e.get("kind") == "replace"
                            for e in events),
        "relaunches": sum(e["event"] == "restart" and e.get("kind") == "relaunch"
                          for e in events),
    }


def stale_writes(events: list[dict], metrics: list[dict]) -> int:
    """Rows that name a generation older than one already formed when they
    were written: writes from a side the job re-formed without, which
    fencing keeps out (it must stay 0)."""
    formed = [(e["time"], e["generation"]) for e in events
              if e["event"] == "generation_started" and "generation" in e]

    def newest_formed(t: float) -> int:
        return max((g for at, g in formed if at <= t), default=0)
    return sum(r["generation"] < newest_formed(r["time"]) for r in [*events, *metrics]
               if isinstance(r.get("generation"), int) and r.get("event") != "fenced")


# --- a soak -------------------------------------------------------------------------

def analyse_soak(faulted: Path, reference: Path, placed: list[dict], launches: list[Launch],
                 cfg: RecipeConfig, steps: int, strikes: Sequence[dict] = ()) -> dict:
    """The soak's report; `strikes`: the node episodes the driver struck
    (soak_nodes.py), each with the time its link was struck and healed."""
    events, records = read_events(faulted), step_records(faulted)
    ref_records = step_records(reference)
    step_s = statistics.median(_durations(ref_records, cfg).values()) if ref_records else 0.0
    rows = [node_row(f, p["episode"], strikes, events, records, step_s) if "node" in f
            else fault_row(f, p["episode"], events, records, step_s)
            for p in placed for f in p["faults"]]
    # The reference has no fault: every alarm there is a false one too.
    alarms = (false_alarms(rows, events, records)
              + [{**a, "run": "reference"} for a in
                 false_alarms([], read_events(reference), ref_records)])
    final = final_state(faulted, reference, records, ref_records, steps)
    wall = launches[-1].ended - launches[0].started
    productive = sum(_durations(records, cfg).values())
    ok = (all(r["injected"] and r["recovered"] for r in rows) and not alarms
          and final["bit_equal"] and launches[-1].exit_code == 0)
    return {"ok": ok, "faults": rows, "false_alarms": alarms,
            "warnings": sum(e["event"] == "hang_suspected" for e in events),
            "launches": [asdict(launch) for launch in launches],
            "exit_code": launches[-1].exit_code, "wall_s": wall, "productive_s": productive,
            "goodput": productive / wall if wall else 0.0, **final}


def _durations(records: list[dict], cfg: RecipeConfig) -> dict[int, float]:
    """Seconds of each step's last (kept) computation, from its token rate
    and the global batch it trained (a batch ramp's grows)."""
    return {r["step"]: r.get("global_batch_size", cfg.train.global_batch_size)
            * cfg.data.seq_len / r["tokens_per_s"] for r in records}


def fault_row(fault: dict, episode: str, events: list[dict], records: list[dict],
              step_s: float) -> dict:
    name = fault_id(fault)
    row = {"fault": name, "episode": episode, "kind": fault["kind"], "mode": fault.get("mode"),
           "rank": fault["rank"], "step": fault["step"], "section": fault["section"],
           "injected": False, "detected": False, "not_read": False, "recovered": False,
           "detection_latency_s": None, "steps_lost": 0, "time_lost_s": None,
           "loaded_tier": None, "from_replicas": None}
    fired = next((e for e in events if e["event"] == "fault_injected" and e["fault"] == name),
                 None)
    if fired is None:
        return row
    t = fired["time"]
    expected = DETECTED_BY[fault["kind"]]
    rec = measure_recovery(events, records, t, expected)
    restart_counts = fault["kind"] not in ("slow", *NUMERIC_KINDS, *CORRUPTIONS)
    detected_at = min((e["time"] for e in events if e["time"] >= t and e["event"] in expected),
                      default=rec["detected_at"] if restart_counts else None)
    load = next((e for e in events if e["event"] == "checkpoint_loaded" and e["time"] > t), None)
    if fault["kind"] == "corrupt_local_checkpoint" and local_repair(load, fault["rank"]):
        detected_at = load["time"]
    if fault["kind"] == "lose_local_node" and not (local_repair(load, fault["rank"])
                                                   or (load and load.get("tier") == "live")):
        # The restart must also have found the node's shards gone, or not
        # needed them: live replacement took the state from a peer's memory.
        detected_at = None
    # A newer local step served: the damaged global checkpoint was never read.
    not_read = (fault["kind"] == "corrupt_checkpoint" and detected_at is None
                and load is not None and load.get("tier") == "local")
    row.update(injected=True, time=t, detected=detected_at is not None, not_read=not_read,
               loaded_tier=load and load.get("tier"),
               from_replicas=load and load.get("from_replicas"),
               detection_latency_s=None if detected_at is None else detected_at - t,
               recovered=any(r["time"] > t and r["step"] >= fault["step"] for r in records),
               steps_lost=rec["steps_lost"] if fault["kind"] != "slow" else 0,
               time_lost_s=time_lost(fault, t, rec, events, records, step_s))
    return row


def node_row(fault: dict, episode: str, strikes: Sequence[dict], events: list[dict],
             records: list[dict], step_s: float) -> dict:
    """A node episode: struck by the driver or not; then a flapping link
    seen as a hang and restarted in place (or ridden out: no alarm, no
    restart), a slow link raising no alarm (none is expected: `detected`
    stays False). Recovered: a later step done after the link was healed."""
    row = {"fault": f"{fault['kind']}@node{fault['node']}/step{fault['step']}",
           "episode": episode, "kind": fault["kind"], "mode": None, "rank": None,
           "node": fault["node"], "step": fault["step"], "section": "-", "injected": False,
           "detected": False, "not_read": False, "ridden_out": False, "recovered": False,
           "detection_latency_s": None, "steps_lost": 0, "time_lost_s": None,
           "loaded_tier": None, "from_replicas": None}
    strike = next((x for x in strikes if (x["kind"], x["node"], x["step"])
                   == (fault["kind"], fault["node"], fault["step"])), None)
    if strike is None:
        return row
    t, healed = strike["time"], strike["healed"]
    resumed = next((r["time"] for r in records if r["time"] > healed), float("inf"))
    alarm = min((e["time"] for e in events if t <= e["time"] <= resumed
                 and e["event"] in ("hang_detected", "restart")), default=None)
    flap = fault["kind"] == "flap-link"
    # With no alarm, a later restart (another episode's) is not this one's.
    rec = measure_recovery(events if alarm else [], records, t, ("hang_detected",))
    row.update(injected=True, time=t, healed=healed, detected=flap and alarm is not None,
               ridden_out=flap and alarm is None,
               detection_latency_s=None if alarm is None else alarm - t,
               recovered=any(r["time"] > healed and r["step"] > fault["step"] for r in records),
               steps_lost=rec["steps_lost"],
               time_lost_s=(extra_step_time(t, resumed, records, step_s) if not flap
                            else time_lost(fault, t, rec, events, records, step_s)))
    return row


def extra_step_time(start: float, end: float, records: list[dict], step_s: float) -> float:
    """Seconds the steps done between `start` and `end` took beyond `step_s`
    each (consecutive steps only: a restart's gap is not a step)."""
    return sum(max(0.0, b["time"] - a["time"] - step_s) for a, b in zip(records, records[1:])
               if start <= a["time"] and b["time"] <= end and b["step"] == a["step"] + 1)


def local_repair(load: Optional[dict], rank: int) -> TypeGuard[dict]:
    """Whether a load went round `rank`'s own local shards: it took them from
    a replica, or left the local tier for the global one."""
    return load is not None and (load.get("tier") == "global"
                                 or rank in (load.get("from_replicas") or []))


def time_lost(fault: dict, t: float, rec: dict, events: list[dict], records: list[dict],
              step_s: float) -> Optional[float]:
    """Wall time from the fault until the run is one step past where it was
    (less that step's own work); a slow fault: the extra time of its steps,
    until the next restart drops it."""
    if fault["kind"] == "slow":
        end = min((e["time"] for e in events if e["event"] == "restart" and e["time"] > t),
                  default=float("inf"))
        return extra_step_time(t, end, records, step_s)
    since = max(t, rec["first_step_after_at"] or t)
    back = next((r["time"] for r in records
                 if r["time"] >= since and r["step"] > rec["last_step_before"]), None)
    return None if back is None else max(0.0, back - t - step_s)


def false_alarms(rows: list[dict], events: list[dict], records: list[dict]) -> list[dict]:
    """Alarms with no fault behind them, as incidents (alarms not separated by
    a completed step). A fault covers alarms from its injection until the run
    completes a step after the next checkpoint load (a flapping link ridden
    out: a step after it healed); a slow rank or link covers none."""
    windows = [(r["time"], covered_until(r, events, records))
               for r in rows if r["injected"] and r["kind"] not in NO_ALARM_KINDS]
    unexplained = [e for e in events if e["event"] in ALARMS
                   and not any(start <= e["time"] <= end for start, end in windows)]
    incidents: list[list[dict]] = []
    for alarm in unexplained:
        if incidents and not any(incidents[-1][-1]["time"] < r["time"] < alarm["time"]
                                 for r in records):
            incidents[-1].append(alarm)
        else:
            incidents.append([alarm])
    return [describe_incident(i) for i in incidents]


def covered_until(row: dict, events: list[dict], records: list[dict]) -> float:
    if row["kind"] in NUMERIC_KINDS:
        return passed(row, records)
    if row.get("ridden_out"):
        return next((r["time"] for r in records if r["time"] > row["healed"]), float("inf"))
    return recovered_by(row["time"], events, records)


def passed(row: dict, records: list[dict]) -> float:
    """When a numerical fault's step was completed past (its checks, replays
    and rollbacks are over by then): the first later step's record."""
    return next((r["time"] for r in records if r["time"] > row["time"]
                 and r["step"] > row["step"]), float("inf"))


def recovered_by(t: float, events: list[dict], records: list[dict]) -> float:
    loaded = min((e["time"] for e in events
                  if e["event"] == "checkpoint_loaded" and e["time"] > t), default=None)
    if loaded is None:
        return float("inf")
    return next((r["time"] for r in records if r["time"] > loaded), float("inf"))


def describe_incident(alarms: list[dict]) -> dict:
    first = alarms[0]
    hang = next((a for a in alarms if a["event"] == "hang_detected"), None)
    return {"time": first["time"], "events": len(alarms),
            "first": {k: first.get(k) for k in ("event", "rank", "section", "step", "error")},
            "hang": None if hang is None else
            {k: hang.get(k) for k in ("rank", "section", "step", "waited_s", "culprit_ranks")}}


def final_state(faulted: Path, reference: Path, records: list[dict], ref_records: list[dict],
                steps: int) -> dict:
    """Bit-equality of the final checkpoints (every tensor, atol 0) and of
    every step's loss (the last computation of each step)."""
    losses = {r["step"]: r["loss"] for r in records}
    ref_losses = {r["step"]: r["loss"] for r in ref_records}
    differing = sorted(s for s in ref_losses if losses.get(s) != ref_losses[s])
    a, b = (d / "checkpoints" / step_dir_name(steps) for d in (faulted, reference))
    if a in committed_checkpoints(a.parent) and b in committed_checkpoints(b.parent):
        diff = diff_checkpoints(a, b)
        keys_differing = [k.key for k in diff.keys if not k.identical]
        checkpoint_equal = diff.identical
        missing = diff.only_in_a + diff.only_in_b
    else:
        keys_differing, checkpoint_equal, missing = [], False, [f"{a} or {b} missing"]
    return {"final_step": max(losses, default=0), "final_loss": losses.get(steps),
            "reference_final_loss": ref_losses.get(steps),
            "reference_steps": len(ref_losses), "steps_with_different_loss": differing[:20],
            "checkpoint_equal": checkpoint_equal, "tensors_different": keys_differing[:20],
            "tensors_missing": missing[:20],
            "bit_equal": (checkpoint_equal and not differing and steps in ref_losses
                          and len(ref_losses) == steps)}


