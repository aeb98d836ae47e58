"""The soak's fault schedule: episodes (one fault of each kind, a fault
during a save, during a restart, during the preemption save, two on adjacent
steps, the local tier's own, and with nodes in namespaces a node's link's),
their estimated recovery costs, how many fit a budget of minutes, and where
each lands: seeded, so the same seed, steps and episodes always give the same
schedule (see soak.py)."""
from __future__ import annotations

import math
import random
from dataclasses import dataclass
from typing import Callable

from megaresil.config import RecipeConfig
from megaresil.drills.scenarios import FLAP_S
from megaresil.resilience.watchdog.abort import ABORT_GRACE_S

SAVE_INTERVAL = 5  # a save every 5 steps: a fault costs at most 5 recomputed steps
KEEP = 3  # checkpoints kept: a corrupted newest one still has two to fall back on
# A corruption needs an older checkpoint to fall back on: from the step before the third save.
CORRUPT_FROM = 3 * SAVE_INTERVAL - 1
SPACING = SAVE_INTERVAL + 3  # steps per episode: the fault, the reload, the recomputation
GIL_TIMEOUT_S = 5.0  # the guardian's wait before it kills a rank that holds the GIL
SLOW_S = 0.5  # a slow rank's extra seconds per step: about one step of the demo here
# The sections a hang may use: the calibrated ones. Setup, checkpoint and
# eval keep long fixed budgets (minutes), so a hang there would mostly wait.
HANG_SECTIONS = ("data", "forward_backward", "optimizer")


@dataclass
class Calibration:
    startup_s: float  # launch to the first step's start
    step_s: float  # median step time once warm
    link_bytes_per_s: float = 0.0  # on nodes: what the second node's link carried (soak_nodes)


@dataclass
class Plan:
    """What the episode builders may place faults into."""
    world: int
    eval_steps: set

    def sections_at(self, step: int, hang: bool) -> list[str]:
        if hang:
            return list(HANG_SECTIONS)
        sections = list(HANG_SECTIONS)
        if step % SAVE_INTERVAL == 0:
            sections.append("checkpoint")
        if step in self.eval_steps:
            sections.append("eval")
        return sections


@dataclass
class Episode:
    name: str
    restarts: int  # restarts it is expected to cause (for a later `generation`)
    cost: Callable[["Costs"], float]  # estimated seconds of recovery
    build: Callable[[random.Random, int, int, Plan, int], list[dict]]


@dataclass
class Costs:
    """Recovery costs estimated from the calibration."""
    relaunch: float
    in_process: float
    detect_hang: float
    recompute: float
    slow: float
    flap: float  # how long a flapping link stays down (soak_nodes.flap_seconds)


# --- episodes -----------------------------------------------------------------------

def _fault(rng: random.Random, plan: Plan, kind: str, step: int, sections=None,
           **extra) -> dict:
    section = rng.choice(sections or plan.sections_at(step, hang=kind == "hang"))
    return {"kind": kind, "rank": rng.randrange(plan.world), "step": step, "section": section,
            **extra}


def _single(kind: str, sections=None, **extra) -> Callable:
    def build(rng, lo, hi, plan, restarts_before):
        return [_fault(rng, plan, kind, rng.randint(lo, hi), sections, **extra)]
    return build


def steps_at_phase(lo: int, hi: int, phase: int) -> list[int]:
    """Steps in [lo, hi] that lie `phase` steps past a save; when the slot
    holds none, the first one after lo (a fault meant for a save must meet
    one: a kill in the checkpoint section of a step that saves nothing never
    fires)."""
    found = [s for s in range(lo, hi + 1) if s % SAVE_INTERVAL == phase]
    return found or [lo + (phase - lo) % SAVE_INTERVAL]


def _corrupt_then_kill(rng, lo, hi, plan, restarts_before):
    # The step before a save, so the newest checkpoint is long committed
    # (async) before it is corrupted, and never before a second checkpoint
    # exists to fall back on (with none, refusing to start over is right);
    # the kill then makes the restart read it.
    step = rng.choice(steps_at_phase(max(lo, CORRUPT_FROM), hi, SAVE_INTERVAL - 1))
    return [_fault(rng, plan, "corrupt_checkpoint", step, ["data"]),
            _fault(rng, plan, "kill", step, ["forward_backward", "optimizer"])]


