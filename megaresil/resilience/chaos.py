"""`megaresil chaos`: run a fault scenario beside a fault-free reference and
measure the recovery from the runs' own records (events.jsonl, metrics.jsonl).

Both runs go through `megaresil train` as separate processes, so every
detection, restart and resume is the real one. Reported per scenario:
detection latency (fault -> first detection), restart time (detection ->
first step completed after the restart), steps lost (steps done before the
fault that had to be redone), whether the final loss equals the reference's,
and the restart kind.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import psutil

from megaresil.checkpoint.local.store import local_root, node_dir
from megaresil.config import load_recipe
from megaresil.events import read_events
from megaresil.parallel.layout import visible_gpus
from megaresil.ports import free_port
from megaresil.resilience.faults import check_device_faults
from megaresil.resilience.preemption import PREEMPTED_EXIT
from megaresil.events import read_metrics
from megaresil.observe.report import write_report
from megaresil.safe_files import write_atomic

DETECTIONS = ("hang_detected", "worker_error", "preempted")


@dataclass
class Scenario:
    name: str
    faults: list[dict]
    settings: list[str] = field(default_factory=list)  # resilience.* overrides
    expect_restart: bool = True
    requeue_after_exit: bool = False  # like a scheduler rerunning a preempted job
    nodes: int = 1  # > 1: agents that form one elastic job; the last one is lost
    lose_first: bool = False  # lose the node that started first instead (the c10d host)
    lose_simulated_node: bool = False  # kill the local tier's last simulated node, wipe its dir


def local_tier_settings(world: int) -> list[str]:
    """Local saves every step on two simulated nodes, each rank's shard
    copied to the other."""
    return ["checkpoint.local.enabled=true", "checkpoint.local.interval=1",
            "checkpoint.local.replicas=1", f"checkpoint.local.ranks_per_node={max(1, world // 2)}"]


def scenarios(rank: int, step: int, save_step: int, world: int = 2) -> dict[str, Scenario]:
    in_process = ["resilience.in_process=true"]
    relaunch = ["resilience.in_process=false", "resilience.max_restarts=2"]
    local = local_tier_settings(world)
    return {s.name: s for s in [
        Scenario("kill-rank", [{"kind": "kill", "rank": rank, "step": step}], relaunch),
        Scenario("raise-in-rank", [{"kind": "raise", "rank": rank, "step": step}], in_process),
        Scenario("hang-in-collective", [{"kind": "hang", "rank": rank, "step": step,
                                         "mode": "collective"}], in_process),
        Scenario("hang-outside-collective", [{"kind": "hang", "rank": rank, "step": step,
                                              "mode": "sleep"}], in_process),
        Scenario("hang-holding-gil", [{"kind": "hang", "rank": rank, "step": step,
                                       "mode": "gil"}],
                 relaunch + ["resilience.watchdog.gil_timeout_s=3"]),
        # The abort cannot free a thread blocked in C code without the GIL:
        # after the hard limit the watchdog exits and the launcher relaunches.
        Scenario("hang-in-native-code", [{"kind": "hang", "rank": rank, "step": step,
                                          "mode": "native"}], in_process),
        Scenario("hang-on-device", [{"kind": "hang", "rank": rank, "step": step,
                                     "mode": "device"}], in_process),
        Scenario("slow-rank", [{"kind": "slow", "rank": rank, "step": step, "seconds": 0.3}],
                 in_process, expect_restart=False),
        Scenario("sigterm", [{"kind": "sigterm", "rank": rank, "step": step}],
                 requeue_after_exit=True),
        Scenario("corrupt-latest-checkpoint",
                 [{"kind": "corrupt_checkpoint", "rank": rank, "step": step},
                  {"kind": "kill", "rank": rank, "step": step, "section": "forward_backward"}],
                 relaunch),
        Scenario("kill-during-checkpoint-save",
                 [{"kind": "kill", "rank": rank, "step": save_step, "section": "checkpoint"}],
                 relaunch),
        Scenario("node-loss", [], relaunch, nodes=2),
        Scenario("node-loss-first", [], relaunch, nodes=2, lose_first=True),
        Scenario("kill-rank-local", [{"kind": "kill", "rank": rank, "step": step}],
                 relaunch + local),
        Scenario("node-loss-local", [], relaunch + local, lose_simulated_node=True),
    ]}


def train_command(recipe: str, overrides: list[str], run_dir: Path) -> list[str]:
    return [sys.executable, "-m", "megaresil", "train", recipe, *overrides,
            f"run.dir={run_dir}", "logging.progress=false"]


TIMED_OUT = 124  # the exit code given to a training job stopped at its deadline


@dataclass
class Launch:
    """One `megaresil train` process: when it ran and how it ended."""
    started: float
    ended: float
    exit_code: int


def run_training(recipe: str, overrides: list[str], run_dir: Path, *,
                 log: Optional[Path] = None, timeout_s: Optional[float] = None) -> Launch:
    """Run `megaresil train` to its end, or to `timeout_s`: then the launcher
    and its workers are killed (a deadlocked run must not stall the caller)."""
    started = time.time()
    out = open(log, "ab") if log else None
    try:
        proc = subprocess.Popen(train_command(recipe, overrides, run_dir), stdout=out,
                                stderr=subprocess.STDOUT if out else None)
        try:
            code = proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            kill_tree(proc.pid)
            proc.wait()
            code = TIMED_OUT
    finally:
        if out:
            out.close()
    return Launch(started, time.time(), code)


def run_with_requeue(recipe: str, overrides: list[str], run_dir: Path, *, requeues: int,
                     log: Optional[Path] = None, deadline: Optional[float] = None) -> list[Launch]:
    """Run a job and, like a scheduler, run it again each time it exits
    preempted (75), at most `requeues` times; stop at the `deadline` (epoch s)."""
    launches: list[Launch] = []
    while True:
        left = None if deadline is None else max(1.0, deadline - time.time())
        launches.append(run_training(recipe, overrides, run_dir, log=log, timeout_s=left))
        if launches[-1].exit_code != PREEMPTED_EXIT or len(launches) > requeues:
            return launches


def kill_tree(pid: int) -> None:
    """SIGKILL a process we started and everything it started."""
    try:
        root = psutil.Process(pid)
        procs = [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return
    for proc in procs:
        try:
            proc.kill()
        except psutil.NoSuchProcess:
            pass


def step_records(run_dir: Path) -> list[dict]:
    """metrics.jsonl's optimizer steps (eval lines left out), in order written."""
    return [r for r in read_metrics(run_dir) if "loss" in r]


