"""Losing a node under each rendezvous backend, side by side in one run.

Runs `megaresil chaos`'s node-loss scenarios (two agents at dp=2, one killed
with its workers after step 3) against one fault-free reference: the last
node under c10d, then the first node (the c10d host) under c10d, etcd-v2 and
etcd, the etcd ones on a local etcd server (Debian's etcd-server) started here.

    python bench/rendezvous_node_loss.py --out bench/results
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # the etcd fixture the tests use

from megaresil.drills.etcd import EtcdServer, etcd_missing_reason  # noqa: E402
from megaresil.drills.chaos import run_scenario  # noqa: E402
from megaresil.drills.run import Rendezvous, run_training  # noqa: E402

SMALL = ["recipes/gpt-tiny.yaml", "parallel.tp=1", "parallel.pp=1", "parallel.dp=2",
         "train.steps=8", "logging.tensorboard=false", "train.eval_batches=0",
         "resilience.watchdog.floor_s=1.0", "resilience.watchdog.calibration_steps=2",
         "data.seq_len=64", "train.micro_batch_size=4", "train.global_batch_size=8",
         "checkpoint.interval=2", "logging.progress=false"]
CASES = [("node-loss", "c10d"), ("node-loss-first", "c10d"), ("node-loss-first", "etcd-v2"),
         ("node-loss-first", "etcd")]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results")
    args = parser.parse_args()
    if etcd_missing_reason():
        sys.exit(etcd_missing_reason())
    work = Path(tempfile.mkdtemp(prefix="rdzv-bench-"))
    (work / "etcd").mkdir()
    server = EtcdServer(work / "etcd").start()
    try:
        reference = work / "reference"
        run_training(SMALL[0], SMALL[1:], reference)
        rows = []
        for scenario, backend in CASES:
            endpoint = None if backend == "c10d" else server.endpoint
            started = time.time()
            result = run_scenario(SMALL[0], [*SMALL[1:], f"run.dir={work / backend}"], scenario,
                                  reference=reference, rank=None, step=3,
                                  rendezvous=Rendezvous(backend, endpoint))
            rows.append({"backend": backend, **result, "wall_s": time.time() - started})
    finally:
        server.stop()
    args.out.mkdir(parents=True, exist_ok=True)
    note = (f"{os.cpu_count()} cores shared with other work (load average "
            f"{os.getloadavg()[0]:.1f} at the end)")
    (args.out / "rendezvous_node_loss.json").write_text(json.dumps({"note": note, "rows": rows},
                                                                   indent=1))
    (args.out / "rendezvous_node_loss.md").write_text(table(rows, note))
    print(table(rows, note))
    shutil.rmtree(work, ignore_errors=True)


def table(rows: list[dict], note: str) -> str:
    def s(v):
        return "-" if v is None else f"{v:.2f} s"
    lines = [f"Node loss by rendezvous backend ({note}).", "",
             "| scenario | backend | exit | recovered | final loss equal | detection | restart "
             "| steps lost |", "|---|---|---|---|---|---|---|---|"]
    lines += [f"| {r['scenario']} | {r['backend']} | {r['exit_code']} | {r['recovered']} | "
              f"{r['final_loss_equal']} | {s(r['detection_latency_s'])} | "
              f"{s(r['restart_time_s'])} | {r['steps_lost']} |" for r in rows]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
