"""`megaresil plan` and `megaresil report`: what a run's records say."""
from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Optional

from megaresil.config import (
    NON_NEGATIVE,
    POSITIVE,
    ConfigError,
    NoLiveCopy,
    find_recipe,
    load_recipe,
    no_live_copy,
)

# The values each number `plan` takes admits (config.Bounds; None: not given).
PLAN_NUMBERS = {"--gpus": POSITIVE, "--mtbf-hours": POSITIVE, "--replacement-s": NON_NEGATIVE,
                "--spare-every": POSITIVE, "--gpus-per-node": POSITIVE,
                "--state-bytes": POSITIVE, "--storage-gbps": POSITIVE, "--step-s": POSITIVE,
                "--days": POSITIVE}


def check_plan_numbers(args: argparse.Namespace) -> None:
    """ConfigError (exit 2) naming the first option whose value no plan can
    use (a negative size, a NaN, an infinite MTBF), before any arithmetic."""
    for option, bounds in PLAN_NUMBERS.items():
        value = getattr(args, option[2:].replace("-", "_"))
        if value is not None and not bounds.admits(value):
            raise ConfigError(option, f"must be a finite number {bounds}, got {value}.",
                              f"give {option} a value {bounds}.")


def run_layout_gap(source: Path) -> Optional[NoLiveCopy]:
    """What the run's layout lacks for live replacement, from the recipe a
    run directory keeps (None without one: a `plan --json` file, an older
    run); ValueError naming a recipe that does not load."""
    recipe = source / "recipe.yaml"
    if not recipe.is_file():
        return None
    try:
        return no_live_copy(load_recipe(recipe))
    except ConfigError as err:
        raise ValueError(f"{recipe}, whose layout the plan needs, does not load: {err}") from None


def cmd_memory(args: argparse.Namespace) -> int:
    """`plan --memory RECIPE [KEY=VALUE ...]`: each kind of rank's memory,
    against this node's GPU where one is readable."""
    import json

    from megaresil.launch.device_memory import read_device_memory
    from megaresil.plan.memory import format_memory, memory_json
    from megaresil.train.memory_census import estimate, layout_line

    cfg = load_recipe(find_recipe(args.run_dir), args.overrides)
    ranks = estimate(cfg, "cuda")
    device_bytes = read_device_memory()
    print(json.dumps(memory_json(ranks, layout_line(cfg), device_bytes), indent=1) if args.json
          else format_memory(ranks, layout_line(cfg), device_bytes))
    return 0


def cmd_plan(args: argparse.Namespace) -> int:
    import json

    if args.memory:
        return cmd_memory(args)
    if args.overrides:
        raise ConfigError("plan", f"takes KEY=VALUE overrides only with --memory, got "
                          f"{' '.join(args.overrides)}.", "add --memory, or drop them.")
    if args.gpus is None:
        raise ConfigError("--gpus", "is required to plan from a run's costs.",
                          "give --gpus N (or --memory RECIPE for the memory estimate).")
    from megaresil.plan.control_plane import load_control_plane
    from megaresil.plan.profile import failure_kinds, load_profile
    from megaresil.plan.recovery import DEFAULT_GPUS_PER_NODE, REFERENCE_GPUS, Spares
    from megaresil.plan.report import Scale, format_plan, plan, read_run_costs, trace_kinds

    check_plan_numbers(args)
    profile = load_profile(args.profile) if args.profile else load_profile()
    scale = (Scale(args.state_bytes, args.gpus, args.storage_gbps * 1e9)
             if args.state_bytes else None)
    try:
        # A trace is one job's failures: it has no rates at another size.
        kinds, reference_kinds = (
            (trace_kinds(Path(args.failure_trace)), None) if args.failure_trace
            else (failure_kinds(profile, args.gpus, args.mtbf_hours),
                  failure_kinds(profile, REFERENCE_GPUS, args.mtbf_hours)))
        spares = Spares(args.spare_every, args.gpus_per_node or
                        profile["observed"].get("gpus_per_node", DEFAULT_GPUS_PER_NODE))
        control_plane = load_control_plane(args.control_plane)
        costs = read_run_costs(Path(args.run_dir))
        gap = run_layout_gap(Path(args.run_dir))
        report = plan(costs, kinds, gpus=args.gpus,
                      replacement_s=(args.replacement_s if args.replacement_s is not None else
                                     profile.get("node_replacement_extra_s", 0.0)),
                      reference_kinds=reference_kinds, spares=spares, scale=scale,
                      step_s=args.step_s, simulate_days=args.days if args.simulate else None,
                      seed=args.seed, no_live_copy=gap, control_plane=control_plane)
    except ValueError as err:  # a run that cannot be planned from: say why, no traceback
        print(f"megaresil: error: {err}", file=sys.stderr)
        return 2
    report["costs"] = costs.to_dict()
    print(json.dumps(report, indent=1) if args.json else format_plan(report))
    return 0


