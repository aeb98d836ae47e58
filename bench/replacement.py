"""Live replacement against today's relaunch, side by side in one run (issue 33, "Measure").

A rank is killed (SIGKILL) at fixed steps of a real `megaresil train` job, in
three arms, interleaved repetition by repetition so a busy machine slows them alike:

- relaunch: today's default (resilience.replacement.enabled=false,
  resilience.in_process=true): TorchElastic relaunches every worker and they
  resume from the newest global checkpoint;
- replace_fresh: live replacement, the lost process started fresh
  (resilience.replacement.standby=false);
- replace_standby: live replacement, the agent's warm standby takes its place.

Two workloads: the 3D demo (tp2 x pp2 x dp2, 8 ranks) and a ~1 GB training
state at 4 ranks (tp2 x dp2; the model of bench/local_tier.py --state 1gb).
Global checkpoints every --interval steps (fixed: it is what a relaunch falls
back to). Per fault, from the run's own records: fault -> first step of the
generation after it, steps lost (completed steps trained again), bytes moved
(the live load's peer transfer; a relaunch's checkpoint load), whether the
surviving ranks kept their processes, and the start-up phases in between;
per run: goodput.json and whether the final loss is bit-equal to a fault-free
reference at the same layout.

    python bench/replacement.py [--reps 2] [--workloads demo 1gb] [--out bench/results]

Every figure is wall time on whatever machine runs it; the ratios between
arms of the same invocation are the figures to read.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Optional

from megaresil.drills.run import run_training, step_records, train_command
from megaresil.events import read_events
from megaresil.observe.startup import THRESHOLD_ENV

RECIPE = "recipes/gpt-tiny.yaml"
ARMS = {
    "relaunch": ["resilience.in_process=true", "resilience.replacement.enabled=false"],
    "replace_fresh": ["resilience.in_process=true", "resilience.replacement.enabled=true",
                      "resilience.replacement.standby=false"],
    "replace_standby": ["resilience.in_process=true", "resilience.replacement.enabled=true"],
}
WORKLOADS = {
    "demo": ["parallel.tp=2", "parallel.pp=2", "parallel.dp=2", "train.global_batch_size=16",
             "train.micro_batch_size=4", "data.seq_len=64"],
    # 67.3M parameters x 16 bytes (weights, grads, two Adam moments) = 1.08 GB.
    "1gb": ["model.num_layers=5", "model.hidden_size=1024", "model.num_heads=16",
            "data.seq_len=32", "train.micro_batch_size=1", "train.global_batch_size=2",
            "parallel.tp=2", "parallel.pp=1", "parallel.dp=2", "optimizer.warmup_steps=2"],
}
KILLED_RANK = 1  # not the logging rank in either layout: its generation_started stays a survivor's
GOAL_RATIO = 0.3  # issue 33: fault -> first step <= 0.3x today's relaunch


def base_overrides(workload: str, args) -> list[str]:
    return [*WORKLOADS[workload], f"train.steps={args.steps}",
            f"checkpoint.interval={args.interval}", "logging.tensorboard=false",
            "train.eval_batches=0"]


def kill_faults(steps: list[int]) -> str:
    return "faults=" + json.dumps([{"kind": "kill", "rank": KILLED_RANK, "step": s}
                                   for s in steps])


# --- what a run's records say --------------------------------------------------------

def generation_before(rows: list[dict], t: float) -> int:
    return max((r.get("generation", 0) for r in rows if r["time"] < t), default=0)


def fault_window(events: list[dict], t: float) -> float:
    """Until the next fault fires, or for ever: what one fault's recovery may own."""
    return min((e["time"] for e in events if e["event"] == "fault_injected" and e["time"] > t),
               default=float("inf"))


def phases_between(events: list[dict], start: float, end: float) -> list[dict]:
    """Rank 0's start-up phases that ended in [start, end], each with its own
    seconds and when it ended, from the fault."""
    return [{"phase": e["phase"], "seconds": e["seconds"], "ended_after_fault_s": e["time"] - start,
             **({"bytes": e["bytes"]} if "bytes" in e else {})}
            for e in events if e["event"] == "startup_phase" and e.get("rank") == 0
            and start <= e["time"] <= end]


