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
3. A third save-cost run leaves checkpoint.local.interval at its default (0:
   every step while a save holds the loop <= 5% of a step, else the smallest
   interval that does) and reports the intervals it chose.

    python bench/local_tier.py [--steps 16] [--global-interval 5] [--out bench/results]

`--state 1gb` does the same on a model whose full training state (fp32
weights, their gradients and two Adam moments) is ~1 GB, at 4 ranks
(tp2 x dp2) on two simulated nodes of 2; few short steps, since the state's
size is what is measured, not the step's compute. Its results go to
local_tier_1gb.{json,md}; `--set KEY=VALUE` adds any recipe override.

    python bench/local_tier.py --state 1gb --steps 8 --global-interval 4 --fault-step 7

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

from megaresil.checkpoint import format as fmt
from megaresil.checkpoint.keys import WEIGHTS
from megaresil.checkpoint.validation import read_manifest
from megaresil.drills.chaos import run_scenario
from megaresil.drills.run import run_training, step_records
from megaresil.drills.scenarios import local_tier_settings
from megaresil.events import read_events

RECIPE = "recipes/gpt-tiny.yaml"
# Overrides of the demo recipe per --state, and its world size. 1gb: 67.3M
# parameters (5 layers of 1024, vocabulary 4096) x 16 bytes (weights, grads,
# two moments) = 1.08 GB; one sample of 32 tokens per data-parallel rank.
STATES = {
    "demo": ([], 8),
    "1gb": (["model.num_layers=5", "model.hidden_size=1024", "model.num_heads=16",
             "data.seq_len=32", "train.micro_batch_size=1", "train.global_batch_size=2",
             "parallel.tp=2", "parallel.pp=1", "parallel.dp=2", "optimizer.warmup_steps=2"], 4),
}


def base(args) -> list[str]:
    return [*STATES[args.state][0], f"train.steps={args.steps}",
            f"checkpoint.interval={args.global_interval}", "checkpoint.async=true",
            "logging.tensorboard=false", "train.eval_batches=0", *args.set]


def state_bytes(checkpoint: Path) -> dict:
    """The training state's size, from a global checkpoint's manifest: it
    holds each weight and moment once; the gradients are the weights' size."""
    tensors = read_manifest(checkpoint)["tensors"]
    sizes = {key: fmt.region_bytes(entry["global_shape"], entry["dtype"])
             for key, entry in tensors.items()}
    weights = sum(n for key, n in sizes.items() if key.startswith(WEIGHTS))
    moments = sum(sizes.values()) - weights
    return {"weights_bytes": weights, "moments_bytes": moments,
            "full_state_bytes": 2 * weights + moments}


def median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