def _corrupt_local_then_kill(rng, lo, hi, plan, restarts_before):
    # One rank, one section, the corruption first: nothing this rank commits
    # comes between them, so the restart finds every own shard damaged.
    fault = _fault(rng, plan, "corrupt_local_checkpoint", rng.randint(lo, hi),
                   ["forward_backward", "optimizer"])
    return [fault, {**fault, "kind": "kill"}]


def _during_save(rng, lo, hi, plan, restarts_before):
    step = rng.choice(steps_at_phase(lo, hi, 0))
    return [_fault(rng, plan, rng.choice(["kill", "raise"]), step, ["checkpoint"])]


def _during_restart(rng, lo, hi, plan, restarts_before):
    """A raise, then a fault in the setup of the restart it causes."""
    trigger = _fault(rng, plan, "raise", rng.randint(lo, hi))
    second = {"kind": rng.choice(["kill", "raise"]), "rank": rng.randrange(plan.world),
              "step": 0, "section": "setup", "generation": restarts_before + 1}
    return [trigger, second]


def _kill_during_replacement(rng, lo, hi, plan, restarts_before):
    """A kill, then a kill of the process that takes its place (live
    replacement) in its setup, whichever restart that is (a lost node's
    ranks may have made more than one): the workers are relaunched."""
    first = _fault(rng, plan, "kill", rng.randint(lo, hi))
    return [first, {"kind": "kill", "rank": first["rank"], "step": 0, "section": "setup",
                    "replacement": True}]


def _during_preemption_save(rng, lo, hi, plan, restarts_before):
    step = rng.randint(lo, hi)
    return [_fault(rng, plan, "sigterm", step, HANG_SECTIONS),
            _fault(rng, plan, "kill", step, ["checkpoint"])]


def _adjacent(rng, lo, hi, plan, restarts_before):
    step = rng.randint(lo, hi - 1)
    first, second = rng.choice(["raise", "hang"]), rng.choice(["raise", "kill", "hang"])
    return [_fault(rng, plan, kind, s, **({"mode": "sleep"} if kind == "hang" else {}))
            for kind, s in ((first, step), (second, step + 1))]


# Node episodes (`soak --hosts netns`): faults of a node's link, struck by the
# soak's driver, not by a rank (soak_nodes.py), once the job has completed
# their step. Kinds named as the chaos scenarios of the same fault.
NODE_KINDS = ("flap-link", "slow-link")
SLOW_LINK_S = 10.0  # how long a slow link stays capped
# A slow link carries a third of what the job sent through it at full speed:
# its steps take about three times as long, far inside the watchdog's hard
# limit (slow_limit_factor x a budget of factor x the slowest section).
SLOW_LINK_FACTOR = 3


def _node(kind: str) -> Callable:
    # Always the second node: the first hosts the c10d rendezvous, whose loss
    # (even for seconds) is the rendezvous-outage scenario's subject, not this.
    def build(rng, lo, hi, plan, restarts_before):
        return [{"kind": kind, "node": 1, "step": rng.randint(lo, hi)}]
    return build


def node_episodes() -> list[Episode]:
    """A link capped for SLOW_LINK_S seconds, then freed: slower steps and no
    alarm; and a link down for longer than a section's budget should be
    (flap_seconds), then up: a hang, restarted in place. Budgets grow with
    the slowest steps seen, so a flap may still be ridden out: it counts no
    restart, so that a fault held back to a later restart (`generation`)
    fires no later than meant (at worst at the flap's restart, still in a
    restart's setup) and never waits for one that does not come."""
    return [Episode("slow-link", 0, lambda c: SLOW_LINK_S, _node("slow-link")),
            Episode("flap-link", 0, lambda c: c.flap + c.in_process + c.recompute,
                    _node("flap-link"))]


