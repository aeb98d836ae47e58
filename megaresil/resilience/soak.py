"""`megaresil soak`: one long run with faults of every kind, then a fault-free
reference to the same step; proof over time, not scenarios.

The faulted run is the recipe's own layout (the demo: tp2 x pp2 x dp2) with
asynchronous saves. Its faults come in episodes, each at a random step and,
where the kind allows, a random section: one fault of each kind (kill, raise,
hang in sleep / a collective / holding the GIL, slow, sigterm, a corrupted
checkpoint followed by a kill), a fault during a save, one during a restart
(`generation`, see faults.py), a kill during the preemption save, and two
faults on adjacent steps. A job that exits preempted (75) is requeued like a
scheduler would. CPU hogs may run beside it.

The local checkpoint tier is on unless asked otherwise (`local=False`): a
local save every step on two simulated nodes, each rank's shard replicated
to the other, so most faults cost one step. Two more episodes then damage
it: a rank's own local shards corrupted before it is killed (the restart
must take them from their replicas) and a lost node (its local directory
deleted and a rank killed: its ranks' shards come from the other node). A
corrupted global checkpoint is then often not read at all (a newer local
step serves): the report says so instead of counting it undetected.

How long: a short fault-free calibration run measures start-up and step
time. Episodes are taken, cheapest first for the first round of kinds (so a
short soak still sees several) and in seeded random order after that, while
their estimated recovery cost and room to run fit in --minutes; the steps are
what is left of the budget over the step time. Given the seed, the number of
steps and of episodes (all in soak.json), the schedule is always the same.

Report (console and `soak.json` in the soak directory): faults injected,
detected and recovered, false alarms (hang_detected / worker_error with no
fault behind it; hang_suspected counted apart as warnings), steps and time
lost per fault, goodput (productive step time / wall time), and whether the
final checkpoint equals the reference's bit for bit and every step's loss
matches.
"""
from __future__ import annotations

import json
import random
import shutil
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable, Optional

from megaresil.checkpoint.offline.diff import diff_checkpoints
from megaresil.checkpoint.format import committed_checkpoints, step_dir_name
from megaresil.config import RecipeConfig, load_recipe
from megaresil.events import read_events
from megaresil.observe.report import write_report
from megaresil.resilience.chaos import (DETECTIONS, Launch, local_tier_settings,
                                        measure_recovery, run_training, run_with_requeue,
                                        step_records)
from megaresil.resilience.faults import fault_id
from megaresil.resilience.watchdog import ABORT_GRACE_S
from megaresil.safe_files import write_atomic

CALIBRATION_STEPS = 6
SAVE_INTERVAL = 5  # a save every 5 steps: a fault costs at most 5 recomputed steps
KEEP = 3  # checkpoints kept: a corrupted newest one still has two to fall back on
# A corruption needs an older checkpoint to fall back on: from the step before the third save.
CORRUPT_FROM = 3 * SAVE_INTERVAL - 1
SPACING = SAVE_INTERVAL + 3  # steps per episode: the fault, the reload, the recomputation
GIL_TIMEOUT_S = 5.0  # the guardian's wait before it kills a rank that holds the GIL
SLOW_S = 0.5  # a slow rank's extra seconds per step: about one step of the demo here
ALARMS = ("hang_detected", "worker_error")
# The sections a hang may use: the calibrated ones. Setup, checkpoint and
# eval keep long fixed budgets (minutes), so a hang there would mostly wait.
HANG_SECTIONS = ("data", "forward_backward", "optimizer")
# What says a fault of each kind was noticed (a restart also counts, except
# for a corrupted checkpoint: only skipping it on a load shows it was seen).
# A corrupted local shard is seen where the load takes its rank's shard from
# a replica (or leaves the local tier for the global one): see local_repair;
# a lost node needs that as well as the restart.
DETECTED_BY = {"kill": DETECTIONS, "raise": ("worker_error",), "hang": ("hang_detected",),
               "sigterm": ("preempted",), "corrupt_checkpoint": ("checkpoint_skipped",),
               "slow": (), "lose_local_node": DETECTIONS, "corrupt_local_checkpoint": ()}
