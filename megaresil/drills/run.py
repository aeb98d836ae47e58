"""Starting training runs for the drills: `megaresil train` as a separate
process (so every detection, restart and resume is the real one), to its end
or a deadline; requeued after a preemption like a scheduler would; agents
that form one elastic job and lose a node; and the step records they wrote."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import psutil

from megaresil.checkpoint import format as fmt
from megaresil.checkpoint.local.store import node_dir
from megaresil.checkpoint.paths import RunPaths
from megaresil.config import load_recipe
from megaresil.drills.scenarios import FLAP_S, RENDEZVOUS_OUTAGE_S, SICK_NODES_FILE, SLOW_LINK_RATE
from megaresil.events import read_events, read_metrics
from megaresil.resilience.preemption import PREEMPTED_EXIT
from megaresil.run_identity import run_id


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


@dataclass
class Rendezvous:
    """Where the agents of a multi-node scenario meet: c10d in the first
    agent (on a free local port unless given), or an etcd server's endpoint."""
    backend: str = "c10d"
    endpoint: Optional[str] = None
    conf: str = ""  # the agents' --rdzv-conf (etcd: e.g. read_timeout=1)

    def options(self, first: bool) -> list[str]:
        if self.backend == "c10d":
            return ["--rdzv-conf", f"is_host={int(first)}"]
        if not self.endpoint:
            raise ValueError(f"--rdzv-backend {self.backend} needs the etcd server: "
                             "add --rdzv-endpoint ETCD_HOST:PORT")
        return ["--rdzv-conf", self.conf] if self.conf else []


def run_node_fault(recipe: str, overrides: list[str], run_dir: Path, world: int,
                   fault_after_step: int, hosts, *, fault: str = "lose", first: bool = False,
                   rendezvous: Rendezvous = Rendezvous(), spares: int = 0,
                   sick_spare: bool = False,
                   timeout_s: Optional[float] = None) -> tuple[int, float]:
    """Two agents ("nodes") form one elastic job on `hosts` (drills/hosts.py);
    once `fault_after_step` is done, `fault` (scenarios.NODE_FAULTS) befalls
    one node: the second, or with `first` the first (with c10d it hosts the
    rendezvous store; as the lower pid or address it is also rank 0, whose
    agent hosts the workers' store). Returns (the other node's exit code,
    fault time); TIMED_OUT when it has not ended within `timeout_s`. With
    `spares`, that many more agents start and wait as hot spares; the node
    struck is one that trains (which agents the round took is theirs to race).
    With `sick_spare`, a waiting spare's health check fails first (the
    nodes' check reads scenarios.SICK_NODES_FILE) and it leaves."""
    deadline = None if timeout_s is None else time.time() + timeout_s
    agents = start_formed(recipe, overrides, run_dir, world, hosts, rendezvous, spares)
    # The rendezvous host is the node after the training ones and the spares.
    struck = len(agents) if fault == "rendezvous-outage" else 0 if first else 1
    other = agents[0 if struck else 1]
    if sick_spare:  # first, while the job trains its first steps
        wait_for_step(run_dir, 1, other)
        sicken_a_spare(hosts, agents, run_dir, other)
    struck_at = (wait_for_save(run_dir, fault_after_step, other) if fault == "partition-heal"
                 else wait_for_step(run_dir, fault_after_step, other))
    if spares and struck == 1:
        struck = next(i for i in range(1, len(agents)) if runs_workers(agents[i]))
    strike_node(hosts, struck, fault, run_dir, other)
    return wait_until(other, deadline), struck_at


# How many times a node drill starts its job before it gives up on forming it
# at its full size.
FORMING_ATTEMPTS = 3