def recovery(events: list[dict], rows: list[dict], fault: dict) -> dict:
    """One fault's recovery: fault -> the first step row of a newer generation
    (a row of the old one can land just after the fault: the logging rank is
    another stage), the steps done before it that were trained again, what
    was loaded and moved, and whether the surviving ranks kept their processes."""
    t, until = fault["time"], fault_window(events, fault["time"])
    old = generation_before(rows, t)
    first = next((r for r in rows if r["time"] > t and r.get("generation", 0) > old), None)
    done = max((r["step"] for r in rows if r["time"] < t), default=0)
    redone = [r["step"] for r in rows if t < r["time"] < until and r["step"] <= done]
    window = [e for e in events if t <= e["time"] <= until]
    restarts = [e for e in window if e["event"] == "restart"]
    end = first["time"] if first else until
    # The load the training went on from: the last before its first step.
    load = next((e for e in reversed(window) if e["event"] == "checkpoint_loaded"
                 and e["time"] <= end), None)
    load_phase = next((p for p in reversed(phases_between(events, t, end)) if "bytes" in p), None)
    # The logging rank's process in the generation before the fault and in
    # those up to the first step after it (that rank is never the one killed).
    starts = [e for e in events if e["event"] == "generation_started"]
    before = [e for e in starts if e["time"] < t][-1:]
    started = [e["process_started"] for e in before + [e for e in starts if t < e["time"] <= end]]
    return {
        "fault_step": fault["step"], "fault_time": t,
        "fault_to_first_step_s": first["time"] - t if first else None,
        "first_step_after": first["step"] if first else None,
        "steps_lost": len(redone),
        "restart_kinds": [e["kind"] for e in restarts],
        "standby_used": next((e.get("standby") for e in restarts if e["kind"] == "replace"), None),
        "pid": next((e.get("pid") for e in restarts if e["kind"] == "replace"), None),
        "lost_pid": next((e.get("lost_pid") for e in restarts if e["kind"] == "replace"), None),
        "loaded_tier": load and load.get("tier"), "loaded_step": load and load["step"],
        "from_peers": load and load.get("from_peers"),
        # The live load's transfer; a checkpoint load's bytes read (its phase's).
        "bytes_moved": (load.get("bytes_moved") if load and load.get("tier") == "live"
                        else load_phase and load_phase["bytes"]),
        "survivors_kept": ("relaunch" not in [e["kind"] for e in restarts]
                           and len(set(started)) == 1),
        # A replacement's restart is recorded by the agent as it starts the
        # process; a relaunch's by the new rank 0, once it has imported.
        "restart_recorded_after_s": restarts[0]["time"] - t if restarts else None,
        # The logging rank's process: a relaunch's new one starts here.
        "logging_process_started_after_s": next(
            (e["process_started"] - t for e in events if e["event"] == "generation_started"
             and t < e["time"] <= end), None),
        "phases": phases_between(events, t, end),
        # Generations that failed before the one that trained: each its own
        # live load (or none) and the ranks' errors while setting up.
        "loads_before_first_step": sum(e["event"] == "checkpoint_loaded" for e in window
                                       if e["time"] <= end),
        "setup_errors": [{"rank": e.get("rank"), "after_fault_s": e["time"] - t,
                          "error": e.get("error", "")[:120]} for e in window
                         if e["event"] == "worker_error" and e.get("section") == "setup"
                         and e["time"] <= end],
    }


def analyse_run(run_dir: Path, reference_final: dict) -> dict:
    events, rows = read_events(run_dir), step_records(run_dir)
    faults = [e for e in events if e["event"] == "fault_injected"]
    final = rows[-1] if rows else {}
    goodput = json.loads((run_dir / "goodput.json").read_text()) \
        if (run_dir / "goodput.json").exists() else {}
    return {
        "faults": [recovery(events, rows, f) for f in faults],
        "final_step": final.get("step"), "final_loss": final.get("loss"),
        "final_loss_bit_equal": (final.get("step") == reference_final["step"]
                                 and final.get("loss") == reference_final["loss"]),
        "steps_trained_again": len(rows) - len({r["step"] for r in rows}),
        "goodput": {k: goodput.get(k) for k in ("goodput", "wall_s", "productive_s",
                                                 "restarts_s", "recomputed_s", "startup_s")},
    }


# --- running the arms ----------------------------------------------------------------

def run_one(overrides: list[str], run_dir: Path, timeout_s: float) -> dict:
    shutil.rmtree(run_dir, ignore_errors=True)
    run_dir.parent.mkdir(parents=True, exist_ok=True)
    launch = run_training(RECIPE, overrides, run_dir, log=run_dir.with_suffix(".log"),
                          timeout_s=timeout_s)
    # The records stay; the checkpoints (GBs at 1 GB) do not.
    shutil.rmtree(run_dir / "checkpoints", ignore_errors=True)
    return {"exit_code": launch.exit_code, "wall_s": launch.ended - launch.started}


def rotated(names: list[str], by: int) -> list[str]:
    """Each repetition starts with a different arm: none always runs first."""
    return names[by % len(names):] + names[:by % len(names)]


