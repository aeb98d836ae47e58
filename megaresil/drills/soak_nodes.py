"""Where the soak's runs go: `local` (one `megaresil train` on this
machine, today's soak) or `netns`, two nodes in namespaces of their own
(drills/hosts.py) with one agent each, meeting as `--nnodes 2:2`. The job
may not shrink: every run, the calibration, the faulted one and the
reference, then has the same data-parallel layout on the same two nodes, so
the final states compare bit for bit. On nodes, this driver also strikes
the node episodes (schedule.NODE_KINDS) once the job has completed their
step, as drills/run.py's chaos drills do; the rank-level faults are the
recipe's `faults`, fired by the ranks themselves as on one machine."""
# mypy: ignore-errors
from __future__ import annotations

import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Optional

from megaresil.config import ConfigError, RecipeConfig
from megaresil.drills.hosts import RENDEZVOUS_PORT, NetnsHosts, netns_missing_reason
from megaresil.drills.run import (
    Launch,
    Rendezvous,
    poll_until,
    run_training,
    run_with_requeue,
    start_agents,
    step_records,
    wait_until,
)
from megaresil.drills.schedule import (
    NODE_KINDS,
    SLOW_LINK_FACTOR,
    SLOW_LINK_S,
    Calibration,
    flap_seconds,
)
from megaresil.resilience.preemption import PREEMPTED_EXIT

NODES = 2
MIN_RATE_BIT_S = 1_000_000
PROBE_FROM_STEP = 2  # the calibration measures the link from this step (step 1 warms up)

# An action the driver takes once the job has completed a step: (step, action).
Action = tuple[int, Callable[[], Optional[dict]]]


def check_nodes(cfg: RecipeConfig) -> None:
    """Refuse a soak on nodes that cannot run here, before any run."""
    if netns_missing_reason():
        raise ConfigError("--hosts", netns_missing_reason())
    world = cfg.parallel.world_size
    if world % NODES:
        raise ConfigError("--hosts", f"netns runs the job on {NODES} nodes with the same number "
                          f"of ranks each; the world of {world} ranks does not split",
                          "give parallel.* an even world size (e.g. parallel.dp=2)")


def is_node_fault(fault: dict) -> bool:
    return fault["kind"] in NODE_KINDS


class LocalJobs:
    """Each run one `megaresil train` on this machine (today's soak)."""

    def __enter__(self) -> "LocalJobs":
        return self

    def __exit__(self, *exc) -> None:
        pass

    def train(self, recipe: str, overrides: list[str], run_dir: Path, *, log: Path,
              timeout_s: Optional[float] = None) -> Launch:
        return run_training(recipe, overrides, run_dir, log=log, timeout_s=timeout_s)

    def calibrate(self, recipe: str, overrides: list[str], run_dir: Path, *, log: Path,
                  steps: int) -> tuple[Launch, float]:
        return self.train(recipe, overrides, run_dir, log=log), 0.0

    def faulted(self, recipe: str, overrides: list[str], run_dir: Path, node_faults: list[dict],
                *, requeues: int, log: Path, deadline: float, cal: Calibration,
                cfg: RecipeConfig) -> tuple[list[Launch], list[dict]]:
        assert not node_faults, "node episodes are scheduled only on nodes (--hosts netns)"
        return run_with_requeue(recipe, overrides, run_dir, requeues=requeues, log=log,
                                deadline=deadline), []