def start_formed(recipe: str, overrides: list[str], run_dir: Path, world: int, hosts,
                 rendezvous: Rendezvous, spares: int) -> list[subprocess.Popen]:
    """start_agents, until the job's first generation forms with all `world`
    ranks. With `--nnodes 1:2` and the rendezvous' 5 s last call, an agent
    that a loaded machine starts late misses the first round and the job
    forms on the other node alone; a drill's fault would then strike a node
    the job does not have (CI saw a partition blame nobody, and a rendezvous
    outage outlast a job that had ended). Such a start is undone (its
    processes killed, the run directory emptied) and made again, said in a
    line; a job that ends before it forms is left to the caller."""
    for attempt in range(1, FORMING_ATTEMPTS + 1):
        agents = start_agents(recipe, overrides, run_dir, world, hosts, rendezvous, spares)
        formed = formed_world(run_dir, agents[0])
        if formed is None or formed == world:
            return agents
        print(f"megaresil chaos: the job formed with {formed} of {world} ranks (an agent "
              f"joined after the rendezvous' last call; start {attempt} of "
              f"{FORMING_ATTEMPTS}): starting it again", file=sys.stderr, flush=True)
        for agent in agents:
            kill_tree(agent.pid)
            agent.wait()
        shutil.rmtree(run_dir, ignore_errors=True)
    raise RuntimeError(f"the drill's job formed with fewer than its {world} ranks "
                       f"{FORMING_ATTEMPTS} times: an agent joins too late on this machine")


def formed_world(run_dir: Path, agent: subprocess.Popen) -> Optional[int]:
    """The world size the job's first generation formed with, once it has
    started; None when `agent` ended first."""
    def first_start() -> Optional[dict]:
        return next((e for e in read_events(run_dir) if e["event"] == "generation_started"),
                    None)
    if not poll_until(agent, lambda: first_start() is not None):
        return None
    started = first_start()
    assert started is not None  # poll_until saw it
    return started.get("world_size")


def sicken_a_spare(hosts, agents: list[subprocess.Popen], run_dir: Path,
                   other: subprocess.Popen) -> None:
    """List a waiting spare's node as sick and wait until its agent, finding
    so in its next check, has left (or the job has ended)."""
    # Not the first node, even waiting as a spare: it hosts the c10d rendezvous.
    spare = next(i for i in range(1, len(agents)) if not runs_workers(agents[i]))
    with open(run_dir / SICK_NODES_FILE, "a") as f:
        f.write(hosts.hostname(spare) + "\n")
    poll_until(other, lambda: agents[spare].poll() is not None)


def strike_node(hosts, node: int, fault: str, run_dir: Path, other: subprocess.Popen) -> None:
    """The node fault of a drill: lost, cut off for good, cut until the
    other node has re-formed the job and trained a step (`partition-heal`),
    cut for FLAP_S (or, the rendezvous host, RENDEZVOUS_OUTAGE_S) seconds, or
    its link capped (all but the first only on nodes in namespaces)."""
    if fault == "lose":
        hosts.lose(node)
    elif fault == "partition":
        hosts.cut(node)
    elif fault == "partition-heal":
        hosts.cut(node)
        wait_for_reform(run_dir, other)
        hosts.heal(node)
    elif fault in ("flap", "rendezvous-outage"):
        hosts.cut(node)
        time.sleep(FLAP_S if fault == "flap" else RENDEZVOUS_OUTAGE_S)
        hosts.heal(node)
    else:
        hosts.cap(node, SLOW_LINK_RATE)


def wait_for_reform(run_dir: Path, proc: subprocess.Popen) -> None:
    """Until a generation after the first has completed a step (or `proc`,
    the job's other node, has ended)."""
    poll_until(proc, lambda: any(r.get("generation", 0) > 0 for r in step_records(run_dir)))