CORRUPTIONS = ("corrupt_checkpoint", "corrupt_local_checkpoint")  # no restart of their own


@dataclass
class Calibration:
    startup_s: float  # launch to the first step's start
    step_s: float  # median step time once warm


@dataclass
class Plan:
    """What the episode builders may place faults into."""
    world: int
    eval_steps: set

    def sections_at(self, step: int, hang: bool) -> list[str]:
        if hang:
            return list(HANG_SECTIONS)
        sections = list(HANG_SECTIONS)
        if step % SAVE_INTERVAL == 0:
            sections.append("checkpoint")
        if step in self.eval_steps:
            sections.append("eval")
        return sections


@dataclass
class Episode:
    name: str
    restarts: int  # restarts it is expected to cause (for a later `generation`)
    cost: Callable[["Costs"], float]  # estimated seconds of recovery
    build: Callable[[random.Random, int, int, Plan, int], list[dict]]


@dataclass
class Costs:
    """Recovery costs estimated from the calibration."""
    relaunch: float
    in_process: float
    detect_hang: float
    recompute: float
    slow: float


# --- episodes -----------------------------------------------------------------------

def _fault(rng: random.Random, plan: Plan, kind: str, step: int, sections=None, **extra) -> dict:
    section = rng.choice(sections or plan.sections_at(step, hang=kind == "hang"))
    return {"kind": kind, "rank": rng.randrange(plan.world), "step": step, "section": section,
            **extra}


def _single(kind: str, **extra) -> Callable:
    def build(rng, lo, hi, plan, restarts_before):
        return [_fault(rng, plan, kind, rng.randint(lo, hi), **extra)]
    return build


def steps_at_phase(lo: int, hi: int, phase: int) -> list[int]:
    """Steps in [lo, hi] that lie `phase` steps past a save; when the slot
    holds none, the first one after lo (a fault meant for a save must meet
    one: a kill in the checkpoint section of a step that saves nothing never
    fires)."""
    found = [s for s in range(lo, hi + 1) if s % SAVE_INTERVAL == phase]
    return found or [lo + (phase - lo) % SAVE_INTERVAL]


def _corrupt_then_kill(rng, lo, hi, plan, restarts_before):
    # The step before a save, so the newest checkpoint is long committed
    # (async) before it is corrupted, and never before a second checkpoint
    # exists to fall back on (with none, refusing to start over is right);
    # the kill then makes the restart read it.
    step = rng.choice(steps_at_phase(max(lo, CORRUPT_FROM), hi, SAVE_INTERVAL - 1))
    return [_fault(rng, plan, "corrupt_checkpoint", step, ["data"]),
            _fault(rng, plan, "kill", step, ["forward_backward", "optimizer"])]


def _corrupt_local_then_kill(rng, lo, hi, plan, restarts_before):
    # One rank, one section, the corruption first: nothing this rank commits
    # comes between them, so the restart finds every own shard damaged.
    fault = _fault(rng, plan, "corrupt_local_checkpoint", rng.randint(lo, hi),
                   ["forward_backward", "optimizer"])
    return [fault, {**fault, "kind": "kill"}]


def _during_save(rng, lo, hi, plan, restarts_before):
    step = rng.choice(steps_at_phase(lo, hi, 0))
    return [_fault(rng, plan, rng.choice(["kill", "raise"]), step, ["checkpoint"])]


def _during_restart(rng, lo, hi, plan, restarts_before):
    """A raise, then a fault in the setup of the restart it causes."""
    trigger = _fault(rng, plan, "raise", rng.randint(lo, hi))
    second = {"kind": rng.choice(["kill", "raise"]), "rank": rng.randrange(plan.world),
              "step": 0, "section": "setup", "generation": restarts_before + 1}
    return [trigger, second]


def _during_preemption_save(rng, lo, hi, plan, restarts_before):
    step = rng.randint(lo, hi)
    return [_fault(rng, plan, "sigterm", step, HANG_SECTIONS),
            _fault(rng, plan, "kill", step, ["checkpoint"])]


