"""`megaresil soak`: one long run with faults of every kind at seeded random
steps and sections, then a fault-free reference to the same step; proof
over time, not scenarios.

A short calibration run sizes the steps and the episodes (schedule.py) to
--minutes, or the steps to --episodes; the faulted run is requeued after a preemption, with CPU hogs
beside it if asked, and the local tier on unless `local=False`. The report
(console and soak.json) counts faults injected, detected and recovered, false
alarms, steps and time lost, goodput, and whether the final checkpoint and
every loss equal the reference's. docs/fault-tolerance.md ("megaresil soak",
"How the soak schedules faults") describes it for users."""
from __future__ import annotations

import json
import shutil
import statistics
import time
from dataclasses import asdict
from pathlib import Path
from typing import Optional

from megaresil.config import ConfigError, load_recipe
from megaresil.drills.analyse import NO_ALARM_KINDS, analyse_soak
from megaresil.drills.run import Launch, start_hogs, step_records
from megaresil.drills.scenarios import local_tier_settings
from megaresil.drills.schedule import (
    GIL_TIMEOUT_S,
    KEEP,
    SAVE_INTERVAL,
    Calibration,
    catalogue,
    fit,
    fit_episodes,
    gil_timeout,
    schedule,
)
from megaresil.drills.soak_nodes import check_nodes, is_node_fault, open_jobs
from megaresil.observe.report import write_report
from megaresil.safe_files import write_atomic

CALIBRATION_STEPS = 6


def soak_settings(world_faults: int, gil_timeout_s: float = GIL_TIMEOUT_S) -> list[str]:
    """Restarts on (whatever the defaults), sized to the faults; async saves
    (the local tier's settings are added by run_soak)."""
    restarts = 2 * world_faults + 2
    return ["checkpoint.async=true", f"checkpoint.interval={SAVE_INTERVAL}",
            f"checkpoint.keep={KEEP}", "resilience.in_process=true",
            f"resilience.max_in_process_restarts={restarts}",
            f"resilience.max_restarts={restarts}",
            f"resilience.watchdog.gil_timeout_s={gil_timeout_s}", "logging.tensorboard=false"]


def run_dir_overrides(run_dir: Path) -> list[str]:
    # Each run keeps its checkpoints in its own directory, whatever checkpoint.dir says.
    return [f"checkpoint.dir={run_dir / 'checkpoints'}"]


def calibrate(jobs, recipe: str, overrides: list[str], run_dir: Path) -> Calibration:
    shutil.rmtree(run_dir, ignore_errors=True)
    launch, link = jobs.calibrate(recipe, [*overrides, f"train.steps={CALIBRATION_STEPS}",
                                           *run_dir_overrides(run_dir)], run_dir,
                                  log=_log(run_dir, "train.log"), steps=CALIBRATION_STEPS)
    records = step_records(run_dir)
    if launch.exit_code != 0 or len(records) < CALIBRATION_STEPS:
        raise RuntimeError(f"the calibration run failed (exit {launch.exit_code}); "
                           f"see {run_dir / 'train.log'}")
    durations = [b["elapsed_s"] - a["elapsed_s"] for a, b in zip(records, records[1:])]
    startup = records[0]["time"] - records[0]["elapsed_s"] - launch.started
    return Calibration(startup_s=startup, step_s=statistics.median(durations[1:]),
                       link_bytes_per_s=link)


def _log(run_dir: Path, name: str) -> Path:
    run_dir.mkdir(parents=True, exist_ok=True)
    return run_dir / name


def run_soak(recipe: str, overrides: list[str], *, minutes: Optional[float] = None,
             episodes: Optional[int] = None, seed: int, hogs: int = 0, local: bool = True,
             hosts: str = "local") -> dict:
    """Calibrate, run the faulted job (hogs beside it), then the reference,
    all with the local tier when `local`, all on `hosts` (soak_nodes.py);
    sized to `minutes` or to exactly `episodes` (one of them). The report is
    also written to RUN_DIR/soak.json."""
    if episodes is not None and episodes < 1:
        raise ConfigError("--episodes", f"a soak runs at least one episode, not {episodes}",
                          "give --episodes 1 or more")
    if local:
        p = load_recipe(recipe, overrides).parallel
        overrides = [*local_tier_settings(p.world_size), *overrides]
    cfg = load_recipe(recipe, overrides)
    nodes = hosts == "netns"
    if nodes:
        check_nodes(cfg)
    root = Path(cfg.run.dir)
    with open_jobs(hosts, cfg.parallel.world_size) as jobs:
        hog_procs = start_hogs(hogs)
        try:
            cal = calibrate(jobs, recipe, overrides + soak_settings(len(catalogue(cfg, nodes))),
                            root / "calibration")
            count, steps, minutes = size_soak(cal, cfg, minutes, episodes, seed, nodes)
            placed = schedule(cfg, seed, steps, count, nodes)
            faults = [f for p in placed for f in p["faults"] if not is_node_fault(f)]
            node_faults = [f for p in placed for f in p["faults"] if is_node_fault(f)]
            run_overrides = [*overrides, *soak_settings(len(faults) + len(node_faults),
                                                        gil_timeout(cal, cfg, nodes)),
                             f"train.steps={steps}"]
            print(f"soak: {count} episodes, {len(faults) + len(node_faults)} faults "
                  f"({len(node_faults)} of a node's link) over {steps} steps (step "
                  f"{cal.step_s:.2f} s, start-up {cal.startup_s:.0f} s, hosts {hosts})", flush=True)
            launches, strikes = run_faulted(jobs, recipe, run_overrides, root / "faulted", faults,
                                            node_faults, minutes, cal, cfg)
        finally:
            for proc in hog_procs:
                proc.kill()
                proc.wait()
        reference = root / "reference"
        shutil.rmtree(reference, ignore_errors=True)
        # The reference is fault-free: three times its expected time is a deadlock.
        expected = cal.startup_s + steps * cal.step_s
        ref_launch = jobs.train(recipe, [*run_overrides, *run_dir_overrides(reference)],
                                reference, log=_log(reference, "train.log"),
                                timeout_s=3 * expected + 120)
    report = analyse_soak(root / "faulted", reference, placed, launches, cfg, steps, strikes)
    report.update(seed=seed, minutes=minutes, hogs=hogs, hosts=hosts, steps=steps,
                  episodes=count, local_tier=cfg.checkpoint.local.enabled,
                  calibration=asdict(cal), reference_exit_code=ref_launch.exit_code,
                  schedule=placed, strikes=strikes, faulted=str(root / "faulted"),
                  reference=str(reference))
    report["ok"] = report["ok"] and ref_launch.exit_code == 0
    report["report"] = str(write_report(root / "faulted", [reference], root / "report"))
    write_atomic(root / "soak.json", json.dumps(report, indent=1))
    return report