def start_agents(recipe: str, overrides: list[str], run_dir: Path, world: int, hosts,
                 rendezvous: Rendezvous, spares: int = 0, nnodes: str = "1:2",
                 **popen) -> list[subprocess.Popen]:
    """One agent on each of the two nodes, and one on each spare node,
    meeting under a new job id; the job may shrink to one (unless `nnodes`
    says otherwise). `popen`: where their output goes."""
    endpoint = rendezvous.endpoint or hosts.rendezvous_endpoint()
    membership = ["--nnodes", nnodes, "--nproc-per-node", str(world // 2),
                  "--rdzv-backend", rendezvous.backend, "--rdzv-endpoint", endpoint,
                  "--rdzv-id", f"chaos-{os.getpid()}-{time.time_ns()}"]
    membership += ["--spares", str(spares)] if spares else []
    command = train_command(recipe, overrides, run_dir) + membership
    return [hosts.start(node, command + hosts.node_options(node)
                        + rendezvous.options(first=node == 0), **popen)
            for node in range(2 + spares)]


def runs_workers(agent: subprocess.Popen) -> bool:
    """Whether an agent's node trains (a spare's agent has no workers)."""
    try:
        return any("RANK" in proc.environ() for proc in
                   psutil.Process(agent.pid).children(recursive=True))
    except psutil.NoSuchProcess:
        return False


def wait_until(proc: subprocess.Popen, deadline: Optional[float]) -> int:
    """The process's exit code, or TIMED_OUT (it and its children killed)
    at the deadline (epoch s)."""
    try:
        return proc.wait(timeout=None if deadline is None else max(0.0, deadline - time.time()))
    except subprocess.TimeoutExpired:
        kill_tree(proc.pid)
        proc.wait()
        return TIMED_OUT


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
    run_local = RunPaths.of(cfg).local_run_dir(run_id(run_dir))
    shutil.rmtree(node_dir(run_local, node), ignore_errors=True)
    return agent.wait(), lost_at


def run_killing_replacement(recipe: str, overrides: list[str], run_dir: Path,
                            deadline: Optional[float]) -> tuple[int, Optional[float]]:
    """The job, with the first process its agent puts in a lost worker's
    place killed as soon as it is recorded (a second failure while the first
    is being repaired). Returns (exit code, when the replacement was killed)."""
    agent = subprocess.Popen(train_command(recipe, overrides, run_dir))
    killed_at = None
    if poll_until(agent, lambda: replacement_pid(run_dir) is not None, interval_s=0.01):
        try:
            psutil.Process(replacement_pid(run_dir)).kill()
            killed_at = time.time()
        except psutil.NoSuchProcess:
            pass
    return wait_until(agent, deadline), killed_at


def replacement_pid(run_dir: Path) -> Optional[int]:
    """The process the first live replacement put in a lost worker's place."""
    return next((e["pid"] for e in read_events(run_dir)
                 if e["event"] == "restart" and e.get("kind") == "replace"), None)


def poll_until(proc: subprocess.Popen, done: Callable[[], bool], interval_s: float = 0.05) -> bool:
    """Until `done()` (True) or `proc`, the job, has ended (False)."""
    while proc.poll() is None:
        if done():
            return True
        time.sleep(interval_s)
    return False


def wait_for_step(run_dir: Path, step: int, proc: subprocess.Popen) -> float:
    if not poll_until(proc, lambda: any(r["step"] >= step for r in step_records(run_dir))):
        raise RuntimeError("the job ended before the node could be lost")
    return time.time()


def wait_for_save(run_dir: Path, step: int, proc: subprocess.Popen) -> float:
    """Until `step`'s save has begun (its partial directory is there), so
    that a cut lands inside it; or, should the save be over before a look
    saw it, until the next step is done."""
    pattern = f"{fmt.step_dir_name(step)}.partial-*"
    if not poll_until(proc, lambda: any((run_dir / "checkpoints").glob(pattern)) or any(
            r["step"] > step for r in step_records(run_dir)), interval_s=0.01):
        raise RuntimeError("the job ended before the node could be cut off")
    return time.time()


def start_hogs(count: int) -> list[subprocess.Popen]:
    """Busy processes beside the run: a machine shared with other work."""
    return [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(count)]