def _adjacent(rng, lo, hi, plan, restarts_before):
    step = rng.randint(lo, hi - 1)
    first, second = rng.choice(["raise", "hang"]), rng.choice(["raise", "kill", "hang"])
    return [_fault(rng, plan, kind, s, **({"mode": "sleep"} if kind == "hang" else {}))
            for kind, s in ((first, step), (second, step + 1))]


def episodes(local: bool = False) -> list[Episode]:
    """One of each, roughly cheapest first; with `local`, the local tier's
    own are the first that relaunch, so a soak of a few minutes damages it."""
    return [
        Episode("slow", 0, lambda c: c.slow, _single("slow", seconds=SLOW_S)),
        Episode("raise", 1, lambda c: c.in_process + c.recompute, _single("raise")),
        Episode("hang-sleep", 1, lambda c: c.detect_hang + c.in_process + c.recompute,
                _single("hang", mode="sleep")),
        Episode("hang-collective", 1, lambda c: c.detect_hang + c.in_process + c.recompute,
                _single("hang", mode="collective")),
    ] + ([
        Episode("lose-local-node", 1, lambda c: c.relaunch + c.recompute,
                _single("lose_local_node")),
        Episode("corrupt-local-then-kill", 1, lambda c: c.relaunch + c.recompute,
                _corrupt_local_then_kill),
    ] if local else []) + [
        Episode("kill", 1, lambda c: c.relaunch + c.recompute, _single("kill")),
        Episode("sigterm", 0, lambda c: c.relaunch, _single("sigterm")),
        Episode("adjacent-faults", 2, lambda c: 2 * (c.detect_hang + c.in_process + c.recompute),
                _adjacent),
        Episode("fault-during-save", 1, lambda c: c.relaunch + c.recompute, _during_save),
        Episode("corrupt-then-kill", 1, lambda c: c.relaunch + 2 * c.recompute,
                _corrupt_then_kill),
        Episode("kill-during-preemption-save", 1, lambda c: c.relaunch + c.recompute,
                _during_preemption_save),
        Episode("hang-holding-gil", 1,
                lambda c: GIL_TIMEOUT_S + c.relaunch + c.in_process + c.recompute,
                _single("hang", mode="gil")),
        # The abort cannot reach it: the watchdog exits at the hard limit + grace.
        Episode("hang-native", 2,
                lambda c: 5 * c.detect_hang + ABORT_GRACE_S + c.relaunch + c.recompute,
                _single("hang", mode="native")),
        Episode("fault-during-restart", 2, lambda c: c.in_process + c.relaunch + c.recompute,
                _during_restart),
    ]


# --- the schedule --------------------------------------------------------------------

def first_fault_step(cfg: RecipeConfig) -> int:
    """After the watchdog's calibration and after the first checkpoint is committed."""
    return max(cfg.resilience.watchdog.calibration_steps, SAVE_INTERVAL) + 2


def estimate_costs(cal: Calibration, cfg: RecipeConfig) -> Costs:
    # A relaunch is a fresh start of every worker (and the survivors' stop).
    return Costs(relaunch=2 * cal.startup_s, in_process=max(3.0, cal.startup_s / 4),
                 detect_hang=cfg.resilience.watchdog.floor_s + 1.0,
                 recompute=SAVE_INTERVAL * cal.step_s, slow=SPACING * SLOW_S)


def episode_order(rng: random.Random, count: int, local: bool) -> list[Episode]:
    """Every kind once, cheapest first, then seeded random rounds."""
    catalogue = episodes(local)
    order = list(catalogue)
    while len(order) < count:
        round_ = list(catalogue)
        rng.shuffle(round_)
        order += round_
    return order[:count]


def fit(cal: Calibration, cfg: RecipeConfig, minutes: float, seed: int) -> tuple[int, int]:
    """(episodes, steps) that fit the budget: the first start, then steps and
    episodes' recoveries, each episode with SPACING steps of room."""
    budget = minutes * 60 - cal.startup_s
    costs = estimate_costs(cal, cfg)
    chosen, spent = 0, 0.0
    for episode in episode_order(random.Random(seed), 1000, cfg.checkpoint.local.enabled):
        steps_needed = first_fault_step(cfg) + (chosen + 1) * SPACING + 1
        if chosen and spent + episode.cost(costs) + steps_needed * cal.step_s > budget:
            break
        chosen, spent = chosen + 1, spent + episode.cost(costs)
    floor = first_fault_step(cfg) + chosen * SPACING + 1
    return chosen, max(floor, int((budget - spent) / cal.step_s))


