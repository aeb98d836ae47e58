"""The coordination store's ceiling (megaresil/drills/store_ceiling.py): one
c10d TCPStore served in this process, client processes pacing the control
plane's operation mix at a stepped-up offered load until the throughput stops
growing; per operation ops/s, keys/s and latency, and the store's CPU.

    python bench/store_ceiling.py --clients 4 --first 1000 --seconds 3
Writes bench/results/store_ceiling.{json,md}; bench/README.md has the figures."""
from __future__ import annotations

import argparse
import json
from pathlib import Path

from megaresil.drills.store_ceiling import climb

RESULTS = Path(__file__).parent / "results"


def table(result: dict) -> str:
    lines = ["| offered ops/s | ops/s | keys/s | store CPU s / 1k ops | store CPU share |",
             "|---|---|---|---|---|"]
    for s in result["steps"]:
        lines.append(f"| {s['offered_per_s']:,.0f} | {s['ops_per_s']:,.0f} | "
                     f"{s['keys_per_s']:,.0f} | {s['store_cpu_s_per_1k_ops']:.3f} | "
                     f"{s['store_cpu_share']:.0%} |")
    lines += ["", "At the ceiling, per operation:", "",
              "| operation | ops/s | keys/s | p50 ms | p99 ms |", "|---|---|---|---|---|"]
    for op, row in result["ceiling"]["by_op"].items():
        lines.append(f"| {op} | {row['ops_per_s']:,.0f} | {row['keys_per_s']:,.0f} | "
                     f"{row['p50_ms']:.3f} | {row['p99_ms']:.3f} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clients", type=int, default=4, help="client processes")
    parser.add_argument("--first", type=float, default=1000.0,
                        help="the first step's offered ops/s, all clients together")
    parser.add_argument("--factor", type=float, default=2.0, help="each step's load over the last")
    parser.add_argument("--seconds", type=float, default=3.0, help="seconds per step")
    args = parser.parse_args()
    load = " ".join(Path("/proc/loadavg").read_text().split()[:3])
    result = {"load_before": load, **climb(args.clients, args.first, args.seconds,
                                           args.factor)}
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "store_ceiling.json").write_text(json.dumps(result, indent=1))
    text = (f"# The coordination store's ceiling\n\nload before: {load}; {args.clients} "
            f"client processes, {args.seconds:g} s per step\n\n" + table(result))
    (RESULTS / "store_ceiling.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
