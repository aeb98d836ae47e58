"""The coordination store's ceiling: one c10d TCPStore served in this process
(drills/store_meter.serve, as the simulator serves it), driven by client
processes that each pace the control plane's operation mix (MIX: heartbeat
sets, abort checks and gets, a shared counter's add, a compare_set, a
multi_get of a node's heartbeats; small values) at a share of an offered
load, stepped up until the throughput stops growing. Each step reports per
operation its ops/s, keys/s and latency p50/p99, and this process's CPU
seconds per 1,000 operations: what the store's threads cost, as the
clients run elsewhere. bench/store_ceiling.py runs it (bench/README.md)."""
from __future__ import annotations

import multiprocessing as mp
import resource
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from megaresil.drills.store_meter import serve

# One round of the mix, in the control plane's proportions at steady state and
# on a fault (bench/README.md "The store's keys"): heartbeats dominate.
MIX = ("set", "set", "set", "set", "check", "check", "get", "add", "compare_set", "multi_get")
MULTI_GET_KEYS = 8  # a node's ranks' heartbeats
HEARTBEAT = "x" * 170  # a heartbeat's size (~170 B)


@dataclass(frozen=True)
class Step:
    offered_per_s: float  # all clients together
    seconds: float


def client_loop(port: int, index: int, conn) -> None:
    """A client process: for each (rate, seconds, start_at) it receives, run
    the mix at `rate` ops/s from `start_at` for `seconds`, and send back per
    operation its count, keys and latencies; None ends it."""
    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=60))
    node = [f"hb/0/{index}/{r}" for r in range(MULTI_GET_KEYS)]
    for key in node:
        store.set(key, HEARTBEAT)
    store.set(f"hang/{index}", "0")
    conn.send("ready")
    while (order := conn.recv()) is not None:
        rate, seconds, start_at = order
        conn.send(run_mix(store, index, node, rate, seconds, start_at))


def run_mix(store, index: int, node: list[str], rate: float, seconds: float,
            start_at: float) -> dict[str, Any]:
    ops: dict[str, Any] = {op: {"calls": 0, "keys": 0, "latencies": []} for op in set(MIX)}
    gap = 1.0 / rate
    while time.time() < start_at:
        time.sleep(min(0.01, max(0.0, start_at - time.time())))
    began = time.perf_counter()
    due, n, flip = began, 0, 0
    while (now := time.perf_counter()) < began + seconds:
        if now < due:  # paced: an open-loop offered load, caught up when late
            time.sleep(due - now)
        op = MIX[n % len(MIX)]
        called = time.perf_counter()
        keys = one_op(store, op, index, node, n, flip)
        row = ops[op]
        row["latencies"].append(time.perf_counter() - called)
        flip ^= op == "compare_set"
        row["calls"] += 1
        row["keys"] += keys
        n += 1
        due += gap
    return {"seconds": time.perf_counter() - began, "ops": ops}


def one_op(store, op: str, index: int, node: list[str], n: int, flip: int) -> int:
    """One operation of the mix on this client's keys; the keys it names."""
    if op == "set":
        store.set(node[n % len(node)], HEARTBEAT)
    elif op == "check":
        store.check(["abort/0"])  # never set: the monitors' steady poll
    elif op == "get":
        store.get(node[0])
    elif op == "add":
        store.add("gen1/entered", 0)  # one key every client shares, as the waiters do
    elif op == "compare_set":
        store.compare_set(f"hang/{index}", str(flip), str(1 - flip))
    else:
        store.multi_get(node)
        return len(node)
    return 1


def cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def percentile(values: list[float], share: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(share * len(ordered)))] if ordered else 0.0


def summarise(step: Step, replies: list[dict], cpu_s: float, wall_s: float) -> dict:
    """One step's figures from its clients' replies and this process's CPU."""
    by_op = {}
    for op in sorted(set(MIX)):
        rows = [r["ops"][op] for r in replies]
        lat = [x for row in rows for x in row["latencies"]]
        calls, keys = sum(r["calls"] for r in rows), sum(r["keys"] for r in rows)
        by_op[op] = {"calls": calls, "ops_per_s": calls / wall_s, "keys_per_s": keys / wall_s,
                     "p50_ms": percentile(lat, 0.5) * 1e3, "p99_ms": percentile(lat, 0.99) * 1e3}
    calls = sum(row["calls"] for row in by_op.values())
    keys = sum(row["keys_per_s"] for row in by_op.values()) * wall_s
    return {"offered_per_s": step.offered_per_s, "seconds": wall_s, "ops_per_s": calls / wall_s,
            "keys_per_s": keys / wall_s,
            "store_cpu_s_per_1k_ops": cpu_s / calls * 1e3 if calls else 0.0,
            "store_cpu_share": cpu_s / wall_s, "by_op": by_op}


class Ceiling:
    """The store and its client processes, ready to run steps of load."""

    def __init__(self, clients: int):
        self.server = serve()
        ctx = mp.get_context("spawn")  # no fork of the store's threads
        self.pipes, self.procs = [], []
        for index in range(clients):
            mine, theirs = ctx.Pipe()
            proc = ctx.Process(target=client_loop, args=(self.server.port, index, theirs),
                               daemon=True)
            proc.start()
            self.pipes.append(mine)
            self.procs.append(proc)
        for pipe in self.pipes:
            assert pipe.recv() == "ready"

    def run(self, step: Step) -> dict:
        share = step.offered_per_s / len(self.pipes)
        start_at = time.time() + 0.2
        for pipe in self.pipes:
            pipe.send((share, step.seconds, start_at))
        cpu = cpu_seconds()  # this process only serves: its CPU is the store's
        replies = [pipe.recv() for pipe in self.pipes]
        cpu = cpu_seconds() - cpu
        wall = max(r["seconds"] for r in replies)
        return summarise(step, replies, cpu, wall)

    def close(self) -> None:
        for pipe, proc in zip(self.pipes, self.procs):
            pipe.send(None)
            proc.join(timeout=10)


def stopped_growing(steps: list[dict], growth: float) -> bool:
    """Whether the last step's throughput is under `growth` times the best before it."""
    if len(steps) < 2:
        return False
    return steps[-1]["ops_per_s"] < growth * max(s["ops_per_s"] for s in steps[:-1])


def climb(clients: int, first_per_s: float, seconds: float, factor: float = 2.0,
          max_steps: int = 10, growth: float = 1.1) -> dict:
    """Steps of offered load from `first_per_s`, each `factor` times the last,
    until a step's throughput is under `growth` times the best before it
    (or `max_steps`): every step, and the ceiling, the best step's figures."""
    ceiling = Ceiling(clients)
    steps: list[dict] = []
    try:
        offered = first_per_s
        for _ in range(max_steps):
            steps.append(ceiling.run(Step(offered, seconds)))
            if stopped_growing(steps, growth):
                break
            offered *= factor
    finally:
        ceiling.close()
    return {"clients": clients, "mix": list(MIX), "multi_get_keys": MULTI_GET_KEYS,
            "value_bytes": len(HEARTBEAT), "steps": steps,
            "ceiling": max(steps, key=lambda s: s["ops_per_s"])}