def episodes(local: bool = False, replicas: bool = True,
             replacement: bool = False) -> list[Episode]:
    """One of each, roughly cheapest first; with `local`, the local tier's
    own are the first that relaunch, so a soak of a few minutes damages it;
    a bit flip only where `replicas` are compared (dp > 1, the check on); a
    replacement lost in turn only with live `replacement` (where a kill
    costs an in-process restart's time)."""
    kill_cost = (lambda c: c.in_process) if replacement else (lambda c: c.relaunch + c.recompute)
    return [
        Episode("slow", 0, lambda c: c.slow, _single("slow", seconds=SLOW_S)),
        Episode("raise", 1, lambda c: c.in_process + c.recompute, _single("raise")),
        # Replayed at once / found by the replica checksum (at dp = 2 by a
        # replay from the newest checkpoint): no restart.
        Episode("nan", 0, lambda c: c.recompute / SAVE_INTERVAL,
                _single("nan", sections=["optimizer"])),
    ] + ([
        Episode("bitflip-param", 0, lambda c: c.recompute,
                _single("bitflip", sections=["optimizer"])),
    ] if replicas else []) + [
        Episode("hang-sleep", 1, lambda c: c.detect_hang + c.in_process + c.recompute,
                _single("hang", mode="sleep")),
        Episode("hang-collective", 1, lambda c: c.detect_hang + c.in_process + c.recompute,
                _single("hang", mode="collective")),
    ] + ([
        Episode("lose-local-node", 1, lambda c: c.relaunch + c.recompute,
                _single("lose_local_node")),
        Episode("corrupt-local-then-kill", 1, lambda c: c.relaunch + c.recompute,
                _corrupt_local_then_kill),
    ] if local else []) + [
        Episode("kill", 1, kill_cost, _single("kill")),
    ] + ([
        Episode("kill-during-replacement", 2, lambda c: c.in_process + c.relaunch,
                _kill_during_replacement),
    ] if replacement else []) + [
        Episode("sigterm", 0, lambda c: c.relaunch, _single("sigterm")),
        Episode("adjacent-faults", 2, lambda c: 2 * (c.detect_hang + c.in_process + c.recompute),
                _adjacent),
        Episode("fault-during-save", 1, lambda c: c.relaunch + c.recompute, _during_save),
        Episode("corrupt-then-kill", 1, lambda c: c.relaunch + 2 * c.recompute,
                _corrupt_then_kill),
        Episode("kill-during-preemption-save", 1, lambda c: c.relaunch + c.recompute,
                _during_preemption_save),
        Episode("hang-holding-gil", 1,
                lambda c: GIL_TIMEOUT_S + c.relaunch + c.in_process + c.recompute,
                _single("hang", mode="gil")),
        # The abort cannot reach it: the watchdog exits at the hard limit + grace.
        Episode("hang-native", 2,
                lambda c: 5 * c.detect_hang + ABORT_GRACE_S + c.relaunch + c.recompute,
                _single("hang", mode="native")),
        Episode("fault-during-restart", 2, lambda c: c.in_process + c.relaunch + c.recompute,
                _during_restart),
    ]


# --- the schedule --------------------------------------------------------------------

def first_fault_step(cfg: RecipeConfig) -> int:
    """After the watchdog's calibration and after the first checkpoint is committed."""
    return max(cfg.resilience.watchdog.calibration_steps, SAVE_INTERVAL) + 2


def flap_seconds(cal: Calibration, cfg: RecipeConfig) -> float:
    """How long a flapping link stays down: two seconds past the budget of
    any section (at most factor x a whole step, never under the floor), a
    step slowed by a slow link included, so the watchdog sees the hang
    whatever the section the cut meets (steps slower still, under CPU hogs,
    grow the budgets beyond it); at least the chaos drill's FLAP_S."""
    w = cfg.resilience.watchdog
    return max(FLAP_S, max(w.floor_s, w.factor * SLOW_LINK_FACTOR * cal.step_s) + 2.0)


def gil_timeout(cal: Calibration, cfg: RecipeConfig, nodes: bool) -> float:
    """The guardian's wait in the soak: GIL_TIMEOUT_S, or on nodes long
    enough to outlast a flap. A rank cut off blocks its monitor thread in a
    store call (the guardian cannot tell that from a hang holding the GIL)
    until the link is back and the next TCP retransmission comes, up to
    about twice the outage. Killed then, its rank had to be relaunched into
    a job its peer was restarting in place: in a soak run (a 7 s flap, 5 s
    here) the cut node's agent timed out at the rendezvous and the job hung."""
    return max(GIL_TIMEOUT_S, 2 * flap_seconds(cal, cfg) + 2) if nodes else GIL_TIMEOUT_S


def estimate_costs(cal: Calibration, cfg: RecipeConfig) -> Costs:
    # A relaunch is a fresh start of every worker (and the survivors' stop).
    return Costs(relaunch=2 * cal.startup_s, in_process=max(3.0, cal.startup_s / 4),
                 detect_hang=cfg.resilience.watchdog.floor_s + 1.0,
                 recompute=SAVE_INTERVAL * cal.step_s, slow=SPACING * SLOW_S,
                 flap=flap_seconds(cal, cfg))