def save_costs(args, work: Path) -> dict:
    """The global tier alone vs both tiers: per-save figures and step time."""
    rows = {}
    every_step = local_tier_settings(STATES[args.state][1])  # as the chaos scenarios save
    chosen = [s for s in every_step if not s.startswith("checkpoint.local.interval=")]
    for name, extra in (("global_only", []), ("local_and_global", every_step),
                        ("local_interval_chosen", chosen)):
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
            "local_intervals": [e.get("interval") for e in local],
        }
        if glob:
            rows[name].update(state_bytes(Path(glob[-1]["path"])))
    for with_local in (rows["local_and_global"], rows["local_interval_chosen"]):
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
        result = run_scenario(RECIPE, overrides, name, reference=reference, rank=None,
                              step=args.fault_step)
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
    c = costs.get("local_interval_chosen")  # absent from results made before it was measured
    lines = ["| save | blocking s (median) | total s (median) | bytes per save | replicated bytes | replication s |",
             "| --- | --- | --- | --- | --- | --- |",
             f"| global, async (global-only run) | {g['global_blocking_s_median']:.4f} | "
             f"{g['global_total_s_median']:.3f} | {g['global_bytes']} | - | - |"]
    for label, r in (("every step", l), ("interval chosen (default 0)", c)):
        if r:
            lines.append(f"| local, {label} (both-tiers run) | {r['local_blocking_s_median']:.4f} | "
                         f"{r['local_total_s_median']:.3f} | {r['local_bytes']} | "
                         f"{r['replica_bytes']} | {r['replication_s_median']:.3f} |")
    lines += ["", f"median step: {g['step_s_median']:.3f} s global-only; {l['step_s_median']:.3f} s "
                  f"with the local tier every step (x{l['step_time_ratio']:.2f}, local blocking = "
                  f"{l['local_blocking_share_of_step']:.2%} of a global-only step)"]
    if c:
        lines[-1] += (f"; {c['step_s_median']:.3f} s at the chosen interval "
                      f"(x{c['step_time_ratio']:.2f}, local blocking = "
                      f"{c['local_blocking_share_of_step']:.2%}; {c['local_saves']} saves, "
                      f"interval chosen at each: {c['local_intervals']})")
    lines += ["",
              "| fault | tier loaded | steps lost | detection s | restart s | fault -> first step s | final loss equal |",
              "| --- | --- | --- | --- | --- | --- | --- |"]
    secs = lambda v: "-" if v is None else f"{v:.2f}"
    for name, r in rec.items():
        lines.append(f"| {name} | {r['tier']} (step {r['loaded_step']}) | {r['steps_lost']} | "
                     f"{secs(r['detection_latency_s'])} | {secs(r['restart_time_s'])} | "
                     f"{secs(r['fault_to_first_step_s'])} | {r['final_loss_equal']} |")
    if "full_state_bytes" in g:
        lines[:0] = [f"training state: {g['full_state_bytes']} bytes (weights {g['weights_bytes']} "
                     f"+ their gradients + Adam moments {g['moments_bytes']})", ""]
    return "\n".join(lines)


def load_note(before: tuple, after: tuple) -> str:
    return (f"load average (1 min) {before[0]:.1f} at the start, {after[0]:.1f} at the end, on "
            f"{os.cpu_count()} cores: other work (other agents) may have shared the machine")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--global-interval", type=int, default=5)
    parser.add_argument("--out", default="bench/results")
    parser.add_argument("--work", default="/tmp/megaresil-bench-local-tier")
    parser.add_argument("--only", choices=["costs", "recovery"], default=None)
    parser.add_argument("--fault-step", type=int, default=None,
                        help="the step the faults hit (default: the chaos default, steps/2 + 1)")
    parser.add_argument("--state", choices=sorted(STATES), default="demo",
                        help="the model: the demo recipe's, or one with a ~1 GB training state")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="a further recipe override (repeatable)")
    args = parser.parse_args()
    work = Path(args.work) / args.state
    work.mkdir(parents=True, exist_ok=True)
    started, load_before = time.time(), os.getloadavg()
    out = Path(args.out)
    name = "local_tier" if args.state == "demo" else f"local_tier_{args.state}"
    # --only redoes one part; the other comes from the previous results.
    previous = (json.loads((out / f"{name}.json").read_text())
                if args.only and (out / f"{name}.json").exists() else {})
    costs = save_costs(args, work) if args.only != "recovery" else previous.get("costs", {})
    print(json.dumps(costs, indent=1), flush=True)
    rec = recoveries(args, work) if args.only != "costs" else previous.get("recovery", {})
    result = {"costs": costs, "recovery": rec, "state": args.state, "overrides": base(args),
              "steps": args.steps, "global_interval": args.global_interval,
              "cpus": os.cpu_count(), "note": load_note(load_before, os.getloadavg()),
              "elapsed_s": time.time() - started}
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{name}.json").write_text(json.dumps(result, indent=1))
    if costs and rec:
        text = table(costs, rec)
        (out / f"{name}.md").write_text(text + "\n\n" + result["note"] + "\n")
        print(text)
    print(result["note"], f"({result['elapsed_s']:.0f} s)")


if __name__ == "__main__":
    main()
