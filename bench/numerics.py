"""What the numerical checks cost and what they catch (issue 31), in one run.

    python bench/numerics.py [--rounds 5] [--steps 24] [--out bench/results] [--quick]
        [--part all|overhead|campaign]

`--part` runs one half and keeps the other from OUT/numerics.json (each half
records the date and load it was measured at).

**Overhead.** The CPU demo's model (recipes/gpt-tiny.yaml, tp=1 pp=1 dp=2,
two gloo processes) trains the same steps with every check off, with each
check alone, and with the defaults, the variants alternating in rounds (each
round starting one variant later) in the same, warmed-up processes. A step's time is the time between consecutive steps'
metrics lines, so it includes the replica check, which runs between steps.
Two figures per variant:

- the ratio of its median step time to the checks-off run's of the same
  round, as the median (and range) over the rounds: side by side, but on
  2 shared cores a few percent of it is noise (the range shows how much);
- the time the checks themselves took inside its steps, as a share of its
  step time, far less noisy: rank 0's (its waits at the checks'
  collectives for the other rank included: an upper bound), and per call
  the fastest rank's (the rank that arrived last waits for no one: the
  checks' own cost).

**Bit-flip campaign.** Flips at random ranks, tensors, elements and bits
(every bit of fp32: mantissa 0-22, exponent 23-30, sign 31), by class:

- `param`, dp=4: a parameter element of one replica, after its update; the
  replica checksum must find it at that step, name the rank (odd one out)
  and restore it; the run must end bit-equal to the same run without flips.
- `param`, tp=2 x dp=2: the same at dp=2, where only a replay from the newest
  checkpoint names the replica.
- `grad`, dp=4: a gradient element of one replica after the data-parallel
  reduction (the update then differs on that replica).
- `grad`, dp=1: a gradient element no replica can be compared on (the same
  class as a flip before the reduction, which reaches every replica alike):
  one short run per flip, against the fault-free losses. Caught means the
  non-finite check or the spike detector (on_spike=warn) reported it.

Detections in the fault-free reference runs are false alarms. Results:
OUT/numerics.json and OUT/numerics.md.
"""
from __future__ import annotations

import argparse
import functools
import json
import os
import platform
import random
import statistics
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from megaresil.config import load_recipe
from megaresil.events import EventLog, read_events, read_metrics
from megaresil.parallel.layout import ParallelLayout
from megaresil.ports import free_port
from megaresil.resilience.faults import FaultInjector
from megaresil.resilience.supervision import Supervision
from megaresil.train import numerics as numerics_guard
from megaresil.train.loop import Trainer
from megaresil.train.numerics import NumericsGuard
from megaresil.train.replicas import ReplicaCheck

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_OUT = ROOT / "bench" / "results"
DEMO = ROOT / "recipes" / "gpt-tiny.yaml"
QUIET = ["logging.progress=false", "logging.tensorboard=false", "train.eval_batches=0",
         "checkpoint.interval=0"]
# The campaign's model: small, so hundreds of flips take minutes.
TINY = ["parallel.tp=1", "parallel.pp=1", "parallel.dp=1", "data.source=synthetic", "data.seq_len=16", "model.max_seq_len=16", "model.num_layers=2",
        "model.hidden_size=64", "model.num_heads=8", "model.vocab_size=300",
        "train.micro_batch_size=2", "optimizer.warmup_steps=2", "optimizer.lr=3e-3", *QUIET]
OFF = ["resilience.numerics.enabled=false", "resilience.numerics.on_spike=none",
       "resilience.numerics.check_interval=0"]
VARIANTS = {
    "all checks off": OFF,
    "non-finite check only": ["resilience.numerics.on_spike=none",
                              "resilience.numerics.check_interval=0"],
    "spike detector only": ["resilience.numerics.enabled=false",
                            "resilience.numerics.check_interval=0"],
    "replica check only, every step": ["resilience.numerics.enabled=false",
                                       "resilience.numerics.on_spike=none"],
    "replica check only, every 10 steps": ["resilience.numerics.enabled=false",
                                           "resilience.numerics.on_spike=none",
                                           "resilience.numerics.check_interval=10"],
    "defaults (all on)": [],
}
DETECTIONS = ("silent_corruption_detected", "nonfinite_detected", "loss_spike")


