"""The chaos scenarios: which faults a scenario injects and with which
resilience settings (`megaresil chaos --scenario NAME`). Light on purpose:
`megaresil chaos --help` lists the names without importing torch."""
from __future__ import annotations

import json
import shlex
from dataclasses import dataclass, field


@dataclass
class Scenario:
    name: str
    faults: list[dict]
    settings: list[str] = field(default_factory=list)  # resilience.* overrides
    expect_restart: bool = True
    requeue_after_exit: bool = False  # like a scheduler rerunning a preempted job
    nodes: int = 1  # > 1: agents that form one elastic job; the last one meets node_fault
    node_fault: str = "lose"  # what befalls that node: one of NODE_FAULTS
    lose_first: bool = False  # the fault befalls the node that started first (the c10d host)
    lose_simulated_node: bool = False  # kill the local tier's last simulated node, wipe its dir
    # The agents meet at an etcd of the drill's own, on a node of its own
    # (--hosts netns), which node_fault strikes instead of a training node.
    rendezvous_host: bool = False
    # Settings of a reference run of the scenario's own (the shared one has none).
    reference_settings: list[str] = field(default_factory=list)
    min_dp: int = 1  # replicas to compare (the bit flips): over dp and cp
    spike_window: int = 0  # > 0: the fault step must come after warmup and this many steps
    kill_replacement: bool = False  # the first replacement started is killed as it appears
    spares: int = 0  # node scenarios: agents that wait as hot spares beside the two nodes
    sick_spare: bool = False  # a waiting spare fails its health check before the fault


# Where the node scenarios' nodes run (drills/hosts.py): named here, with the
# scenarios, for `chaos --help`.
HOSTS_MODES = ("local", "netns")
# What befalls a node scenario's node: it dies (any hosts), or its link, which
# only nodes in namespaces have: cut for good (a partition: its processes live
# on), cut until the job re-formed without it, cut for FLAP_S seconds, capped
# at SLOW_LINK_RATE, or (the rendezvous host's) cut for RENDEZVOUS_OUTAGE_S.
NODE_FAULTS = ("lose", "partition", "partition-heal", "flap", "slow", "rendezvous-outage")
FLAP_S = 3.0
# Long enough for the agents' reads to fail during it, not only wait: a read
# gives up after ~4 read timeouts (python-etcd's retries), ~8 s here. The
# timeout is not 1 s: on a loaded machine the drill's etcd (an fsync per
# write) answered the agents' exit barrier later than that, outage or not.
RENDEZVOUS_OUTAGE_S = 20.0
RENDEZVOUS_READ_TIMEOUT_S = 2
# rendezvous-outage: steps slowed by this (computing) from the strike on, so
# the job still trains, twice the outage, when the rendezvous host comes
# back (from --step 3 of 8 steps on).
OUTAGE_STEP_S = 8.0
# The demo's 2.6M parameters at dp=2: ~10 MB of gradients all-reduced a step,
# ~4-7 s at this rate.
SLOW_LINK_RATE = "20mbit"
# Budgets a slowed step passes (the slowest section seen, at least 2 s, not 5
# times it) and a hard limit well beyond it.
SLOW_STEP_BUDGETS = ["resilience.watchdog.factor=1", "resilience.watchdog.floor_s=2",
                     "resilience.watchdog.slow_limit_factor=10"]
SPIKE_WINDOW = 5  # loss-spike: a short window, so a short drill has the detector on
# node-loss-unhealthy: the hostnames listed in this file (in the faulted run's
# directory) fail the drill's health check, which the nodes run every
# SICK_CHECK_S seconds while they wait.
SICK_NODES_FILE = "sick_nodes"
SICK_CHECK_S = 1.0
SICK_STEP_S = 1.0  # a step's extra seconds while the sick spare leaves (~2 s)


def sick_node_check(run_dir: str) -> list[str]:
    """The settings of a health check that fails on the nodes the drill
    lists as sick (a JSON string: YAML would read `!` as a tag)."""
    sick = shlex.quote(f"{run_dir}/{SICK_NODES_FILE}")
    command = (f"if grep -qsx \"$(hostname)\" {sick}; then "
               "echo 'listed as sick by the drill'; exit 1; fi")
    return [f"resilience.health.command={json.dumps(command)}",
            f"resilience.health.interval_s={SICK_CHECK_S}"]


def local_tier_settings(world: int) -> list[str]:
    """Local saves every step on two simulated nodes, each rank's shard
    copied to the other."""
    return ["checkpoint.local.enabled=true", "checkpoint.local.interval=1",
            "checkpoint.local.replicas=1", f"checkpoint.local.ranks_per_node={max(1, world // 2)}"]