def measure_recovery(events: list[dict], steps: list[dict], fault_time: float,
                     detections=DETECTIONS) -> dict:
    """How the run got over a fault at `fault_time`: when it was detected (the
    first of `detections` after it, else the first restart), how it restarted,
    which step it reloaded, when it next completed a step, and how many steps
    done before the fault had to be redone."""
    after = [e for e in events if e["time"] >= fault_time]
    restarts = [e for e in after if e["event"] == "restart"]
    detected = min((e["time"] for e in after if e["event"] in detections),
                   default=restarts[0]["time"] if restarts else None)
    loaded = next((e for e in after if e["event"] == "checkpoint_loaded"), None)
    first_after = next((r for r in steps if detected and r["time"] > detected), None)
    before = [r["step"] for r in steps if r["time"] < fault_time]
    return {"detected_at": detected, "restart_kind": restarts[0]["kind"] if restarts else None,
            "loaded_step": loaded["step"] if loaded else None,
            "first_step_after_at": first_after["time"] if first_after else None,
            "last_step_before": max(before, default=0),
            "steps_lost": max(0, max(before) - loaded["step"]) if before and loaded else 0}


def fault_overrides(scenario: Scenario) -> list[str]:
    return [f"faults={json.dumps(scenario.faults)}", *scenario.settings]


@dataclass
class Rendezvous:
    """Where the agents of a multi-node scenario meet: c10d in the first
    agent (on a free local port unless given), or an etcd server's endpoint."""
    backend: str = "c10d"
    endpoint: Optional[str] = None

    def options(self, first: bool) -> list[str]:
        if self.backend == "c10d":
            return ["--rdzv-conf", f"is_host={int(first)}"]
        if not self.endpoint:
            raise ValueError(f"--rdzv-backend {self.backend} needs the etcd server: "
                             "add --rdzv-endpoint ETCD_HOST:PORT")
        return []


