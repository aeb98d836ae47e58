"""Loss-spike false alarms on a healthy run (issue 46): the demo
(recipes/gpt-tiny.yaml) trained at one process with the defaults for
`--steps` steps, the alarms its detector raised counted, and its recorded
loss curve replayed offline through the detector at other windows: the rule
of 5b7716d (median and MAD of the window, spikes never join it, no level
shift) beside today's (resilience/numerics.py: LossWatch and find_spike).

    python bench/spike_alarms.py [--steps 1200] [--out bench/results]
    python bench/spike_alarms.py --run-dir DIR   # a demo run already trained

Every step of a healthy run that the detector calls a spike is a false
alarm. Results: OUT/spike_alarms.{json,md}; the curve ([step, loss], ...):
OUT/spike_alarms_curve.json (tests/unit/test_spike_detector.py replays it).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from megaresil.config import load_recipe
from megaresil.events import read_events, read_metrics
from megaresil.resilience.numerics import LossWatch, WatchSizes, find_spike

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_OUT = ROOT / "bench" / "results"
DEMO = ["recipes/gpt-tiny.yaml", "parallel.tp=1", "parallel.pp=1", "parallel.dp=1",
        "logging.tensorboard=false", "logging.progress=false", "checkpoint.interval=0"]
WINDOWS = (5, 10, 20, 50)
THRESHOLD = 6.0  # the default
# The first steps a run of the demo's own length (train.steps=250) would train.
DEMO_LENGTH = 250


def train(steps: int, run_dir: Path) -> float:
    """The demo at one process with the numerics defaults; its seconds."""
    started = time.time()
    subprocess.run([sys.executable, "-m", "megaresil", "train", *DEMO, f"train.steps={steps}",
                    f"run.dir={run_dir}"], cwd=ROOT, check=True)
    return round(time.time() - started)


def recorded(run_dir: Path) -> dict:
    """A healthy run's curve and the alarms its own detector raised."""
    return {"curve": [[r["step"], r["loss"]] for r in read_metrics(run_dir) if "loss" in r],
            "live_alarms": [e["step"] for e in read_events(run_dir) if e["event"] == "loss_spike"]}


def replay_today(curve: list, window: int, threshold: float, warmup: int,
                 level_shift: int) -> dict:
    """The detector as the trainer runs it under on_spike=warn."""
    watch, sizes = LossWatch(), WatchSizes(window, 1, level_shift)
    alarms, shifts, largest = [], [], -math.inf
    for step, loss in curve:
        measured = find_spike(loss, watch.losses, window, -math.inf) if step > warmup else None
        spike = measured is not None and measured.deviations > threshold
        largest = max(largest, measured.deviations if measured else -math.inf)
        if spike:
            alarms.append(step)
        if watch.applied(step, 0, loss, spike, sizes):
            shifts.append(step)
    return {"alarms": alarms, "level_shifts": shifts, "largest": round(largest, 2)}


def replay_5b7716d(curve: list, window: int, threshold: float, warmup: int) -> dict:
    """The detector of 5b7716d: MAD, a spike never joins the window."""
    losses, alarms, largest = [], [], -math.inf
    for step, loss in curve:
        recent = losses[-window:]
        if step > warmup and len(recent) == window:
            median = statistics.median(recent)
            mad = statistics.median(abs(x - median) for x in recent)
            deviations = (loss - median) / max(1.4826 * mad, 0.01 * abs(median))
            largest = max(largest, deviations)
            if deviations > threshold:
                alarms.append(step)
                continue
        losses.append(loss)
    return {"alarms": alarms, "level_shifts": [], "largest": round(largest, 2)}


def replays(curve: list) -> list[dict]:
    cfg = load_recipe(ROOT / DEMO[0], DEMO[1:])
    warmup, level_shift = cfg.optimizer.warmup_steps, cfg.resilience.numerics.spike_level_shift
    rows = []
    for window in WINDOWS:
        for steps in sorted({min(DEMO_LENGTH, len(curve)), len(curve)}):
            part = curve[:steps]
            rows.append({"window": window, "steps": len(part), "threshold": THRESHOLD,
                         "5b7716d": replay_5b7716d(part, window, THRESHOLD, warmup),
                         "today": replay_today(part, window, THRESHOLD, warmup, level_shift)})
    return rows


def markdown(report: dict) -> str:
    run = report["run"]
    lines = ["# Loss-spike false alarms on a healthy run", "",
             f"`python bench/spike_alarms.py`, {run['date']}, {run['machine']}; the demo "
             f"trained by `{run['command']}`"
             + (f" in {run['seconds']} s at load average {run['load_average']}."
                if run["seconds"] else " beforehand (--run-dir)."), "",
             f"The demo trained {len(report['curve'])} steps at one process with the defaults "
             f"(spike_window=50, spike_threshold=6): its detector raised "
             f"{len(report['live_alarms'])} alarm(s) {report['live_alarms']}.", "",
             "Its curve replayed offline (on_spike=warn; alarms are false alarms):", "",
             "| spike_window | steps | alarms, 5b7716d (steps) | alarms, today (steps) | "
             "level shifts, today | the largest deviation seen, 5b7716d / today |",
             "| --- | --- | --- | --- | --- | --- |"]
    for r in report["replays"]:
        old, new = r["5b7716d"], r["today"]
        lines.append(f"| {r['window']} | {r['steps']} | {len(old['alarms'])} {old['alarms'][:6]} "
                     f"| {len(new['alarms'])} {new['alarms'][:6]} | "
                     f"{len(new['level_shifts'])} | {old['largest']} / {new['largest']} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=1200)
    parser.add_argument("--run-dir", type=Path, help="a healthy demo run to read, not train")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    run = {"date": time.strftime("%Y-%m-%d %H:%M"),
           "machine": f"{os.cpu_count()} CPUs, {platform.machine()}",
           "load_average": round(os.getloadavg()[0], 2)}
    if args.run_dir:
        report, run["seconds"] = recorded(args.run_dir), None
    else:
        with tempfile.TemporaryDirectory() as tmp:
            run["seconds"] = train(args.steps, Path(tmp) / "demo")
            report = recorded(Path(tmp) / "demo")
    run["command"] = f"megaresil train {' '.join(DEMO)} train.steps={len(report['curve'])}"
    report.update(run=run, replays=replays(report["curve"]))
    (args.out / "spike_alarms_curve.json").write_text(json.dumps(report["curve"]))
    (args.out / "spike_alarms.json").write_text(
        json.dumps({k: v for k, v in report.items() if k != "curve"}, indent=1))
    (args.out / "spike_alarms.md").write_text(markdown(report))
    print(markdown(report))


if __name__ == "__main__":
    main()