def bit_class(bit: int) -> str:
    return "sign" if bit == 31 else "exponent" if bit >= 23 else "mantissa"


def train(overrides: list[str], run_dir: Path, recipe: Path = DEMO) -> Path:
    cfg = load_recipe(recipe, [*overrides, f"run.dir={run_dir}"])
    layout = ParallelLayout.from_config(cfg.parallel, torch.device("cpu"))
    faults = FaultInjector(cfg.faults, rank=layout.rank, run_dir=run_dir,
                           checkpoint_root=run_dir / "checkpoints",
                           events=EventLog(run_dir, layout.rank))
    Trainer(cfg, layout, Supervision(faults=faults)).run()
    if dist.is_initialized():
        dist.barrier()
    return run_dir


def step_periods(run_dir: Path, skip: int) -> list[float]:
    rows = [r for r in read_metrics(run_dir) if "loss" in r]
    return [b["time"] - a["time"] for a, b in zip(rows, rows[1:]) if a["step"] >= skip]


# --- overhead ----------------------------------------------------------------------

# What each check runs inside a step, timed by `time_checks`: the
# non-finite check's RNG snapshot (for a replay) and verdict, the spike
# detector, and the replica check (its collectives included).
CHECKED = {"non-finite check": [(numerics_guard, "rng_snapshot"), (NumericsGuard, "holds_back")],
           "spike detector": [(NumericsGuard, "spike_in")],
           "replica check": [(ReplicaCheck, "check")]}


def time_checks(calls: list[float]) -> None:
    """Wrap each check's functions so that each outermost call's time is
    appended to `calls` (the spike detector runs inside holds_back)."""
    depth = [0]

    def timed(fn):
        @functools.wraps(fn)
        def wrapper(*a, **kw):
            started = time.perf_counter()
            depth[0] += 1
            try:
                return fn(*a, **kw)
            finally:
                depth[0] -= 1
                if not depth[0]:
                    calls.append(time.perf_counter() - started)
        return wrapper

    for places in CHECKED.values():
        for owner, attr in places:
            setattr(owner, attr, timed(getattr(owner, attr)))


def check_seconds(calls: list[float]) -> tuple[float, float]:
    """The run's time inside the checks: rank 0's, and the sum over calls of
    the fastest rank's. A check with a collective also waits there for the
    slowest rank, time the step would have waited for it at its next
    collective anyway; the rank that arrives last waits for no one, so its
    time is the check's own."""
    everyone: list[list[float]] = [[] for _ in range(dist.get_world_size())]
    dist.all_gather_object(everyone, calls)
    return sum(calls), sum(min(times) for times in zip(*everyone))


def overhead_worker(rank: int, port: int, args: argparse.Namespace, scratch: str) -> None:
    init(rank, port, 2)
    calls: list[float] = []
    time_checks(calls)
    runs: list[dict] = []
    layout = ["parallel.tp=1", "parallel.pp=1", "parallel.dp=2", *QUIET]
    try:
        # A first run warms the processes up (allocator, kernels); not counted.
        train([*layout, "train.steps=6"], Path(scratch) / "overhead-warmup")
        names = list(VARIANTS)
        for r in range(args.rounds):
            for v, name in enumerate(names[r % len(names):] + names[:r % len(names)]):
                run_dir = Path(scratch) / f"overhead-{r}-{v}"
                calls.clear()
                train([*layout, f"train.steps={args.steps}", *VARIANTS[name]], run_dir)
                rank0_s, own_s = check_seconds(calls)
                runs.append({"round": r, "variant": name, "periods": step_periods(run_dir, 3),
                             "check_s": rank0_s, "check_own_s": own_s, "steps": args.steps})
    finally:
        dist.destroy_process_group()
    if rank == 0:
        Path(scratch, "overhead.json").write_text(json.dumps(runs))