def schedule(cfg: RecipeConfig, seed: int, steps: int, count: int) -> list[dict]:
    """The faults of `count` episodes over `steps` steps: one slot of steps per
    episode, the episodes in seeded random order, each placed at random in its
    slot. Returns [{episode, faults}] in step order."""
    rng = random.Random(seed)
    chosen = episode_order(rng, count, cfg.checkpoint.local.enabled)
    rng.shuffle(chosen)
    first, last = first_fault_step(cfg), steps - 1
    width = max(SPACING, (last - first + 1) // max(count, 1))
    t = cfg.train
    eval_steps = ({steps} | set(range(t.eval_interval, steps + 1, t.eval_interval or steps + 1))
                  if t.eval_batches else set())
    plan = Plan(world=cfg.parallel.tp * cfg.parallel.pp * cfg.parallel.dp, eval_steps=eval_steps)
    slot_end = lambda i: min(last, first + i * width + width - SAVE_INTERVAL - 1)
    for i in range(len(chosen)):  # a corruption too early for its fallback trades places
        if chosen[i].name == "corrupt-then-kill" and slot_end(i) < CORRUPT_FROM:
            later = [j for j in range(i + 1, len(chosen)) if chosen[j].name != chosen[i].name]
            if later:
                chosen[i], chosen[later[-1]] = chosen[later[-1]], chosen[i]
    placed, restarts = [], 0
    for i, episode in enumerate(chosen):
        lo = first + i * width
        hi = slot_end(i)  # room to recover before the next
        placed.append({"episode": episode.name,
                       "faults": episode.build(rng, lo, max(lo + 1, hi), plan, restarts)})
        restarts += episode.restarts
    return placed


# --- running -------------------------------------------------------------------------

def soak_settings(world_faults: int) -> list[str]:
    """Restarts on (whatever the defaults), sized to the faults; async saves
    (the local tier's settings are added by run_soak)."""
    restarts = 2 * world_faults + 2
    return ["checkpoint.async=true", f"checkpoint.interval={SAVE_INTERVAL}",
            f"checkpoint.keep={KEEP}", "resilience.in_process=true",
            f"resilience.max_in_process_restarts={restarts}",
            f"resilience.max_restarts={restarts}",
            f"resilience.watchdog.gil_timeout_s={GIL_TIMEOUT_S}", "logging.tensorboard=false"]


def run_dir_overrides(run_dir: Path) -> list[str]:
    # Each run keeps its checkpoints in its own directory, whatever checkpoint.dir says.
    return [f"checkpoint.dir={run_dir / 'checkpoints'}"]


def calibrate(recipe: str, overrides: list[str], run_dir: Path) -> Calibration:
    shutil.rmtree(run_dir, ignore_errors=True)
    launch = run_training(recipe, [*overrides, f"train.steps={CALIBRATION_STEPS}",
                                   *run_dir_overrides(run_dir)], run_dir,
                          log=_log(run_dir, "train.log"))
    records = step_records(run_dir)
    if launch.exit_code != 0 or len(records) < CALIBRATION_STEPS:
        raise RuntimeError(f"the calibration run failed (exit {launch.exit_code}); "
                           f"see {run_dir / 'train.log'}")
    durations = [b["elapsed_s"] - a["elapsed_s"] for a, b in zip(records, records[1:])]
    startup = records[0]["time"] - records[0]["elapsed_s"] - launch.started
    return Calibration(startup_s=startup, step_s=statistics.median(durations[1:]))


def _log(run_dir: Path, name: str) -> Path:
    run_dir.mkdir(parents=True, exist_ok=True)
    return run_dir / name


def start_hogs(count: int) -> list[subprocess.Popen]:
    """Busy processes beside the run: a machine shared with other work."""
    return [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(count)]


def run_soak(recipe: str, overrides: list[str], *, minutes: float, seed: int,
             hogs: int = 0, local: bool = True) -> dict:
    """Calibrate, run the faulted job (hogs beside it), then the reference,
    all with the local tier when `local`; the report is also written to
    RUN_DIR/soak.json."""
    if local:
        p = load_recipe(recipe, overrides).parallel
        overrides = [*local_tier_settings(p.tp * p.pp * p.dp), *overrides]
    cfg = load_recipe(recipe, overrides)
    root = Path(cfg.run.dir)
    hog_procs = start_hogs(hogs)
    try:
        cal = calibrate(recipe, overrides + soak_settings(len(episodes(local))),
                        root / "calibration")
        count, steps = fit(cal, cfg, minutes, seed)
        placed = schedule(cfg, seed, steps, count)
        faults = [f for p in placed for f in p["faults"]]
        run_overrides = [*overrides, *soak_settings(len(faults)), f"train.steps={steps}"]
        print(f"soak: {count} episodes, {len(faults)} faults over {steps} steps "
              f"(step {cal.step_s:.2f} s, start-up {cal.startup_s:.0f} s)", flush=True)
        launches = run_faulted(recipe, run_overrides, root / "faulted", faults, minutes)
    finally:
        for proc in hog_procs:
            proc.kill()
            proc.wait()
    reference = root / "reference"
    shutil.rmtree(reference, ignore_errors=True)
    # The reference is fault-free: three times its expected time is a deadlock.
    expected = cal.startup_s + steps * cal.step_s
    ref_launch = run_training(recipe, [*run_overrides, *run_dir_overrides(reference)], reference,
                              log=_log(reference, "train.log"), timeout_s=3 * expected + 120)
    report = analyse(root / "faulted", reference, placed, launches, cfg, steps)
    report.update(seed=seed, minutes=minutes, hogs=hogs, steps=steps, episodes=count,
                  local_tier=cfg.checkpoint.local.enabled,
                  calibration=asdict(cal), reference_exit_code=ref_launch.exit_code,
                  schedule=placed, faulted=str(root / "faulted"), reference=str(reference))
    report["ok"] = report["ok"] and ref_launch.exit_code == 0
    report["report"] = str(write_report(root / "faulted", [reference], root / "report"))
    write_atomic(root / "soak.json", json.dumps(report, indent=1))
    return report


def run_faulted(recipe: str, overrides: list[str], run_dir: Path, faults: list[dict],
                minutes: float) -> list[Launch]:
    """The faulted job, requeued after each preemption; a job deadlocked past
    three times its budget (plus two minutes) is killed and reported."""
    shutil.rmtree(run_dir, ignore_errors=True)
    sigterms = sum(f["kind"] == "sigterm" for f in faults)
    deadline = time.time() + 3 * minutes * 60 + 120
    return run_with_requeue(recipe, [*overrides, f"faults={json.dumps(faults)}",
                                     *run_dir_overrides(run_dir)], run_dir,
                            requeues=sigterms, log=_log(run_dir, "train.log"), deadline=deadline)


# --- the report ----------------------------------------------------------------------

def analyse(faulted: Path, reference: Path, placed: list[dict], launches: list[Launch],
            cfg: RecipeConfig, steps: int) -> dict:
    events, records = read_events(faulted), step_records(faulted)
    ref_records = step_records(reference)
    step_s = statistics.median(_durations(ref_records, cfg).values()) if ref_records else 0.0
    rows = [fault_row(f, p["episode"], events, records, step_s)
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
    """Seconds of each step's last (kept) computation, from its token rate."""
    tokens = cfg.train.global_batch_size * cfg.data.seq_len
    return {r["step"]: tokens / r["tokens_per_s"] for r in records}


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
    restart_counts = fault["kind"] not in ("slow", *CORRUPTIONS)
    detected_at = min((e["time"] for e in events if e["time"] >= t and e["event"] in expected),
                      default=rec["detected_at"] if restart_counts else None)
    load = next((e for e in events if e["event"] == "checkpoint_loaded" and e["time"] > t), None)
    if fault["kind"] == "corrupt_local_checkpoint" and local_repair(load, fault["rank"]):
        detected_at = load["time"]
    if fault["kind"] == "lose_local_node" and not local_repair(load, fault["rank"]):
        detected_at = None  # the restart must also have found the node's shards gone
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


def local_repair(load: Optional[dict], rank: int) -> bool:
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
        slow = [b["time"] - a["time"] for a, b in zip(records, records[1:])
                if t <= a["time"] and b["time"] < end and b["step"] == a["step"] + 1]
        return sum(max(0.0, d - step_s) for d in slow)
    since = max(t, rec["first_step_after_at"] or t)
    back = next((r["time"] for r in records
                 if r["time"] >= since and r["step"] > rec["last_step_before"]), None)
    return None if back is None else max(0.0, back - t - step_s)


def false_alarms(rows: list[dict], events: list[dict], records: list[dict]) -> list[dict]:
    """Alarms with no fault behind them, as incidents (alarms not separated by
    a completed step). A fault covers alarms from its injection until the run
    completes a step after the next checkpoint load; a slow fault covers none."""
    windows = [(r["time"], recovered_by(r["time"], events, records)) for r in rows
               if r["injected"] and r["kind"] != "slow"]
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


def format_report(r: dict) -> str:
    def seconds(v):
        return "-" if v is None else f"{v:.1f}"
    head = (f"{'step':>5} {'episode':<28} {'fault':<24} {'rank':>4} {'section':<16} "
            f"{'detected':>8} {'recovered':>9} {'lost':>4} {'time lost':>9}")
    lines = [head]
    for f in r["faults"]:
        kind = f["kind"] + (f"/{f['mode']}" if f["mode"] else "")
        detected = (seconds(f["detection_latency_s"]) + " s" if f["detected"] else
                    "n/a" if f["kind"] == "slow" else "not read" if f.get("not_read") else "no")
        lines.append(f"{f['step']:>5} {f['episode']:<28} {kind:<24} {f['rank']:>4} "
                     f"{f['section']:<16} {detected if f['injected'] else 'NOT FIRED':>8} "
                     f"{str(f['recovered']):>9} {f['steps_lost']:>4} "
                     f"{seconds(f['time_lost_s']):>7} s")
    rows = r["faults"]
    detectable = [f for f in rows if f["kind"] != "slow" and not f.get("not_read")]
    lines += [
        "",
        f"steps {r['steps']}, seed {r['seed']}, hogs {r['hogs']}, local tier "
        f"{'on' if r.get('local_tier') else 'off'}, launches "
        f"{len(r['launches'])} (exit codes {[x['exit_code'] for x in r['launches']]})",
        f"faults: injected {sum(f['injected'] for f in rows)}/{len(rows)}, detected "
        f"{sum(f['detected'] for f in detectable)}/{len(detectable)} (slow is not an alarm; "
        f"{sum(bool(f.get('not_read')) for f in rows)} corrupted global checkpoint(s) never "
        f"read, a newer local step served), "
        f"recovered {sum(f['recovered'] for f in rows)}/{len(rows)}",
        f"false alarms {len(r['false_alarms'])}, warnings (hang_suspected) {r['warnings']}",
        f"steps lost {sum(f['steps_lost'] for f in rows)}, goodput {r['goodput']:.1%} "
        f"({r['productive_s']:.0f} s of steps in {r['wall_s']:.0f} s)",
        f"final state: checkpoint {'identical' if r['checkpoint_equal'] else 'DIFFERENT'}, "
        f"losses {'identical' if not r['steps_with_different_loss'] else 'DIFFERENT'} over "
        f"the reference's {r['reference_steps']} steps "
        f"(final {r['final_loss']!r} vs reference {r['reference_final_loss']!r})",
        f"report: {r.get('report', '-')}",
        f"verdict: {'PASS' if r['ok'] else 'FAIL'}"]
    for alarm in r["false_alarms"]:
        lines.append(f"false alarm: {json.dumps(alarm)[:400]}")
    return "\n".join(lines)