def scenarios(rank: int, step: int, save_step: int, world: int = 2,
              global_batch: int = 1, peer: int = 0) -> dict[str, Scenario]:
    """The scenarios of a fault on `rank` at `step` (`save_step`: a step
    that saves); `peer`: a peer holding `rank`'s whole state (chaos.whole_state_peer)."""
    in_process = ["resilience.in_process=true"]
    replace = in_process + ["resilience.replacement.enabled=true"]
    relaunch = ["resilience.in_process=false", "resilience.max_restarts=2"]
    local = local_tier_settings(world)
    spike = ["resilience.numerics.on_spike=rollback",
             f"resilience.numerics.spike_window={SPIKE_WINDOW}"]
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
        # Replayed at once, no restart: the final loss is the reference's.
        Scenario("nan-in-grads", [{"kind": "nan", "rank": rank, "step": step}], in_process,
                 expect_restart=False),
        # Back to the newest checkpoint, the step's batch skipped: the reference
        # skips the same batch from the start.
        Scenario("nan-in-grads-persistent",
                 [{"kind": "nan", "rank": rank, "step": step, "persistent": True}], in_process,
                 expect_restart=False, reference_settings=[
                     f"resilience.numerics.skip_batches=[[{(step - 1) * global_batch}, "
                     f"{global_batch}]]"]),
        # Back to the newest checkpoint, the spike's batch skipped: the
        # reference skips the same batch from the start (with the detector on,
        # which must raise no false alarm there).
        Scenario("loss-spike", [{"kind": "spike", "rank": rank, "step": step}],
                 in_process + spike, expect_restart=False, spike_window=SPIKE_WINDOW,
                 reference_settings=spike + [
                     f"resilience.numerics.skip_batches=[[{(step - 1) * global_batch}, "
                     f"{global_batch}]]"]),
        # One replica's copy differs: found by the replica checksum (restored
        # from a healthy replica at dp >= 3, by a replay at dp = 2) or by the
        # non-finite check; the final loss is the reference's.
        Scenario("bitflip-param", [{"kind": "bitflip", "rank": rank, "step": step}], in_process,
                 expect_restart=False, min_dp=2),
        Scenario("bitflip-grad", [{"kind": "bitflip", "rank": rank, "step": step,
                                   "target": "grad", "bit": 22}], in_process,
                 expect_restart=False, min_dp=2),
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
        # A spare waits; the node lost, it takes its place: dp stays 2.
        Scenario("node-loss-spare", [], relaunch, nodes=2, spares=1),
        # Two spares wait; one fails its health check while it waits and
        # leaves, excluded; then a node is lost: the other spare takes its place.
        # Steps slowed from step 1 (computing: the losses stay the reference's),
        # so the job still trains when the node is lost after the spare left.
        Scenario("node-loss-unhealthy",
                 [{"kind": "slow", "rank": rank, "step": 1, "seconds": SICK_STEP_S}], relaunch,
                 nodes=2, spares=2, sick_spare=True),
        # The node's processes live on, cut off: the others re-form without it.
        Scenario("partition-node", [], relaunch, nodes=2, node_fault="partition"),
        # Cut as a save begins (--step a save step); the link comes back once
        # the job re-formed without the node.
        Scenario("partition-heal", [], relaunch, nodes=2, node_fault="partition-heal"),
        # Connections stall, then resume at their next retransmission: a stall
        # past the watchdog's budget is a hang, restarted in place.
        Scenario("flap-link", [], in_process, nodes=2, node_fault="flap"),
        # Budgets the first capped step passes, whatever the load: the drill
        # shows a rank waiting on a slow link judged slow, not hung, since it
        # still moves bytes.
        Scenario("slow-link", [], in_process + SLOW_STEP_BUDGETS, nodes=2, node_fault="slow",
                 expect_restart=False),
        # The rendezvous host (etcd) out of reach while the job trains: the
        # job needs it only to change its membership, so it trains on.
        Scenario("rendezvous-outage",
                 [{"kind": "slow", "rank": rank, "step": step, "seconds": OUTAGE_STEP_S}],
                 in_process + SLOW_STEP_BUDGETS, nodes=2, node_fault="rendezvous-outage",
                 rendezvous_host=True, expect_restart=False),
        # Only the killed process starts again; the others wait in theirs and
        # it takes its state from a data-parallel peer: no step lost.
        Scenario("kill-rank-replace", [{"kind": "kill", "rank": rank, "step": step}], replace),
        # The replacement is killed too, before it joined: its agent starts
        # another, which the others wait for as well.
        Scenario("kill-during-replacement", [{"kind": "kill", "rank": rank, "step": step}],
                 replace, kill_replacement=True),
        # A bit flips in a replica's weights after the replica check, and its
        # peer is lost before the next one: the flipped replica cannot prove
        # its state, so it donates nothing; the job resumes from the
        # checkpoints, which restore both replicas.
        Scenario("corrupt-donor-replace", [{"kind": "bitflip", "rank": rank, "step": step},
                                           {"kind": "kill", "rank": peer, "step": step + 1}],
                 replace + [f"resilience.numerics.check_interval={step + 1}"], min_dp=2),
        Scenario("kill-rank-local", [{"kind": "kill", "rank": rank, "step": step}],
                 relaunch + local),
        Scenario("node-loss-local", [], relaunch + local, lose_simulated_node=True),
    ]}


def fault_overrides(scenario: Scenario) -> list[str]:
    return [f"faults={json.dumps(scenario.faults)}", *scenario.settings]