def size_soak(cal: Calibration, cfg, minutes: Optional[float], episodes: Optional[int],
              seed: int, nodes: bool) -> tuple[int, int, float]:
    """(episodes, steps, minutes): fitted to the minutes, or the steps and
    the estimated minutes of exactly `episodes`."""
    if episodes is None:
        assert minutes is not None, "a soak is sized by --minutes or --episodes"
        return *fit(cal, cfg, minutes, seed, nodes), minutes
    return episodes, *fit_episodes(cal, cfg, episodes, seed, nodes)


def run_faulted(jobs, recipe: str, overrides: list[str], run_dir: Path, faults: list[dict],
                node_faults: list[dict], minutes: float, cal: Calibration,
                cfg) -> tuple[list[Launch], list[dict]]:
    """The faulted job, requeued after each preemption, its node episodes
    struck by `jobs` (on nodes); a job deadlocked past three times its
    budget (plus two minutes) is killed and reported. Returns the launches
    and the strikes."""
    shutil.rmtree(run_dir, ignore_errors=True)
    sigterms = sum(f["kind"] == "sigterm" for f in faults)
    deadline = time.time() + 3 * minutes * 60 + 120
    return jobs.faulted(recipe, [*overrides, f"faults={json.dumps(faults)}",
                                 *run_dir_overrides(run_dir)], run_dir, node_faults,
                        requeues=sigterms, log=_log(run_dir, "train.log"), deadline=deadline,
                        cal=cal, cfg=cfg)


def format_report(r: dict) -> str:
    def seconds(v):
        return "-" if v is None else f"{v:.1f}"
    head = (f"{'step':>5} {'episode':<28} {'fault':<24} {'rank':>4} {'section':<16} "
            f"{'detected':>8} {'recovered':>9} {'lost':>4} {'time lost':>9}")
    lines = [head]
    for f in r["faults"]:
        kind = f["kind"] + (f"/{f['mode']}" if f["mode"] else "")
        detected = (seconds(f["detection_latency_s"]) + " s" if f["detected"] else
                    "n/a" if f["kind"] in NO_ALARM_KINDS else "ridden" if f.get("ridden_out")
                    else "not read" if f.get("not_read") else "no")
        who = f"n{f['node']}" if f["rank"] is None else str(f["rank"])  # a node episode's node
        lines.append(f"{f['step']:>5} {f['episode']:<28} {kind:<24} {who:>4} "
                     f"{f['section']:<16} {detected if f['injected'] else 'NOT FIRED':>8} "
                     f"{str(f['recovered']):>9} {f['steps_lost']:>4} "
                     f"{seconds(f['time_lost_s']):>7} s")
    rows = r["faults"]
    detectable = [f for f in rows if f["kind"] not in NO_ALARM_KINDS and not f.get("not_read")
                  and not f.get("ridden_out")]
    nodes = [f for f in rows if f["rank"] is None]
    lines += [
        "",
        f"steps {r['steps']}, seed {r['seed']}, hogs {r['hogs']}, hosts "
        f"{r.get('hosts', 'local')}, local tier "
        f"{'on' if r.get('local_tier') else 'off'}, launches "
        f"{len(r['launches'])} (exit codes {[x['exit_code'] for x in r['launches']]})",
        f"node episodes: struck {sum(f['injected'] for f in nodes)}/{len(nodes)}, flaps "
        f"detected {sum(f['detected'] for f in nodes)} (ridden out "
        f"{sum(bool(f.get('ridden_out')) for f in nodes)}), recovered "
        f"{sum(f['recovered'] for f in nodes)}/{len(nodes)}" if nodes else "node episodes: none",
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
