"""The recovery policies `megaresil plan` projects, each failure recovered by
what it took out (its scope: process, node or job; profiles/llama3_405b.yaml):
relaunch (today: every worker, from the newest save; a lost node waits for a
host first), live replacement (a lost process alone, its state from a
data-parallel peer's memory: no completed step lost; a lost node as today),
and live replacement + hot spares (a waiting spare node takes a lost node's
place: a relaunch without the wait; the spares are idle GPUs, which goodput
per GPU counts). Job-scope failures take their own path under every policy.
Where the run's layout holds no live copy of a lost rank's state
(config.no_live_copy, read from its recipe) a replacement resumes from the
newest save, and where its recipe refuses live replacement (ep = dp) the live
policies give way to hot spares alone. docs/clusters.md ("The goodput planner") says it for users."""
from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any, Optional

from megaresil.config import NoLiveCopy
from megaresil.plan.costs import RunCosts, SaveCost
from megaresil.plan.model import Policy
from megaresil.plan.simulate import Kind, Setup, simulate

# The size every plan projects to besides --gpus: Llama 3 405B's, whose
# failures the default profile holds.
REFERENCE_GPUS = 16384
# One spare node per this many: at the default profile's rate (5.9 node
# failures a day at 16,384 GPUs) 16 spares cover 2.7 days of repair, for
# 0.8% of the GPUs; the plan prints the coverage for the numbers it used.
DEFAULT_SPARE_EVERY = 128
DEFAULT_GPUS_PER_NODE = 8  # an H100 host's, as the default profile's
LIVE_PATHS = {"replace"}  # recoveries that resume at the step reached
MEASURE_REPLACEMENT = ("megaresil chaos RECIPE --scenario kill-rank-replace run.dir=DIR, "
                       "then megaresil plan DIR")


@dataclass(frozen=True)
class RecoveryPolicy:
    name: str
    process_path: str  # the recovery of a process-scope failure
    node_path: str  # the recovery of a node-scope failure
    hot_spares: bool


POLICIES = (RecoveryPolicy("relaunch (today)", "relaunch", "node_replacement", False),
            RecoveryPolicy("live replacement", "replace", "node_replacement", False),
            RecoveryPolicy("live replacement + hot spares", "replace", "relaunch", True))
# Where live replacement is refused, spares still take a lost node's place.
SPARES_ALONE = RecoveryPolicy("hot spares", "relaunch", "relaunch", True)


@dataclass(frozen=True)
class Spares:
    every_nodes: int  # one spare node per this many nodes of the job
    gpus_per_node: int

    def __post_init__(self):
        if self.every_nodes < 1 or self.gpus_per_node < 1:
            raise ValueError(f"spares: one per {self.every_nodes} nodes of {self.gpus_per_node} "
                             "GPUs: give --spare-every and --gpus-per-node of 1 or more")

    def nodes(self, gpus: int) -> int:
        return math.ceil(gpus / self.gpus_per_node / self.every_nodes)

    def gpus(self, gpus: int) -> int:
        return self.nodes(gpus) * self.gpus_per_node


DEFAULT_SPARES = Spares(DEFAULT_SPARE_EVERY, DEFAULT_GPUS_PER_NODE)


def mean_downtime(kinds: list[Kind], restart_s: dict[str, float]) -> float:
    """The expected downtime of one failure, over the kinds' rates and paths."""
    return sum(k.per_s * restart_s[k.path] for k in kinds) / sum(k.per_s for k in kinds)


def per_day(kinds: list[Kind], scope: str) -> float:
    return sum(k.per_s for k in kinds if k.scope == scope) * 86400


def recovered_by(policy: RecoveryPolicy, kinds: list[Kind], restart_s: dict) -> list[Kind]:
    """The kinds with the paths the policy recovers them by; a path the run
    measured nothing for (an in-process restart) relaunches instead."""
    by_scope = {"process": policy.process_path, "node": policy.node_path}
    mapped = [replace(k, path=by_scope.get(k.scope, k.path)) for k in kinds]
    return [k if k.path in restart_s else replace(k, path="relaunch") for k in mapped]


def replacement_cost(costs: RunCosts, restart_s: dict[str, float]) -> dict:
    """What the run measured of a live replacement and of a relaunch; an
    unmeasured replacement is planned at the relaunch's downtime, and says so."""
    measured = costs.recoveries()
    found: dict[str, dict[str, Any]] = {kind: {"measured": kind in measured, "downtime_s": restart_s[kind],
                    "count": measured[kind].count if kind in measured else 0,
                    "steps_lost": measured[kind].steps_lost if kind in measured else None}
             for kind in ("replace", "relaunch")}
    if "replace" not in measured:
        found["replace"]["stand_in"] = "the relaunch's downtime"
        found["replace"]["measure"] = MEASURE_REPLACEMENT
    return found