class NodeJobs:
    """Each run two agents on two nodes in namespaces (see the module
    docstring); the nodes live for the whole soak, so a requeued job finds
    its local tier where it left it."""

    def __init__(self, world: int):
        self.world = world
        self.launches = 0  # each launch meets at a port and job id of its own
        self.nodes = NetnsHosts(NODES)

    def __enter__(self) -> "NodeJobs":
        self.nodes.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self.nodes.__exit__(*exc)

    def run(self, recipe: str, overrides: list[str], run_dir: Path, *, log: Path,
            deadline: Optional[float] = None,
            actions: tuple[Action, ...] = ()) -> tuple[Launch, list[dict], int]:
        """One job on the nodes, to its end or the deadline, taking `actions`
        (in step order) as it reaches their steps. Returns (the launch, what
        the actions returned, how many were taken: those left wait for a
        requeue). The job's exit code is the first node's, or the second's
        when the first ended well."""
        self.launches += 1
        endpoint = f"{self.nodes.address(0)}:{RENDEZVOUS_PORT + self.launches}"
        started = time.time()
        with open(log, "ab") as out:
            agents = start_agents(recipe, overrides, run_dir, self.world, self.nodes,
                                  Rendezvous("c10d", endpoint), nnodes=f"{NODES}:{NODES}",
                                  stdout=out, stderr=subprocess.STDOUT)

        def late() -> bool:
            return deadline is not None and time.time() > deadline
        results, taken = [], 0
        for step, action in actions:
            if not poll_until(agents[0], lambda: late() or reached(run_dir, step)) or late():
                break
            results.append(action())
            taken += 1
        codes = [wait_until(agent, deadline) for agent in agents]
        code = next((c for c in codes if c != 0), 0)
        return Launch(started, time.time(), code), [r for r in results if r], taken

    def train(self, recipe: str, overrides: list[str], run_dir: Path, *, log: Path,
              timeout_s: Optional[float] = None) -> Launch:
        deadline = None if timeout_s is None else time.time() + timeout_s
        return self.run(recipe, overrides, run_dir, log=log, deadline=deadline)[0]

    def calibrate(self, recipe: str, overrides: list[str], run_dir: Path, *, log: Path,
                  steps: int) -> tuple[Launch, float]:
        """The calibration run, and the bytes per second the second node's
        link carried (the busier direction) from PROBE_FROM_STEP to its
        last step, `steps`: what a slow link is capped against."""
        def probe() -> dict:
            return {"time": time.time(), "bytes": self.nodes.link_bytes(1)}
        launch, probes, _ = self.run(recipe, overrides, run_dir, log=log,
                                     actions=((PROBE_FROM_STEP, probe), (steps, probe)))
        if len(probes) < 2:
            return launch, 0.0
        (a, b) = probes
        moved = max(y - x for x, y in zip(a["bytes"], b["bytes"]))
        return launch, moved / max(b["time"] - a["time"], 1e-3)

    def faulted(self, recipe: str, overrides: list[str], run_dir: Path, node_faults: list[dict],
                *, requeues: int, log: Path, deadline: float, cal: Calibration,
                cfg: RecipeConfig) -> tuple[list[Launch], list[dict]]:
        """The faulted job, requeued after each preemption (at most
        `requeues` times) like run_with_requeue, the node episodes struck
        as it reaches their steps (those a preemption comes before wait
        for the requeue). Returns the launches and the strikes."""
        flap_s = flap_seconds(cal, cfg)
        rate = f"{max(MIN_RATE_BIT_S, int(8 * cal.link_bytes_per_s / SLOW_LINK_FACTOR))}bit"
        pending = [(f["step"], lambda f=f: self.strike(f, flap_s, rate))
                   for f in sorted(node_faults, key=lambda f: f["step"])]
        launches, strikes = [], []
        while True:
            launch, struck, taken = self.run(recipe, overrides, run_dir, log=log,
                                             deadline=deadline, actions=tuple(pending))
            launches.append(launch)
            strikes += struck
            pending = pending[taken:]
            if launch.exit_code != PREEMPTED_EXIT or len(launches) > requeues:
                return launches, strikes

    def strike(self, fault: dict, flap_s: float, rate: str) -> dict:
        """A node episode: the node's link down for `flap_s` seconds, or
        capped at `rate` for SLOW_LINK_S seconds; then as before."""
        node, started = fault["node"], time.time()
        if fault["kind"] == "flap-link":
            self.nodes.cut(node)
            time.sleep(flap_s)
        else:
            self.nodes.cap(node, rate)
            time.sleep(SLOW_LINK_S)
        self.nodes.heal(node)
        return {**fault, "time": started, "healed": time.time(),
                "rate": rate if fault["kind"] == "slow-link" else None}


def reached(run_dir: Path, step: int) -> bool:
    return any(r["step"] >= step for r in step_records(run_dir))


def open_jobs(hosts: str, world: int):
    """The soak's runs for `--hosts` (check_nodes has passed for netns)."""
    return NodeJobs(world) if hosts == "netns" else LocalJobs()
