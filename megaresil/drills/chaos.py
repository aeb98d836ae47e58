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

import dataclasses
import json
import shutil
import time
from pathlib import Path
from typing import Optional

from megaresil.config import ConfigError, load_recipe
from megaresil.drills.analyse import analyse_scenario
from megaresil.drills.etcd import CLIENT_PORT, PEER_PORT, EtcdServer, etcd_missing_reason
from megaresil.drills.hosts import netns_missing_reason, open_hosts
from megaresil.drills.run import (
    Rendezvous,
    run_killing_replacement,
    run_node_fault,
    run_simulated_node_loss,
    run_training,
    run_with_requeue,
)
from megaresil.drills.scenarios import (
    RENDEZVOUS_READ_TIMEOUT_S,
    Scenario,
    fault_overrides,
    scenarios,
    sick_node_check,
)
from megaresil.observe.report import write_report
from megaresil.parallel.layout import ParallelLayout, visible_gpus
from megaresil.resilience.faults import check_device_faults
from megaresil.safe_files import write_atomic


def run_scenario(recipe: str, overrides: list[str], name: str, *, reference: Optional[Path],
                 rank: Optional[int], step: Optional[int],
                 rendezvous: Rendezvous = Rendezvous(), timeout_s: float = 900.0,
                 hosts: str = "local") -> dict:
    cfg = load_recipe(recipe, overrides)
    root = Path(cfg.run.dir)
    world = cfg.parallel.world_size
    # The scenarios need to know the save steps: auto (or never) becomes every 2 steps.
    configured = cfg.checkpoint.interval
    interval = configured if isinstance(configured, int) and configured > 0 else 2
    if interval != configured:
        overrides = [*overrides, f"checkpoint.interval={interval}"]
    fault_step = step or cfg.train.steps // 2 + 1
    save_step = interval * max(2, fault_step // interval)
    rank = world - 1 if rank is None else rank
    table = scenarios(rank, fault_step, save_step, world, cfg.train.global_batch_size,
                      whole_state_peer(cfg, rank))
    if name not in table:
        raise ValueError(f"--scenario: unknown scenario {name!r}; one of {sorted(table)}")
    scenario = table[name]
    if hosts == "netns" and scenario.lose_simulated_node:
        scenario = on_real_nodes(scenario)
    check_fits(scenario, cfg, fault_step)
    # The faulted run's own recipe, refused here in one line: its workers
    # would each raise the ConfigError, relaunched until the budget is spent.
    load_recipe(recipe, overrides + fault_overrides(scenario))
    check_hosts(scenario, hosts, rendezvous)
    check_reference(reference)
    check_device_faults(scenario.faults, visible_gpus())
    if reference is None or scenario.reference_settings:  # a reference of its own
        reference = root / ("reference-" + name if scenario.reference_settings else "reference")
        shutil.rmtree(reference, ignore_errors=True)
        if run_training(recipe, overrides + scenario.reference_settings,
                        reference).exit_code != 0:
            raise RuntimeError("the fault-free reference run failed")
    faulted = root / f"faulted-{name}"
    shutil.rmtree(faulted, ignore_errors=True)
    fault_time = None
    if scenario.nodes > 1:
        own_etcd = hosts == "netns" and needs_etcd(scenario, rendezvous)
        agents = scenario.nodes + scenario.spares
        with open_hosts(hosts, agents + own_etcd) as nodes:
            if own_etcd:
                rendezvous = serve_rendezvous(nodes, agents, rendezvous.backend)
            sick = sick_node_check(str(faulted)) if scenario.sick_spare else []
            code, fault_time = run_node_fault(recipe, overrides + fault_overrides(scenario) + sick,
                                              faulted, world, fault_step, nodes,
                                              fault=scenario.node_fault,
                                              first=scenario.lose_first,
                                              rendezvous=rendezvous, spares=scenario.spares,
                                              sick_spare=scenario.sick_spare,
                                              timeout_s=timeout_s)
    elif scenario.kill_replacement:
        code, _ = run_killing_replacement(recipe, overrides + fault_overrides(scenario), faulted,
                                          deadline=time.time() + timeout_s)
    elif scenario.lose_simulated_node:
        code, fault_time = run_simulated_node_loss(recipe, overrides + scenario.settings,
                                                   faulted, world, fault_step)
    else:
        # A recovery that never comes must end the drill, not hang it.
        code = run_with_requeue(recipe, overrides + fault_overrides(scenario), faulted,
                                requeues=int(scenario.requeue_after_exit),
                                deadline=time.time() + timeout_s)[-1].exit_code
    result = {**analyse_scenario(reference, faulted, scenario, fault_time), "exit_code": code,
              "reference": str(reference), "faulted": str(faulted), "hosts": hosts}
    result["report"] = str(write_report(faulted, [reference]))
    write_atomic(root / f"chaos-{name}.json", json.dumps(result, indent=1))
    write_atomic(root / "chaos.json", json.dumps(result, indent=1))
    return result


def on_real_nodes(scenario: Scenario) -> Scenario:
    """A scenario of simulated nodes (one agent, the local tier's nodes a
    split of its ranks) as nodes in namespaces: an agent on each, each
    node's shards in its own /dev/shm and their replicas across the link,
    and a spare that takes the lost node's place (the layout kept), its
    shards from the replicas on the node that survived."""
    return dataclasses.replace(scenario, nodes=2, spares=1, lose_simulated_node=False)


def serve_rendezvous(nodes, node: int, backend: str) -> Rendezvous:
    """An etcd of the drill's own on `node` (a namespace apart from the
    training nodes: the agents reach it over the bridge, and its link can be
    cut), removed with the nodes. Its reads time out in
    RENDEZVOUS_READ_TIMEOUT_S, not TorchElastic's 60 s, so an outage shows in
    a drill's seconds."""
    server = EtcdServer(nodes.dir / "etcd", nodes.address(node), (CLIENT_PORT, PEER_PORT))
    server.start(launch=lambda command, **popen: nodes.start(node, command, **popen))
    return Rendezvous("etcd-v2" if backend == "c10d" else backend, server.endpoint,
                      f"read_timeout={RENDEZVOUS_READ_TIMEOUT_S}")


def needs_etcd(scenario, rendezvous: Rendezvous) -> bool:
    """Whether the agents meet at etcd: the scenario strikes the rendezvous
    host, or the user chose an etcd backend (on nodes in namespaces the
    drill then runs that etcd itself: serve_rendezvous)."""
    return scenario.rendezvous_host or rendezvous.backend != "c10d"


def whole_state_peer(cfg, rank: int) -> int:
    """A peer holding `rank`'s whole state (ParallelLayout.whole_state_groups:
    its data-parallel replicas, and its context-parallel peers): the next in
    its group, or at the last the one before."""
    group = next(group for group in ParallelLayout.planned(cfg.parallel, rank)
                 .whole_state_groups() if rank in group)
    at = group.index(rank)
    return group[at + 1] if at + 1 < len(group) else group[at - 1]


def replicas(cfg) -> int:
    """How many ranks hold each dense parameter alike, which the replica
    check compares (ParallelLayout.replica_axes: dp, and cp's peers; under
    sharded data parallelism dp_replicate's)."""
    layout = ParallelLayout.planned(cfg.parallel, 0)
    return layout.size(*layout.replica_axes()[0])


def check_fits(scenario, cfg, fault_step: int) -> None:
    """Refuse a drill that could not show what it tests, before any run."""
    p = cfg.parallel
    if replicas(cfg) < scenario.min_dp and p.dp_shard > 1:
        # dp is not what is short: full sharding holds each shard once.
        raise ValueError(f"--scenario {scenario.name}: needs data-parallel replicas to compare; "
                         f"parallel.dp_shard={p.dp_shard} of dp={p.dp} leaves "
                         f"{replicas(cfg)}; set parallel.dp to {scenario.min_dp} x "
                         f"parallel.dp_shard (HSDP: dp_replicate replicas of each shard)")
    if replicas(cfg) < scenario.min_dp:
        raise ValueError(f"--scenario {scenario.name}: needs data-parallel replicas to compare "
                         f"(parallel.dp >= {scenario.min_dp}, got {p.dp}); add "
                         f"parallel.dp={scenario.min_dp}")
    earliest = cfg.optimizer.warmup_steps + scenario.spike_window + 1
    if scenario.spike_window and fault_step < earliest:
        raise ValueError(f"--scenario {scenario.name}: the spike detector is off until step "
                         f"{earliest} (optimizer.warmup_steps={cfg.optimizer.warmup_steps} plus "
                         f"a window of {scenario.spike_window} steps); give --step {earliest} "
                         "or later")


def check_reference(reference: Optional[Path]) -> None:
    if reference is not None and not (reference / "metrics.jsonl").exists():
        raise ConfigError("--reference", f"{reference} holds no run (no metrics.jsonl)",
                          "give the run directory of a fault-free run of the same recipe "
                          "(a chaos run's reference/), or leave --reference out")


def check_hosts(scenario, hosts: str, rendezvous: Rendezvous) -> None:
    """Refuse nodes in namespaces where there are none, or where they could
    not meet, before any run."""
    if hosts == "local":
        if scenario.node_fault != "lose":
            raise ConfigError("--hosts", f"--scenario {scenario.name} strikes a node's link, "
                              "which only nodes in namespaces have.", "add --hosts netns")
        if scenario.sick_spare:
            raise ConfigError("--hosts", f"--scenario {scenario.name} excludes a node by its "
                              "hostname, and the nodes on this machine share one.",
                              "add --hosts netns")
        return
    if scenario.nodes == 1:
        raise ConfigError("--hosts", f"--scenario {scenario.name} runs no nodes to put in "
                          "namespaces", "use --hosts netns with a node-loss or link scenario, "
                          "or leave --hosts out")
    if rendezvous.endpoint and rendezvous.backend != "c10d":
        raise ConfigError("--rdzv-endpoint", f"the nodes in namespaces reach only their "
                          f"bridge, not the etcd server at {rendezvous.endpoint}",
                          "leave --rdzv-endpoint out: the drill runs an etcd of its own on "
                          "a node of its own")
    if missing := netns_missing_reason():
        raise ConfigError("--hosts", missing)
    if needs_etcd(scenario, rendezvous) and etcd_missing_reason():
        raise ConfigError("--hosts", f"the drill's own etcd cannot run: {etcd_missing_reason()}")


def format_result(r: dict) -> str:
    def seconds(v):
        return "-" if v is None else f"{v:.2f} s"
    return "\n".join([
        f"scenario          {r['scenario']}",
        f"hosts             {r['hosts']}",
        f"recovered         {r['recovered']} (exit code {r['exit_code']})",
        f"detection latency {seconds(r['detection_latency_s'])}",
        f"restart time      {seconds(r['restart_time_s'])}",
        f"steps lost        {r['steps_lost']}",
        f"restart kind      {r['restart_kind']} ({r['replacements']} process(es) replaced, "
        f"{r['relaunches']} relaunch(es) of all)",
        f"hangs detected    {r['hang_detected']} (culprits {r['culprit_ranks']})",
        f"stragglers        {r['stragglers'] or 'none'}",
        f"stale writes      {r['stale_writes']} (fenced {r['fenced']})",
        f"excluded nodes    {', '.join(r['excluded_nodes']) or 'none'}",
        f"final loss        {r['final_loss']!r} vs reference {r['reference_final_loss']!r}: "
        f"{'equal' if r['final_loss_equal'] else 'DIFFERENT'}",
        f"report            {r['report']}"])
