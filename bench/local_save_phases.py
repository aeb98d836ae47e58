"""One rank's local save, phase by phase, at the 1 GB bench's shard size.

The phases a local save runs on the tier's thread, through the tier's own
functions, on a 405 MB state (the per-rank shard of `local_tier.py --state
1gb`: 4 ranks, 1.62 GB saved a step): the non-finite check, the staging copy,
the checksums, the write to /dev/shm (shard, meta, marker), the replica's
checksum check on arrival, and the retention of an old step. For each: wall
and CPU seconds (user + system, every thread's but the counting one's,
torch's own threads included), and whether the phase lets a
Python thread run beside it (`other thread`: the progress of a thread
counting in Python, against its progress while this thread sleeps; near the
share of a core the machine leaves it when the phase releases the GIL, ~0
when it holds it, as the last row, a copy by `bytes()`, does). Replication (gloo point to point between
two processes) is not here: local_tier.py measures it in a real run.

    python bench/local_save_phases.py [--mb 405] [--repeat 5] [--out bench/results]
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import statistics
import threading
import time
from pathlib import Path

import torch

from megaresil.checkpoint.local.shard import Shard, add_checksums, shard_meta, stage
from megaresil.checkpoint.local.store import NodeStore
from megaresil.checkpoint.sharded import Rect
from megaresil.checkpoint.state import RunRecord
from megaresil.checkpoint.validation import nonfinite_keys, shard_problem

TENSORS = 8


class Spinner:
    """A thread counting in Python: how far it gets shows whether the main
    thread's work lets it hold the GIL."""

    def __init__(self):
        self.count, self.stop = 0, False
        self.thread = threading.Thread(target=self._spin, daemon=True)
        self.thread.start()

    def _spin(self) -> None:
        while not self.stop:
            self.count += 1

    def cpu(self) -> float:
        return time.clock_gettime(time.pthread_getcpuclockid(self.thread.ident))

    def rate(self, work) -> tuple[float, float, float]:
        """(wall s, CPU s of the work, spins per s) over `work()`: the
        process's CPU less this thread's own."""
        count, wall, cpu, own = self.count, time.perf_counter(), process_cpu(), self.cpu()
        work()
        wall = time.perf_counter() - wall
        cpu = process_cpu() - cpu - (self.cpu() - own)
        return wall, cpu, (self.count - count) / wall


def process_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def state_rects(total_bytes: int) -> list[Rect]:
    n = total_bytes // 4 // TENSORS
    return [Rect(f"model/w{i}", (n,), (0,), torch.randn(n)) for i in range(TENSORS)]


def measure(total_bytes: int, repeat: int, root: Path) -> dict:
    rects = state_rects(total_bytes)
    run = RunRecord(step=0, layout={"tp": 1, "pp": 1, "dp": 1, "world_size": 1},
                    recipe={"optimizer": {}},
                    consumed_samples=0, optimizer_steps=0)
    store, spinner = NodeStore(root), Spinner()
    baseline = spinner.rate(lambda: time.sleep(0.5))[2]
    buffer, rows = None, {}

    def record(name: str, work) -> None:
        wall, cpu, spins = spinner.rate(work)
        rows.setdefault(name, []).append((wall, cpu, spins / baseline))

    for step in range(1, repeat + 2):  # the first round warms the buffers up: not counted
        run.step = step
        record("non-finite check (sum, now)", lambda: nonfinite_keys(rects))
        record("non-finite check (isfinite.all, before)",
               lambda: [bool(torch.isfinite(r.tensor).all()) for r in rects])
        staged = {}
        record("staging copy", lambda: staged.update(zip(("data", "records"),
                                                         stage(rects, buffer))))
        buffer = staged["data"]
        record("checksums (xxh3)", lambda: add_checksums(buffer, staged["records"]))
        shard = Shard(shard_meta(run, 0, 1, {}, staged["records"]), buffer)
        record("write to /dev/shm (new files)", lambda: store.write(shard))
        record("replica check on arrival", lambda: shard_problem(shard))
        record("retention (an old step removed)", lambda: store.retain(2, 0, [0]))
        record("reference: bytes() of the buffer (holds the GIL)",
               lambda: bytes(buffer.numpy()))
        if step == 1:
            rows.clear()
    spinner.stop = True
    shutil.rmtree(root, ignore_errors=True)
    return {name: {"wall_s": statistics.median(v[0] for v in values),
                   "cpu_s": statistics.median(v[1] for v in values),
                   "other_thread": statistics.median(v[2] for v in values)}
            for name, values in rows.items()}


def table(rows: dict, total_bytes: int) -> str:
    lines = [f"one rank's local save of {total_bytes:,} bytes, medians:", "",
             "| phase | wall s | CPU s | other thread |", "| --- | --- | --- | --- |"]
    lines += [f"| {name} | {r['wall_s']:.3f} | {r['cpu_s']:.3f} | {r['other_thread']:.0%} |"
              for name, r in rows.items()]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mb", type=float, default=404834304 / 2**20,
                        help="the shard's size (default: local_tier.py --state 1gb's per rank)")
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--out", default="bench/results")
    parser.add_argument("--dir", default="/dev/shm/megaresil-bench-local-save-phases")
    args = parser.parse_args()
    total = int(args.mb * 2**20) // (4 * TENSORS) * 4 * TENSORS
    load_before = os.getloadavg()
    rows = measure(total, args.repeat, Path(args.dir))
    note = (f"load average (1 min) {load_before[0]:.1f} at the start, {os.getloadavg()[0]:.1f} "
            f"at the end, on {os.cpu_count()} cores; torch threads {torch.get_num_threads()}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "local_save_phases.json").write_text(json.dumps(
        {"bytes": total, "repeat": args.repeat, "phases": rows, "note": note}, indent=1))
    text = table(rows, total)
    (out / "local_save_phases.md").write_text(text + "\n\n" + note + "\n")
    print(text, "\n\n" + note)


if __name__ == "__main__":
    main()