def run_node_loss(recipe: str, overrides: list[str], run_dir: Path, world: int,
                  lose_after_step: int, *, lose_first: bool = False,
                  rendezvous: Rendezvous = Rendezvous()) -> tuple[int, float]:
    """Two agents ("nodes") form one elastic job; once `lose_after_step` is
    done, one agent and its workers are killed: the second, or with
    `lose_first` the first (with c10d it hosts the rendezvous store; as the
    lower pid on this machine it is also rank 0, whose agent hosts the
    workers' store). Returns (the survivor's exit code, loss time)."""
    endpoint = rendezvous.endpoint or f"127.0.0.1:{free_port()}"
    membership = ["--nnodes", "1:2", "--nproc-per-node", str(world // 2),
                  "--rdzv-backend", rendezvous.backend, "--rdzv-endpoint", endpoint,
                  "--rdzv-id", f"chaos-{os.getpid()}-{int(time.time())}"]
    command = train_command(recipe, overrides, run_dir) + membership
    first = subprocess.Popen(command + rendezvous.options(first=True))
    second = subprocess.Popen(command + rendezvous.options(first=False))
    lost, survivor = (first, second) if lose_first else (second, first)
    lost_at = wait_for_step(run_dir, lose_after_step, survivor)
    kill_tree(lost.pid)
    lost.wait()
    return survivor.wait(), lost_at


def run_simulated_node_loss(recipe: str, overrides: list[str], run_dir: Path, world: int,
                            lose_after_step: int) -> tuple[int, float]:
    """One agent whose ranks form two simulated nodes for the local tier;
    once `lose_after_step` is done, the second node's workers are killed and
    its local directory deleted, as if the machine were replaced. The agent
    relaunches the workers at the same layout. Returns (exit code, loss time)."""
    cfg = load_recipe(recipe, overrides + [f"run.dir={run_dir}"])
    per_node = cfg.checkpoint.local.ranks_per_node or world
    node = (world - 1) // per_node
    agent = subprocess.Popen(train_command(recipe, overrides, run_dir))
    lost_at = wait_for_step(run_dir, lose_after_step, agent)
    for proc in psutil.Process(agent.pid).children(recursive=True):
        try:
            if int(proc.environ().get("RANK", -1)) // per_node == node:
                proc.kill()
        except (psutil.NoSuchProcess, ValueError):
            pass
    shutil.rmtree(node_dir(local_root(cfg.checkpoint.local.dir, str(run_dir)), node),
                  ignore_errors=True)
    return agent.wait(), lost_at


def wait_for_step(run_dir: Path, step: int, proc: subprocess.Popen) -> float:
    while proc.poll() is None:
        if (run_dir / "metrics.jsonl").exists() and any(
                r["step"] >= step for r in step_records(run_dir)):
            return time.time()
        time.sleep(0.05)
    raise RuntimeError("the job ended before the node could be lost")


def analyse(reference: Path, faulted: Path, scenario: Scenario,
            fault_time: Optional[float] = None) -> dict:
    events = read_events(faulted)
    metrics = step_records(faulted)
    if fault_time is None:
        fault_time = min((e["time"] for e in events if e["event"] == "fault_injected"),
                         default=None)
    recovery = (measure_recovery(events, metrics, fault_time) if fault_time is not None
                else measure_recovery([], [], 0.0))
    detected, first_after = recovery["detected_at"], recovery["first_step_after_at"]
    ref_final = step_records(reference)[-1]
    final = metrics[-1]
    # Losing a node changes the layout (dp shrinks): equal within 1e-5 then.
    tolerance = 1e-5 * abs(ref_final["loss"]) if scenario.nodes > 1 else 0.0
    equal = (final["step"] == ref_final["step"]
             and abs(final["loss"] - ref_final["loss"]) <= tolerance)
    hangs = [e for e in events if e["event"] == "hang_detected"]
    return {
        "scenario": scenario.name,
        "recovered": final["step"] == ref_final["step"],
        "detection_latency_s": None if detected is None or fault_time is None
        else detected - fault_time,
        "restart_time_s": None if first_after is None or detected is None
        else first_after - detected,
        "steps_lost": recovery["steps_lost"],
        "final_loss": final["loss"], "reference_final_loss": ref_final["loss"],
        "final_loss_equal": equal,
        "restart_kind": recovery["restart_kind"] or
        ("requeue" if scenario.requeue_after_exit else "none"),
        "hang_detected": len(hangs), "culprit_ranks": hangs[0]["culprit_ranks"] if hangs else [],
        "checkpoints_skipped": [e["path"] for e in events if e["event"] == "checkpoint_skipped"],
        "stragglers": sorted({e["rank"] for e in events if e["event"] == "straggler_detected"}),
    }


def run_scenario(recipe: str, overrides: list[str], name: str, *, reference: Optional[Path],
                 rank: Optional[int], step: Optional[int],
                 rendezvous: Rendezvous = Rendezvous(), timeout_s: float = 900.0) -> dict:
    cfg = load_recipe(recipe, overrides)
    root = Path(cfg.run.dir)
    world = cfg.parallel.tp * cfg.parallel.pp * cfg.parallel.dp
    # The scenarios need to know the save steps: auto (or never) becomes every 2 steps.
    fixed = cfg.checkpoint.interval != "auto" and cfg.checkpoint.interval > 0
    interval = cfg.checkpoint.interval if fixed else 2
    if not fixed:
        overrides = [*overrides, f"checkpoint.interval={interval}"]
    fault_step = step or cfg.train.steps // 2 + 1
    save_step = interval * max(2, fault_step // interval)
    table = scenarios(world - 1 if rank is None else rank, fault_step, save_step, world)
    if name not in table:
        raise ValueError(f"--scenario: unknown scenario {name!r}; one of {sorted(table)}")
    scenario = table[name]
    check_device_faults(scenario.faults, visible_gpus())
    if reference is None:
        reference = root / "reference"
        shutil.rmtree(reference, ignore_errors=True)
        if run_training(recipe, overrides, reference).exit_code != 0:
            raise RuntimeError("the fault-free reference run failed")
    faulted = root / f"faulted-{name}"
    shutil.rmtree(faulted, ignore_errors=True)
    fault_time = None
    if scenario.nodes > 1:
        code, fault_time = run_node_loss(recipe, overrides + scenario.settings, faulted, world,
                                         fault_step, lose_first=scenario.lose_first,
                                         rendezvous=rendezvous)
    elif scenario.lose_simulated_node:
        code, fault_time = run_simulated_node_loss(recipe, overrides + scenario.settings,
                                                   faulted, world, fault_step)
    else:
        # A recovery that never comes must end the drill, not hang it.
        code = run_with_requeue(recipe, overrides + fault_overrides(scenario), faulted,
                                requeues=int(scenario.requeue_after_exit),
                                deadline=time.time() + timeout_s)[-1].exit_code
    result = {**analyse(reference, faulted, scenario, fault_time), "exit_code": code,
              "reference": str(reference), "faulted": str(faulted)}
    result["report"] = str(write_report(faulted, [reference]))
    write_atomic(root / f"chaos-{name}.json", json.dumps(result, indent=1))
    write_atomic(root / "chaos.json", json.dumps(result, indent=1))
    return result


def format_result(r: dict) -> str:
    def seconds(v):
        return "-" if v is None else f"{v:.2f} s"
    return "\n".join([
        f"scenario          {r['scenario']}",
        f"recovered         {r['recovered']} (exit code {r['exit_code']})",
        f"detection latency {seconds(r['detection_latency_s'])}",
        f"restart time      {seconds(r['restart_time_s'])}",
        f"steps lost        {r['steps_lost']}",
        f"restart kind      {r['restart_kind']}",
        f"hangs detected    {r['hang_detected']} (culprits {r['culprit_ranks']})",
        f"stragglers        {r['stragglers'] or 'none'}",
        f"final loss        {r['final_loss']!r} vs reference {r['reference_final_loss']!r}: "
        f"{'equal' if r['final_loss_equal'] else 'DIFFERENT'}",
        f"report            {r['report']}"])