def add_plan_parser(sub) -> None:
    from megaresil.plan.recovery import DEFAULT_SPARE_EVERY, REFERENCE_GPUS

    p = sub.add_parser("plan", help="the checkpoint interval and goodput to expect at scale, "
                       "from a run's measured costs (and --simulate: a simulated long run)",
                       description="Failures: --mtbf-hours (per GPU, with the profile's mix of "
                       "kinds), or --failure-trace, else the profile's own rates (default: "
                       "Llama 3 405B's, megaresil/plan/profiles/llama3_405b.yaml). The "
                       "recovery policies (relaunch, live replacement, hot spares) are "
                       f"projected at --gpus and at {REFERENCE_GPUS:,} GPUs. --memory RECIPE "
                       "[KEY=VALUE ...]: instead, each kind of rank's parameters, gradients, "
                       "optimizer state, fp32 main copies, activations (x the micro-batches "
                       "its pipeline schedule holds) and peak, in bytes of a GPU run "
                       "(precision auto: bf16), counted from the model built on the meta "
                       "device; within 15% of the peak measured on the CPU (docs/clusters.md).")
    p.add_argument("run_dir", help="a run directory (its records, and its recipe.yaml for the "
                   "layout) or a JSON written by plan --json; with --memory, a recipe (a "
                   "path or a packaged name)")
    p.add_argument("overrides", nargs="*", metavar="KEY=VALUE",
                   help="with --memory: recipe overrides, as train takes them")
    p.add_argument("--memory", action="store_true",
                   help="estimate memory per rank of RECIPE's layout before launch")
    p.add_argument("--gpus", type=int)
    p.add_argument("--mtbf-hours", type=float, help="mean time between failures of one GPU")
    p.add_argument("--failure-trace", help='JSON lines {"hours": T, "path": in_process|'
                   'relaunch|node_replacement, "scope": process|node|job (optional)}')
    p.add_argument("--profile", help="failure profile YAML")
    p.add_argument("--replacement-s", type=float,
                   help="seconds a spare host takes to replace a failed one (default: the "
                        "profile's)")
    p.add_argument("--control-plane", metavar="FILE",
                   help="the control plane's simulated detection and agreement times by world "
                        "size, whose growth at the planned sizes is added to each recovery: the JSON "
                        "bench/control_plane.py writes (default: the packaged copy, "
                        "megaresil/plan/profiles/control_plane.yaml)")
    p.add_argument("--spare-every", type=int, default=DEFAULT_SPARE_EVERY, metavar="NODES",
                   help="hot spares: one spare node per NODES nodes (default "
                        f"{DEFAULT_SPARE_EVERY}), idle GPUs that count against goodput per GPU")
    p.add_argument("--gpus-per-node", type=int, help="GPUs per node, for the spares (default: "
                   "the profile's)")
    p.add_argument("--state-bytes", type=float, help="scale save and load costs to this "
                   "checkpoint size, spread over --gpus ranks")
    p.add_argument("--storage-gbps", type=float, default=2000.0,
                   help="aggregate storage GB/s that bounds a scaled save and load")
    p.add_argument("--step-s", type=float, help="step time (default: the run's)")
    p.add_argument("--simulate", action="store_true", help="also simulate each policy")
    p.add_argument("--days", type=float, default=54.0, help="simulated days of work")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_plan)


def cmd_report(args: argparse.Namespace) -> int:
    from pathlib import Path

    from megaresil.observe.report import write_report
    from megaresil.safe_files import LinkRefused

    try:
        page = write_report(Path(args.run_dir), [Path(p) for p in args.compare],
                            Path(args.out) if args.out else None)
    except LinkRefused as err:  # a planted report/ link (a record of no use: DamagedRecord)
        print(f"megaresil: error: {err}", file=sys.stderr)
        return 2
    except FileNotFoundError as err:
        print(f"megaresil: error: {err}", file=sys.stderr)
        return 1
    print(f"wrote {page} (and its PNGs beside it)")
    return 0


def add_report_parser(sub) -> None:
    report = sub.add_parser("report", help="an HTML page with PNGs of a run: loss/eval "
                            "curves, throughput and MFU, a timeline of restarts, checkpoints "
                            "and faults, a per-rank straggler heat map, the goodput breakdown",
                            description="Writes RUN_DIR/report/index.html (images inlined), "
                            "one PNG per panel and summary.json.")
    report.add_argument("run_dir", metavar="RUN_DIR", help="a run directory (run.dir)")
    report.add_argument("--compare", nargs="+", default=[], metavar="RUN_DIR",
                        help="more runs to overlay (e.g. a reference, other layouts)")
    report.add_argument("--out", help="output directory (default RUN_DIR/report)")
    report.set_defaults(func=cmd_report)
