"""The control plane at scale, by simulation (megaresil/drills/control_plane.py):
for each world size, the store traffic of the steady state, of a lost rank's
detection and of the membership wait for its replacement, with the latencies.

    python bench/control_plane.py --world 1024 4096 --judges 16 --tick 0.25
Writes bench/results/control_plane.{json,md}; bench/README.md has the figures."""
from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

from megaresil.drills.control_plane import ControlPlaneSim, SimConfig, expected_steady
from megaresil.resilience.watchdog.judgement import HANG_JUDGES

RESULTS = Path(__file__).parent / "results"


def measure(world: int, judges: int | None, ranks_per_node: int, tick_s: float) -> dict:
    cfg = SimConfig(world=world, judges=judges, ranks_per_node=ranks_per_node, tick_s=tick_s)
    expected = expected_steady(cfg.watchdog, world)
    walls = {}
    with tempfile.TemporaryDirectory() as run_dir:
        started = time.perf_counter()
        sim = ControlPlaneSim(cfg, Path(run_dir))
        sim.start()
        walls["start"] = time.perf_counter() - started
        print(f"world {world}: start took {walls['start']:.0f} s", flush=True)
        mark = time.perf_counter()
        steady = sim.run_for(2 * expected["abort_poll_s"])
        walls["steady"] = time.perf_counter() - mark
        print(f"world {world}: steady took {walls['steady']:.0f} s", flush=True)
        mark = time.perf_counter()
        sim.lose(world - 1)
        fault = sim.run_until_aborted(limit_s=300.0)
        walls["fault"] = time.perf_counter() - mark
        print(f"world {world}: fault took {walls['fault']:.0f} s", flush=True)
        mark = time.perf_counter()
        replaced = sim.replace(world - 1)
        walls["replace"] = time.perf_counter() - mark
        print(f"world {world}: replace took {walls['replace']:.0f} s", flush=True)
        sim.close()
    # The blocked ranks that judge hangs (watchdog.judgement.judges_hangs); in
    # a real hang every rank waits, so every one of the HANG_JUDGES judges.
    judging = fault["judging"]
    heartbeat_reads = sum(row["keys"] for name, row in fault["by_pattern"].items()
                          if name in ("check hb/N/N", "multi_get hb/N/N", "get hb/N/N"))
    waiter = replaced["one_waiter"]
    all_judges = min(HANG_JUDGES, world)
    return {"world": world, "nodes": -(-world // ranks_per_node), "judges": judging,
            "tick_s": tick_s,
            "expected_steady": expected, "steady": steady, "fault": fault,
            "replacement": replaced, "wall_s": walls,
            "heartbeat_keys_read_per_judge": heartbeat_reads / judging,
            "heartbeat_keys_read_all_judging": heartbeat_reads / judging * all_judges,
            **{f"member_check_{unit}_per_s_all_waiting": waiter["all_waiting_per_s"][unit]
               for unit in ("calls", "keys")}}


def table(rows: list[dict]) -> str:
    lines = ["| world | nodes | steady ops/s | steady KB/s | heartbeat / abort poll s | "
             "detected s | all aborted s | hb keys read, all judging | member checks/s "
             "(keys/s), all waiting | wall s (start/steady/fault/replace) |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        e, s, f = r["expected_steady"], r["steady"]["per_s"], r["fault"]
        walls = "/".join(f"{v:.0f}" for v in r["wall_s"].values())
        lines.append(f"| {r['world']} | {r['nodes']} | {s['calls']:.0f} | "
                     f"{s['bytes'] / 1e3:.0f} | {e['heartbeat_s']:g} / {e['abort_poll_s']:g} | "
                     f"{f['detected_s']} | {f['all_aborted_s']} | "
                     f"{r['heartbeat_keys_read_all_judging']:.3g} | "
                     f"{r['member_check_calls_per_s_all_waiting']:.3g} "
                     f"({r['member_check_keys_per_s_all_waiting']:.3g}) | {walls} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world", type=int, nargs="+", default=[1024, 4096])
    parser.add_argument("--judges", type=int, default=64,
                        help="ranks that wait in the lost rank's collective (those of them "
                             "that judge hangs judge it; their reads are scaled to all judges')")
    parser.add_argument("--ranks-per-node", type=int, default=8)
    parser.add_argument("--tick", type=float, default=0.125,
                        help="simulated seconds per round of every rank's monitor")
    args = parser.parse_args()
    saved = RESULTS / "control_plane.json"
    # Each world size's run replaces its earlier one: sizes may be run apart.
    runs = {r["world"]: r for r in json.loads(saved.read_text())} if saved.exists() else {}
    for world in args.world:
        load = " ".join(Path("/proc/loadavg").read_text().split()[:3])
        runs[world] = {"load_before": load, **measure(world, args.judges, args.ranks_per_node,
                                                      args.tick)}
    rows = [runs[w] for w in sorted(runs)]
    RESULTS.mkdir(exist_ok=True)
    saved.write_text(json.dumps(rows, indent=1))
    loads = "; ".join(f"{r['world']}: {r['load_before']}" for r in rows)
    text = (f"# Control plane at scale (simulated)\n\nload before each run: {loads}\n\n"
            + table(rows))
    (RESULTS / "control_plane.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