def overhead_table(runs: list[dict]) -> list[dict]:
    off = {r["round"]: statistics.median(r["periods"]) for r in runs
           if r["variant"] == "all checks off"}
    table = []
    for name in VARIANTS:
        mine = [r for r in runs if r["variant"] == name]
        ratios = [statistics.median(r["periods"]) / off[r["round"]] for r in mine]
        step_s = sum(r["steps"] * statistics.median(r["periods"]) for r in mine)
        table.append({"variant": name, "steps": sum(len(r["periods"]) for r in mine),
                      "median_step_s": statistics.median(p for r in mine for p in r["periods"]),
                      "ratio": statistics.median(ratios), "ratio_min": min(ratios),
                      "ratio_max": max(ratios),
                      "check_share": sum(r["check_s"] for r in mine) / step_s,
                      "check_own_share": sum(r["check_own_s"] for r in mine) / step_s})
    return table


# --- the campaign --------------------------------------------------------------------

def flips(rng: random.Random, steps: list[int], world: int, target: str) -> list[dict]:
    return [{"kind": "bitflip", "rank": rng.randrange(world), "step": s, "target": target,
             "seed": rng.randrange(2**31), "bit": rng.randrange(32)} for s in steps]


def campaign_worker(rank: int, port: int, args: argparse.Namespace, scratch: str) -> None:
    init(rank, port, 4)
    rng = random.Random(args.seed)
    n = args.flips
    plans = {  # class -> (layout, steps, faults, extra settings)
        "param, dp=4 (odd one out)": (["parallel.dp=4"], n + 4,
                                      flips(rng, list(range(3, n + 3)), 4, "param"), []),
        "param, tp=2 x dp=2 (replay)": (["parallel.tp=2", "parallel.dp=2"], 4 * (n // 2) + 4,
                                        flips(rng, list(range(4, 4 * (n // 2) + 4, 4)), 4,
                                              "param"), ["checkpoint.interval=2"]),
        "grad, dp=4 (after the reduction)": (["parallel.dp=4"], n // 2 + 4,
                                             flips(rng, list(range(3, n // 2 + 3)), 4, "grad"),
                                             []),
    }
    results = {}
    try:
        for slug, (name, (layout, steps, faults, settings)) in enumerate(plans.items()):
            common = [*TINY, *layout, "train.global_batch_size=8", f"train.steps={steps}",
                      *settings]
            reference = train(common, Path(scratch) / f"reference-{slug}")
            faulted = train([*common, f"faults={json.dumps(faults)}"],
                            Path(scratch) / f"faulted-{slug}")
            if rank == 0:
                results[name] = judge_campaign(faults, reference, faulted)
    finally:
        dist.destroy_process_group()
    if rank == 0:
        Path(scratch, "campaign.json").write_text(json.dumps(results))


def judge_campaign(faults: list[dict], reference: Path, faulted: Path) -> dict:
    events = read_events(faulted)
    fired = {(e["rank"], e["step"]): e for e in events if e["event"] == "fault_injected"}
    found = {}
    for e in events:
        if e["event"] == "silent_corruption_detected" and e.get("culprit"):
            found.setdefault(e["step"], set()).update(e["culprit"])
        if e["event"] == "silent_corruption_attributed":
            found.setdefault(e["step"], set()).update(e["culprit"])
    numeric = {e["step"] for e in events if e["event"] == "nonfinite_detected"}
    rows = []
    for f in faults:
        event = fired.get((f["rank"], f["step"]))
        rows.append({**f, "fired": event is not None, "class": bit_class(f["bit"]),
                     "changed": event is not None and event["before"] != event["after"],
                     "attributed": f["rank"] in found.get(f["step"], set()),
                     "nonfinite": f["step"] in numeric})
    final, ref = last_losses(faulted), last_losses(reference)
    return {"flips": rows, "bit_equal": final == ref,
            "false_alarms": [e for e in read_events(reference) if e["event"] in DETECTIONS],
            "extra_detections": sorted(s for s in found if s not in {f["step"] for f in faults})}


def last_losses(run_dir: Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in read_metrics(run_dir) if "loss" in r}


def unreplicated_grads(args: argparse.Namespace, scratch: Path) -> dict:
    """dp=1, one short run per flip at step 9 (the spike detector is on from
    step 8: warmup 2 and a window of 5), against the fault-free losses."""
    rng = random.Random(args.seed + 1)
    common = [*TINY, "train.global_batch_size=8", "train.steps=14",
              "resilience.numerics.spike_window=5"]
    reference = last_losses(train(common, scratch / "dp1-reference"))
    rows = []
    for i in range(args.flips // 2 + 10):
        fault = flips(rng, [9], 1, "grad")[0]
        run_dir = train([*common, f"faults={json.dumps([fault])}"], scratch / f"dp1-{i}")
        losses, events = last_losses(run_dir), read_events(run_dir)
        # Moved: beyond fp32 rounding at some later step, after any recovery.
        moved = any(abs(losses[s] - reference[s]) > 1e-6 * abs(reference[s])
                    for s in range(9, 15))
        rows.append({**fault, "class": bit_class(fault["bit"]), "moved": moved,
                     "caught": any(e["event"] in ("nonfinite_detected", "loss_spike")
                                   for e in events),
                     "ends_equal": losses[14] == reference[14]})
    return {"flips": rows, "false_alarms": [e for e in read_events(scratch / "dp1-reference")
                                            if e["event"] in DETECTIONS]}


# --- running and reporting -------------------------------------------------------------

def init(rank: int, port: int, world: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)


def spawn(worker, world: int, args: argparse.Namespace, scratch: Path) -> None:
    mp.start_processes(worker, args=(free_port(), args, str(scratch)), nprocs=world, join=True,
                       start_method="spawn")


def campaign_table(campaign: dict, dp1: dict) -> list[dict]:
    table = []
    for name, result in campaign.items():
        for cls in ("mantissa", "exponent", "sign", "all"):
            rows = [r for r in result["flips"] if r["fired"] and (cls == "all" or r["class"] == cls)]
            table.append({"class": name, "bits": cls, "flips": len(rows),
                          "attributed": sum(r["attributed"] for r in rows),
                          "caught_as_nonfinite": sum(r["nonfinite"] for r in rows),
                          "bit_equal_at_end": result["bit_equal"] if cls == "all" else None,
                          "false_alarms": len(result["false_alarms"]) if cls == "all" else None})
    for cls in ("mantissa", "exponent", "sign", "all"):
        rows = [r for r in dp1["flips"] if cls == "all" or r["class"] == cls]
        table.append({"class": "grad, dp=1 (no replica to compare)", "bits": cls,
                      "flips": len(rows), "caught": sum(r["caught"] for r in rows),
                      "caught_ended_equal": sum(r["caught"] and r["ends_equal"] for r in rows),
                      "uncaught_moved_the_loss": sum(r["moved"] and not r["caught"]
                                                     for r in rows),
                      "false_alarms": len(dp1["false_alarms"]) if cls == "all" else None})
    return table


def markdown(report: dict) -> str:
    measured = lambda run: (f"`{run['command']}`, {run['date']}, {run['machine']}, load average "
                            f"{run['load_average']} before the run, {run['seconds']} s."
                            + (f" {run['note']}" if run.get("note") else ""))
    lines = ["# Numerical checks: overhead and bit-flip campaign"]
    if "overhead_run" in report:
        lines += overhead_markdown(report, measured)
    if "campaign_run" in report:
        lines += campaign_markdown(report, measured)
    return "\n".join(lines) + "\n"


def table_start(title: str, measured_line: str, columns: list[str]) -> list[str]:
    """A section's heading, how it was measured, and its table's header."""
    return ["", f"## {title}", "", measured_line, "", "| " + " | ".join(columns) + " |",
            "|" + " --- |" * len(columns)]


def overhead_markdown(report: dict, measured) -> list[str]:
    lines = table_start("Step overhead", measured(report["overhead_run"]), [
        "variant", "median step (s)", "steps",
        "step time over checks off, median of rounds (range)",
        "inside the checks, rank 0 (waits included)",
        "inside the checks, the fastest rank's (their own cost)"])
    lines += [f"| {r['variant']} | {r['median_step_s']:.4f} | {r['steps']} | {r['ratio']:.3f} "
              f"({r['ratio_min']:.3f}-{r['ratio_max']:.3f}) | {100 * r['check_share']:.2f} % | "
              f"{100 * r['check_own_share']:.2f} % |" for r in report["overhead"]]
    return lines


def campaign_markdown(report: dict, measured) -> list[str]:
    lines = table_start("Bit flips", measured(report["campaign_run"]), [
        "class", "bits", "flips", "named and restored", "found by the non-finite check",
        "caught (dp=1: non-finite or spike)", "caught, ended bit-equal",
        "not caught, moved the loss", "run bit-equal at end", "false alarms"])
    dash = lambda v: "-" if v is None else v
    for r in report["campaign"]:
        lines.append(f"| {r['class']} | {r['bits']} | {r['flips']} | {dash(r.get('attributed'))} | "
                     f"{dash(r.get('caught_as_nonfinite'))} | {dash(r.get('caught'))} | "
                     f"{dash(r.get('caught_ended_equal'))} | "
                     f"{dash(r.get('uncaught_moved_the_loss'))} | "
                     f"{dash(r.get('bit_equal_at_end'))} | {dash(r.get('false_alarms'))} |")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=24, help="steps per overhead run")
    parser.add_argument("--flips", type=int, default=80,
                        help="flips of the dp=4 parameter class; the others scale from it")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    parser.add_argument("--quick", action="store_true", help="1 round, 12 steps, 8 flips")
    parser.add_argument("--part", choices=("all", "overhead", "campaign"), default="all")
    args = parser.parse_args()
    if args.quick:
        args.rounds, args.steps, args.flips = 1, 12, 8
        args.out = args.out / "quick"
    args.out.mkdir(parents=True, exist_ok=True)
    report = measure(args)
    (args.out / "numerics.json").write_text(json.dumps(report, indent=1))
    (args.out / "numerics.md").write_text(markdown(report))
    print(markdown(report))


def measure(args: argparse.Namespace) -> dict:
    """This run's halves, the others from the results file already there."""
    previous = args.out / "numerics.json"
    report = json.loads(previous.read_text()) if args.part != "all" else {}
    run = {"command": f"python bench/numerics.py --part {args.part}"
           + (" --quick" if args.quick else ""), "date": time.strftime("%Y-%m-%d %H:%M"),
           "machine": f"{os.cpu_count()} CPUs, {platform.machine()}, torch {torch.__version__}",
           "load_average": round(os.getloadavg()[0], 2)}
    started = time.time()
    with tempfile.TemporaryDirectory() as tmp:
        scratch = Path(tmp)
        if args.part in ("all", "overhead"):
            spawn(overhead_worker, 2, args, scratch)
            runs = json.loads((scratch / "overhead.json").read_text())
            report.update(overhead=overhead_table(runs), overhead_run=run)
        if args.part in ("all", "campaign"):
            spawn(campaign_worker, 4, args, scratch)
            campaign = json.loads((scratch / "campaign.json").read_text())
            dp1 = unreplicated_grads(args, scratch)
            report.update(campaign=campaign_table(campaign, dp1), campaign_run=run,
                          raw={"campaign": campaign, "dp1": dp1})
    run["seconds"] = round(time.time() - started)
    return report


if __name__ == "__main__":
    main()
