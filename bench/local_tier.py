"""The node-local checkpoint tier against the global tier, side by side in one run.

1. Save cost, on the demo recipe at its 3D layout (8 ranks, tp2 x pp2 x dp2)
   over two simulated nodes of 4 ranks: one run with the global tier alone
   (async, every `--global-interval` steps) and one with the local tier too
   (every step, one replica on the other node). From events.jsonl: the local
   save's blocking time (`local_checkpoint_saved.blocking_seconds`) and total
   time, the bytes replicated and the replication time, beside the async
   global save's; from metrics.jsonl: the median step time of both runs.
2. Recovery, through `megaresil chaos` (each scenario a real job beside a
   fault-free reference): a killed rank and a lost node, global tier only
   (`kill-rank`, `node-loss`: two elastic agents, dp shrinks) against the
   local tier (`kill-rank-local`, `node-loss-local`: the node's workers killed
   and its local directory deleted, its shards recovered from replicas).
   Reported: steps lost, detection latency, restart time (detection -> first
   step) and fault -> first step.

    python bench/local_tier.py [--steps 16] [--global-interval 5] [--out bench/results]

Every figure is wall time on whatever machine runs it; both sides of each
comparison ran in the same invocation, so a busy machine slows both.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import time
from pathlib import Path

from megaresil.events import read_events
from megaresil.resilience.chaos import run_scenario, run_training, step_records

RECIPE = "recipes/gpt-tiny.yaml"
LOCAL = ["checkpoint.local.enabled=true", "checkpoint.local.interval=1",
         "checkpoint.local.replicas=1", "checkpoint.local.ranks_per_node=4"]


def base(args) -> list[str]:
    return [f"train.steps={args.steps}", f"checkpoint.interval={args.global_interval}",
            "checkpoint.async=true", "logging.tensorboard=false", "train.eval_batches=0"]


def median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


def save_costs(args, work: Path) -> dict:
    """The global tier alone vs both tiers: per-save figures and step time."""
    rows = {}
    for name, extra in (("global_only", []), ("local_and_global", LOCAL)):
        run_dir = work / name
        shutil.rmtree(run_dir, ignore_errors=True)
        # Keep the local shards of the last step: no cleanup at the end measured.
        run_training(RECIPE, base(args) + extra, run_dir)
        events = read_events(run_dir)
        steps = step_records(run_dir)
        durations = [b["elapsed_s"] - a["elapsed_s"] for a, b in zip(steps, steps[1:])][2:]
        local = [e for e in events if e["event"] == "local_checkpoint_saved"]
        glob = [e for e in events if e["event"] == "checkpoint_saved"]
        rows[name] = {
            "step_s_median": median(durations),
            "global_saves": len(glob),
            "global_blocking_s_median": median([e["blocking_seconds"] for e in glob]),
            "global_total_s_median": median([e["seconds"] for e in glob]),
            "global_bytes": glob[-1]["bytes"] if glob else None,
            "local_saves": len(local),
            "local_blocking_s_median": median([e["blocking_seconds"] for e in local]),
            "local_total_s_median": median([e["seconds"] for e in local]),
            "local_bytes": local[-1]["bytes"] if local else None,
            "replica_bytes": local[-1]["replica_bytes"] if local else None,
            "replication_s_median": median([e["replication_seconds"] for e in local]),
        }
    with_local = rows["local_and_global"]
    with_local["local_blocking_share_of_step"] = (with_local["local_blocking_s_median"]
                                                  / rows["global_only"]["step_s_median"])
    with_local["step_time_ratio"] = (with_local["step_s_median"]
                                     / rows["global_only"]["step_s_median"])
    return rows


def recoveries(args, work: Path) -> dict:
    out = {}
    reference = None
    for name in ("kill-rank", "kill-rank-local", "node-loss", "node-loss-local"):
        started = time.time()
        overrides = base(args) + [f"run.dir={work / 'chaos'}"]
        result = run_scenario(RECIPE, overrides, name, reference=reference, rank=None, step=None)
        reference = Path(result["reference"])
        loads = [e for e in read_events(result["faulted"]) if e["event"] == "checkpoint_loaded"]
        detect, restart = result["detection_latency_s"], result["restart_time_s"]
        out[name] = {k: result[k] for k in ("recovered", "steps_lost", "detection_latency_s",
                                            "restart_time_s", "final_loss_equal",
                                            "restart_kind", "exit_code")}
        out[name]["fault_to_first_step_s"] = (None if detect is None or restart is None
                                              else detect + restart)
        out[name]["tier"] = loads[-1].get("tier") if loads else None
        out[name]["loaded_step"] = loads[-1]["step"] if loads else None
        out[name]["from_replicas"] = loads[-1].get("from_replicas") if loads else None
        out[name]["wall_s"] = time.time() - started
        print(f"{name}: {json.dumps(out[name])}", flush=True)
    return out


def table(costs: dict, rec: dict) -> str:
    g, l = costs["global_only"], costs["local_and_global"]
    lines = ["| save | blocking s (median) | total s (median) | bytes per save | replicated bytes | replication s |",
             "| --- | --- | --- | --- | --- | --- |",
             f"| global, async (global-only run) | {g['global_blocking_s_median']:.4f} | "
             f"{g['global_total_s_median']:.3f} | {g['global_bytes']} | - | - |",
             f"| local, every step (both-tiers run) | {l['local_blocking_s_median']:.4f} | "
             f"{l['local_total_s_median']:.3f} | {l['local_bytes']} | {l['replica_bytes']} | "
             f"{l['replication_s_median']:.3f} |",
             "",
             f"median step: {g['step_s_median']:.3f} s global-only, {l['step_s_median']:.3f} s "
             f"with the local tier (x{l['step_time_ratio']:.2f}); local blocking = "
             f"{l['local_blocking_share_of_step']:.2%} of a step",
             "",
             "| fault | tier loaded | steps lost | detection s | restart s | fault -> first step s | final loss equal |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    fmt = lambda v: "-" if v is None else f"{v:.2f}"
    for name, r in rec.items():
        lines.append(f"| {name} | {r['tier']} (step {r['loaded_step']}) | {r['steps_lost']} | "
                     f"{fmt(r['detection_latency_s'])} | {fmt(r['restart_time_s'])} | "
                     f"{fmt(r['fault_to_first_step_s'])} | {r['final_loss_equal']} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--global-interval", type=int, default=5)
    parser.add_argument("--out", default="bench/results")
    parser.add_argument("--work", default="/tmp/megaresil-bench-local-tier")
    parser.add_argument("--only", choices=["costs", "recovery"], default=None)
    args = parser.parse_args()
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    started = time.time()
    out = Path(args.out)
    # --only redoes one part; the other comes from the previous results.
    previous = (json.loads((out / "local_tier.json").read_text())
                if args.only and (out / "local_tier.json").exists() else {})
    costs = save_costs(args, work) if args.only != "recovery" else previous.get("costs", {})
    print(json.dumps(costs, indent=1), flush=True)
    rec = recoveries(args, work) if args.only != "costs" else previous.get("recovery", {})
    result = {"costs": costs, "recovery": rec, "steps": args.steps,
              "global_interval": args.global_interval, "cpus": os.cpu_count(),
              "note": "other work shared the machine (2 cores, several agents)",
              "elapsed_s": time.time() - started}
    out.mkdir(parents=True, exist_ok=True)
    (out / "local_tier.json").write_text(json.dumps(result, indent=1))
    if costs and rec:
        text = table(costs, rec)
        (out / "local_tier.md").write_text(text + "\n\n" + result["note"] + "\n")
        print(text)


if __name__ == "__main__":
    main()
