"""`megaresil chaos` and `megaresil soak`: the drills (megaresil/drills/)."""
from __future__ import annotations

import argparse
import functools
import signal
import sys
from collections.abc import Callable

# No torch at the top (see cli/__init__.py): each command imports what it needs.
from megaresil.cli.common import add_recipe_args
from megaresil.drills.scenarios import HOSTS_MODES, scenarios

# The scenario table's names (whatever the rank and steps), from its light
# module: `chaos --help` needs no torch.
CHAOS_SCENARIOS = tuple(scenarios(rank=0, step=1, save_step=1))


def stopped_by_ctrl_c(drill: Callable[[argparse.Namespace], int]):
    """Ctrl-C ends a drill with one line, not a traceback: its runs had the
    signal too (they stop, saving), and its hogs and nodes are gone by then
    (the drills undo them on the way out)."""
    @functools.wraps(drill)
    def run(args: argparse.Namespace) -> int:
        try:
            return drill(args)
        except KeyboardInterrupt:
            print(f"megaresil: {args.command} stopped by Ctrl-C: nothing was reported; its "
                  "runs stopped, their directories stay under run.dir", file=sys.stderr)
            return 128 + signal.SIGINT
    return run


@stopped_by_ctrl_c
def cmd_chaos(args: argparse.Namespace) -> int:
    from pathlib import Path

    from megaresil.drills.chaos import format_result, run_scenario
    from megaresil.drills.run import Rendezvous

    result = run_scenario(args.recipe, args.overrides, args.scenario,
                          reference=Path(args.reference) if args.reference else None,
                          rank=args.rank, step=args.step,
                          rendezvous=Rendezvous(args.rdzv_backend, args.rdzv_endpoint),
                          timeout_s=args.timeout, hosts=args.hosts)
    print(format_result(result))
    ok = result["recovered"] and result["final_loss_equal"]
    return 0 if ok else 1


@stopped_by_ctrl_c
def cmd_soak(args: argparse.Namespace) -> int:
    from megaresil.drills.soak import format_report, run_soak

    report = run_soak(args.recipe, args.overrides, minutes=args.minutes,
                      episodes=args.episodes, seed=args.seed, hogs=args.hogs,
                      local=args.local_tier, hosts=args.hosts)
    print(format_report(report))
    return 0 if report["ok"] else 1


def add_chaos_parser(sub) -> None:
    chaos = sub.add_parser("chaos", help="run a fault scenario beside a fault-free reference "
                           "and report detection latency, restart time, steps lost and "
                           "whether the final loss matches")
    add_recipe_args(chaos)
    chaos.add_argument("--scenario", required=True, choices=CHAOS_SCENARIOS, metavar="NAME",
                       help="one of: " + ", ".join(CHAOS_SCENARIOS) + " (hang-on-device needs "
                            "CUDA; node-loss-first loses the node that started first, the c10d "
                            "host; the -local ones use the local checkpoint tier)")
    chaos.add_argument("--rank", type=int, help="faulty rank (default: the last)")
    chaos.add_argument("--step", type=int, help="fault step (default: train.steps/2 + 1)")
    chaos.add_argument("--reference", help="reuse this fault-free run directory as the reference")
    chaos.add_argument("--timeout", type=float, default=900.0, metavar="SECONDS",
                       help="stop the faulted run after this long and report it unrecovered "
                            "(exit code 124; default 900)")
    chaos.add_argument("--rdzv-backend", default="c10d", choices=("c10d", "etcd", "etcd-v2"),
                       help="where the node scenarios' agents meet (etcd needs "
                            "--rdzv-endpoint ETCD_HOST:PORT, except with --hosts netns, "
                            "where the drill runs an etcd of its own on a node of its own)")
    chaos.add_argument("--rdzv-endpoint", metavar="HOST:PORT",
                       help="the etcd server of --rdzv-backend etcd or etcd-v2")
    chaos.add_argument("--hosts", default="local", choices=HOSTS_MODES,
                       help="where the node and link scenarios run their nodes: local "
                            "(default), processes on this machine; netns, each node in network, "
                            "UTS and mount namespaces of its own on a bridge (own address, "
                            "hostname and /dev/shm; needs root)")
    chaos.set_defaults(func=cmd_chaos, overrides_anywhere=True)


def add_soak_parser(sub) -> None:
    soak = sub.add_parser("soak", help="one long run with faults of every kind at random steps "
                          "and sections (async saves, optional CPU hogs), then a fault-free "
                          "reference; exit 0 when every fault was recovered, no false alarm "
                          "was raised and the final state is bit-equal",
                          description="Writes calibration/, faulted/, reference/ and soak.json "
                          "under run.dir.")
    add_recipe_args(soak)
    length = soak.add_mutually_exclusive_group(required=True)
    length.add_argument("--minutes", type=float,
                        help="wall-time budget of the faulted run; steps and faults are fitted "
                             "to it from a short calibration run (the calibration and the "
                             "reference come on top)")
    length.add_argument("--episodes", type=int, metavar="N",
                        help="instead of --minutes: exactly N episodes, the first N a budget "
                             "would choose (with --hosts netns the first two are the link's), "
                             "over the fewest steps that hold them")
    soak.add_argument("--seed", type=int, default=0, help="seed of the fault schedule")
    soak.add_argument("--hogs", type=int, default=0,
                      help="busy CPU processes beside the calibration and faulted runs")
    soak.add_argument("--no-local-tier", dest="local_tier", action="store_false",
                      help="global checkpoints only (by default the soak saves to the local "
                           "tier every step on two simulated nodes and damages it too)")
    soak.add_argument("--hosts", default="local", choices=HOSTS_MODES,
                      help="where the runs go: local (default), one job on this machine; "
                           "netns, two agents on two nodes in namespaces of their own (own "
                           "address, hostname and /dev/shm; needs root and an even world "
                           "size), each run at the same layout, with a node's link flapping "
                           "and slowed among the episodes")
    soak.set_defaults(func=cmd_soak, overrides_anywhere=True)