@dataclass
class Projection:
    """What the projections at every size share."""
    restart_s: dict[str, float]  # downtime per recovery path
    step_s: float
    spares: Spares
    simulate_days: Optional[float] = None
    seed: int = 0
    no_live_copy: Optional[NoLiveCopy] = None  # the run's layout's, where its recipe says

    @property
    def policies(self) -> tuple[RecoveryPolicy, ...]:
        if self.no_live_copy and self.no_live_copy.refused:
            return POLICIES[0], SPARES_ALONE
        return POLICIES

    @property
    def live_paths(self) -> set[str]:
        """The paths that resume at the step reached: none where no live rank
        holds a copy of a lost rank's state."""
        return set() if self.no_live_copy else LIVE_PATHS

    def at(self, gpus: int, kinds: list[Kind], save: SaveCost) -> dict:
        """The policies at `gpus` GPUs failing as `kinds`, saving at `save`'s cost."""
        spare_nodes = self.spares.nodes(gpus)
        node_per_day = per_day(kinds, "node")
        return {"gpus": gpus,
                "failures_per_day": {s: per_day(kinds, s) for s in ("process", "node", "job")},
                "spare_nodes": spare_nodes, "spare_gpus": self.spares.gpus(gpus),
                "spare_days_of_repair": spare_nodes / node_per_day if node_per_day else None,
                "policies": [self.row(p, gpus, kinds, save) for p in self.policies]}

    def row(self, policy: RecoveryPolicy, gpus: int, kinds: list[Kind], save: SaveCost) -> dict:
        mapped = recovered_by(policy, kinds, self.restart_s)
        rate = sum(k.per_s for k in mapped)
        model = Policy(policy.name, save.blocking_s, save.total_s,
                       mean_downtime(mapped, self.restart_s),
                       rollback=sum(k.per_s for k in mapped if k.path not in self.live_paths) / rate)
        tau = model.best_interval(1 / rate, self.step_s)
        idle = self.spares.gpus(gpus) if policy.hot_spares else 0
        busy = gpus / (gpus + idle)  # spares hold GPUs that train nothing
        goodput = model.goodput(tau, 1 / rate)
        row = {"policy": policy.name, "process": policy.process_path, "node": policy.node_path,
               "spare_gpus": idle, "mean_restart_s": model.restart_s,
               "rollback_share": model.rollback, "best_interval_steps": round(tau / self.step_s),
               "expected_goodput": goodput, "goodput_per_gpu": goodput * busy}
        if self.simulate_days:
            setup = Setup(steps=int(self.simulate_days * 86400 / self.step_s),
                          step_s=self.step_s, interval=round(tau / self.step_s),
                          blocking_s=save.blocking_s, total_s=save.total_s,
                          restart_s=self.restart_s, live_paths=self.live_paths)
            result = simulate(setup, mapped, seed=self.seed)
            row["simulated"] = {**result.to_dict(), "goodput_per_gpu": result.goodput * busy}
        return row


def format_recovery(recovery: dict) -> list[str]:
    """The recovery section of the plan's text."""
    replace_, relaunch = recovery["costs"]["replace"], recovery["costs"]["relaunch"]
    gap = recovery.get("no_live_copy")
    if gap and gap["refused"]:
        lines = [f"relaunch: {describe(relaunch)}",
                 f"the run's layout refuses live replacement ({gap['why']}): its policies "
                 "are left out; hot spares alone relaunch a lost process"]
    else:
        lines = [f"live replacement (resilience.replacement.enabled): {describe(replace_)}; "
                 f"relaunch: {describe(relaunch)}", *replacement_caveats(replace_, gap)]
    spares = recovery["spares"]
    lines.append(f"recovery policies (saves: {recovery['save_tier']} tier; hot spares: 1 node "
                 f"of {spares['gpus_per_node']} GPUs per {spares['every_nodes']} nodes, "
                 "--spare-every):")
    for at in recovery["projections"]:
        lines += format_projection(at)
    return lines


def replacement_caveats(replace_: dict, gap: Optional[dict]) -> list[str]:
    """What the projection of a live replacement rests on, where it is
    allowed: the layout's copies (`gap`: none to take state from) and the
    run's own measure of it."""
    lines = []
    if gap:
        lines.append(f"the run's layout: {gap['why']}, so a live replacement resumes from the "
                     "newest save (projected so: its rollback)")
    if not replace_["measured"]:
        lines.append(f"the run has no live replacement: its downtime is unmeasured and the "
                     f"relaunch's stands in; to measure it: {replace_['measure']}")
    elif replace_["steps_lost"] and not gap:
        lines.append(f"the run's replacement lost {replace_['steps_lost']:.1f} steps (no live "
                     "peer held the state: dp = 1 or optimizer.distributed); the projection "
                     "assumes a data-parallel peer holds it (0 steps lost)")
    return lines


def describe(cost: dict) -> str:
    if cost["measured"]:
        return (f"downtime {cost['downtime_s']:.1f} s, {cost['steps_lost']:.1f} steps lost "
                f"(measured, {cost['count']} in the run)")
    return f"downtime {cost['downtime_s']:.1f} s (estimate: {cost.get('stand_in', 'start-up')})"


def format_projection(at: dict) -> list[str]:
    rates = ", ".join(f"{s} {n:.2f}" for s, n in at["failures_per_day"].items())
    cover = (f", covering {at['spare_days_of_repair']:.1f} days of node repair"
             if at["spare_days_of_repair"] is not None else "")
    lines = [f"  {at['gpus']:,} GPUs: failures a day by scope: {rates}; "
             f"{at['spare_nodes']} spare node{'s' * (at['spare_nodes'] != 1)} "
             f"({at['spare_gpus']} GPUs){cover}",
             f"  {'policy':<31} {'process':>8} {'node':>16} {'spare GPUs':>10} "
             f"{'restart s':>9} {'rollback':>8} {'interval':>8} {'goodput':>8} "
             f"{'per GPU':>8} {'simulated':>9}"]
    for r in at["policies"]:
        sim = r.get("simulated")
        lines.append(f"  {r['policy']:<31} {r['process']:>8} {r['node']:>16} "
                     f"{r['spare_gpus']:>10} {r['mean_restart_s']:>9.1f} "
                     f"{r['rollback_share']:>8.0%} {r['best_interval_steps']:>8} "
                     f"{r['expected_goodput']:>8.1%} {r['goodput_per_gpu']:>8.1%} "
                     f"{format(sim['goodput_per_gpu'], '.1%') if sim else '-':>9}")
    return lines