def bench_workload(workload: str, args, work: Path, save) -> dict:
    """The workload's reference, then its arms interleaved; `save(done)`
    after every run, so a run cut short still leaves what it measured."""
    base = base_overrides(workload, args)
    reference_dir = work / workload / "reference"
    reference = run_one(base, reference_dir, args.timeout)
    reference_final = step_records(reference_dir)[-1]
    print(f"{workload} reference: {reference} final {reference_final['loss']!r}", flush=True)
    done = {"overrides": base, "reference": {**reference, "final": reference_final},
            "runs": []}
    for rep in range(args.reps):
        for arm in rotated(list(ARMS), rep):
            run_dir = work / workload / f"{arm}-{rep}"
            overrides = [*base, *ARMS[arm], kill_faults(args.fault_steps)]
            row = {"workload": workload, "arm": arm, "rep": rep,
                   "load_before": os.getloadavg(), **run_one(overrides, run_dir, args.timeout)}
            row.update(analyse_run(run_dir, reference_final), load_after=os.getloadavg())
            print(json.dumps({k: row[k] for k in ("workload", "arm", "rep", "exit_code",
                                                   "final_loss_bit_equal")}),
                  [(f["fault_to_first_step_s"], f["steps_lost"], f["restart_kinds"])
                   for f in row["faults"]], flush=True)
            done["runs"].append(row)
            save(done)
    return done


# --- the summary ---------------------------------------------------------------------

def summarise(runs: list[dict]) -> dict:
    """Per workload and arm: medians over every fault of every repetition."""
    out: dict = {}
    for workload in dict.fromkeys(r["workload"] for r in runs):
        for arm in ARMS:
            mine = [r for r in runs if r["workload"] == workload and r["arm"] == arm]
            faults = [f for r in mine for f in r["faults"]]
            times = [f["fault_to_first_step_s"] for f in faults
                     if f["fault_to_first_step_s"] is not None]
            out.setdefault(workload, {})[arm] = {
                "faults": len(faults),
                "fault_to_first_step_s_median": statistics.median(times) if times else None,
                "fault_to_first_step_s": times,
                "steps_lost": [f["steps_lost"] for f in faults],
                "bytes_moved": [f["bytes_moved"] for f in faults],
                "survivors_kept": [f["survivors_kept"] for f in faults],
                "restart_kinds": [f["restart_kinds"] for f in faults],
                "final_loss_bit_equal": [r["final_loss_bit_equal"] for r in mine],
                "goodput": [r["goodput"]["goodput"] for r in mine],
            }
        relaunch = out[workload]["relaunch"]["fault_to_first_step_s_median"]
        for arm, row in out[workload].items():
            mine = row["fault_to_first_step_s_median"]
            row["ratio_to_relaunch"] = mine / relaunch if mine and relaunch else None
    return out


def clean(fault: dict) -> bool:
    """A recovery in one go: one restart, one load, a first step after it."""
    return (len(fault["restart_kinds"]) == 1 and fault["loads_before_first_step"] == 1
            and fault["fault_to_first_step_s"] is not None)


def stretches(fault: dict) -> dict:
    """Fault -> first step cut into what rank 0 went through: until its first
    start-up phase began (detection and teardown; a relaunch's new processes
    starting and importing), each phase, and from the last phase to the end
    of the first step."""
    phases = fault["phases"]
    cut = {"before the first phase": phases[0]["ended_after_fault_s"] - phases[0]["seconds"]}
    for p in phases:
        cut[p["phase"]] = p["seconds"]
    cut["first step"] = fault["fault_to_first_step_s"] - phases[-1]["ended_after_fault_s"]
    return cut


def breakdown(runs: list[dict]) -> dict:
    """Per workload and arm, the median of each stretch over clean recoveries."""
    out: dict = {}
    for workload in dict.fromkeys(r["workload"] for r in runs):
        for arm in ARMS:
            cuts = [stretches(f) for r in runs if r["workload"] == workload and r["arm"] == arm
                    for f in r["faults"] if clean(f) and f["phases"]]
            names = list(dict.fromkeys(n for c in cuts for n in c))
            out.setdefault(workload, {})[arm] = {
                "recoveries": len(cuts),
                **{n: statistics.median(c[n] for c in cuts if n in c) for n in names}}
    return out


def breakdown_table(cut: dict) -> str:
    lines = ["| workload | arm | recoveries | stretch: median s |", "| --- | --- | --- | --- |"]
    for workload, arms in cut.items():
        for arm, row in arms.items():
            parts = "; ".join(f"{n} {v:.2f}" for n, v in row.items() if n != "recoveries")
            lines.append(f"| {workload} | {arm} | {row['recoveries']} | {parts} |")
    return "\n".join(lines)


def number(value: Optional[float]) -> str:
    return "-" if value is None else f"{value:.2f}"