def catalogue(cfg: RecipeConfig, nodes: bool = False) -> list[Episode]:
    """The episodes a soak of this recipe can run; with `nodes` (nodes in
    namespaces) the node episodes too, first (cheap, and the point of such
    a soak)."""
    rank_level = episodes(cfg.checkpoint.local.enabled,
                          cfg.parallel.dp > 1 and cfg.resilience.numerics.check_interval > 0,
                          cfg.resilience.replacement.enabled)
    return (node_episodes() if nodes else []) + rank_level


def episode_order(rng: random.Random, count: int, cfg: RecipeConfig,
                  nodes: bool = False) -> list[Episode]:
    """Every kind once, cheapest first, then seeded random rounds."""
    kinds = catalogue(cfg, nodes)
    order = list(kinds)
    while len(order) < count:
        round_ = list(kinds)
        rng.shuffle(round_)
        order += round_
    return order[:count]


def steps_to_hold(cfg: RecipeConfig, count: int) -> int:
    """The fewest steps that hold `count` episodes: SPACING steps of room
    each from the first fault step, then the last step."""
    return first_fault_step(cfg) + count * SPACING + 1


def fit(cal: Calibration, cfg: RecipeConfig, minutes: float, seed: int,
        nodes: bool = False) -> tuple[int, int]:
    """(episodes, steps) that fit the budget: the first start, then steps and
    episodes' recoveries, each episode with SPACING steps of room."""
    budget = minutes * 60 - cal.startup_s
    costs = estimate_costs(cal, cfg)
    chosen, spent = 0, 0.0
    for episode in episode_order(random.Random(seed), 1000, cfg, nodes):
        steps_needed = steps_to_hold(cfg, chosen + 1)
        if chosen and spent + episode.cost(costs) + steps_needed * cal.step_s > budget:
            break
        chosen, spent = chosen + 1, spent + episode.cost(costs)
    return chosen, max(steps_to_hold(cfg, chosen), int((budget - spent) / cal.step_s))


def fit_episodes(cal: Calibration, cfg: RecipeConfig, count: int, seed: int,
                 nodes: bool = False) -> tuple[int, float]:
    """(steps, minutes) of a soak of exactly `count` episodes (`--episodes`),
    the same ones a budget holding `count` would choose: the fewest steps
    that hold them, and the budget they are estimated to take (the first
    start, the steps, the recoveries). A slow link's steps go on while it is
    capped, and a soak that ends under the cap cannot show the job got over
    it: with one among them, as many more steps as the cap lasts at full
    speed (schedule() spreads them over the slots)."""
    chosen = episode_order(random.Random(seed), count, cfg, nodes)
    costs = estimate_costs(cal, cfg)
    tail = (math.ceil(SLOW_LINK_S / cal.step_s)
            if any(e.name == "slow-link" for e in chosen) else 0)
    steps = steps_to_hold(cfg, count) + tail
    spent = sum(e.cost(costs) for e in chosen)
    return steps, (cal.startup_s + spent + steps * cal.step_s) / 60


def schedule(cfg: RecipeConfig, seed: int, steps: int, count: int,
             nodes: bool = False) -> list[dict]:
    """The faults of `count` episodes over `steps` steps: one slot of steps per
    episode, the episodes in seeded random order, each placed at random in its
    slot. Returns [{episode, faults}] in step order; a node episode's faults
    name a `node`, not a rank (NODE_KINDS)."""
    rng = random.Random(seed)
    chosen = episode_order(rng, count, cfg, nodes)
    rng.shuffle(chosen)
    first, last = first_fault_step(cfg), steps - 1
    width = max(SPACING, (last - first + 1) // max(count, 1))
    t = cfg.train
    eval_steps = ({steps} | set(range(t.eval_interval, steps + 1, t.eval_interval or steps + 1))
                  if t.eval_batches else set())
    plan = Plan(world=cfg.parallel.world_size, eval_steps=eval_steps)

    def slot_end(i: int) -> int:
        return min(last, first + i * width + width - SAVE_INTERVAL - 1)

    for i in range(len(chosen)):  # a corruption too early for its fallback trades places
        if chosen[i].name == "corrupt-then-kill" and slot_end(i) < CORRUPT_FROM:
            later = [j for j in range(i + 1, len(chosen)) if chosen[j].name != chosen[i].name]
            if later:
                chosen[i], chosen[later[-1]] = chosen[later[-1]], chosen[i]
    placed, restarts = [], 0
    for i, episode in enumerate(chosen):
        lo = first + i * width
        hi = slot_end(i)  # room to recover before the next
        placed.append({"episode": episode.name,
                       "faults": episode.build(rng, lo, max(lo + 1, hi), plan, restarts)})
        restarts += episode.restarts
    return placed