def table(summary: dict) -> str:
    lines = ["| workload | arm | fault -> first step s (median; each) | ratio to relaunch | "
             "steps lost | bytes moved | survivors kept | final loss bit-equal | goodput |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for workload, arms in summary.items():
        for arm, r in arms.items():
            each = ", ".join(f"{t:.1f}" for t in r["fault_to_first_step_s"])
            median = r["fault_to_first_step_s_median"]
            lines.append(
                f"| {workload} | {arm} | {median:.2f} ({each}) | {number(r['ratio_to_relaunch'])} | "
                f"{r['steps_lost']} | {sorted(set(r['bytes_moved']), key=str)} | "
                f"{r['survivors_kept'].count(True)} of {len(r['survivors_kept'])} | "
                f"{r['final_loss_bit_equal'].count(True)} of {len(r['final_loss_bit_equal'])} | "
                f"{', '.join(f'{g:.1%}' for g in r['goodput'] if g is not None)} |"
                if median is not None else f"| {workload} | {arm} | - | - | {r['steps_lost']} "
                f"| - | - | - | - |")
    return "\n".join(lines)


def git_commit() -> str:
    return subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True,
                          check=False).stdout.strip()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--reps", type=int, default=2)
    parser.add_argument("--workloads", nargs="+", choices=sorted(WORKLOADS),
                        default=["demo", "1gb"])
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--interval", type=int, default=4, help="global checkpoint interval")
    parser.add_argument("--fault-steps", type=int, nargs="+", default=[7, 11],
                        help="rank 1 is killed as each of these steps starts")
    parser.add_argument("--timeout", type=float, default=600.0, help="per run, seconds")
    parser.add_argument("--out", default="bench/results")
    parser.add_argument("--work", default="/tmp/megaresil-bench-replacement")
    parser.add_argument("--analyse-only", action="store_true",
                        help="no runs: analyse again the runs in --work that --out's "
                             "replacement.json lists (after a change to the analysis)")
    args = parser.parse_args()
    if args.analyse_only:
        analyse_again(Path(args.out) / "replacement.json", Path(args.work))
        return
    # Every start-up phase gets its event (not only those over 2 s): the breakdown.
    os.environ[THRESHOLD_ENV] = "0"
    started, load_before, commit = time.time(), os.getloadavg(), git_commit()
    work, workloads = Path(args.work), {}

    def save(workload: str, done: dict) -> dict:
        workloads[workload] = done
        return write_results(args, workloads, started, load_before, commit)
    for w in args.workloads:
        bench_workload(w, args, work, lambda done, w=w: save(w, done))
    result = write_results(args, workloads, started, load_before, commit)
    print(table(result["summary"]), breakdown_table(result["breakdown"]), sep="\n\n")
    print(f"load average (1 min) {load_before[0]:.1f} -> {result['load_after'][0]:.1f} on "
          f"{os.cpu_count()} cores; {result['elapsed_s']:.0f} s")


def analyse_again(path: Path, work: Path) -> None:
    """The same runs' records, read by this version of the analysis; what
    only the run itself knew (exit code, wall time, load) is kept."""
    result = json.loads(path.read_text())
    for workload, done in result["workloads"].items():
        final = done["reference"]["final"]
        for row in done["runs"]:
            row.update(analyse_run(work / workload / f"{row['arm']}-{row['rep']}", final))
    runs = [r for w in result["workloads"].values() for r in w["runs"]]
    result.update(summary=summarise(runs), breakdown=breakdown(runs),
                  analysed_again_at=git_commit())
    path.write_text(json.dumps(result, indent=1))
    print(table(result["summary"]), breakdown_table(result["breakdown"]), sep="\n\n")


def write_results(args, workloads: dict, started: float, load_before: tuple,
                  commit: str) -> dict:
    runs = [r for w in workloads.values() for r in w["runs"]]
    summary = summarise(runs)
    example = train_command(RECIPE, [*base_overrides(args.workloads[0], args),
                                     *ARMS["replace_standby"], kill_faults(args.fault_steps)],
                            Path(args.work) / "RUN")
    result = {"command": " ".join(["python", "bench/replacement.py", *sys.argv[1:]]),
              "train_command_example": example, "git_commit": commit,
              "arms": ARMS, "killed_rank": KILLED_RANK, "fault_steps": args.fault_steps,
              "steps": args.steps, "checkpoint_interval": args.interval, "reps": args.reps,
              "goal_ratio": GOAL_RATIO, "cpus": os.cpu_count(),
              "load_before": load_before, "load_after": os.getloadavg(),
              "elapsed_s": time.time() - started, "summary": summary,
              "breakdown": breakdown(runs), "workloads": workloads}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "replacement.json").write_text(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()
