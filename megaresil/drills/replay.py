"""The plan simulator replayed on a soak (`megaresil soak`'s soak.json): the
soak's own fault schedule as a trace, its run's measured costs
(plan/costs.py), and the predicted goodput set beside the measured one."""
from __future__ import annotations

from megaresil.plan.costs import RunCosts
from megaresil.plan.simulate import CORRUPT, SLOW, Result, Setup, TraceFault, simulate


def recovery_path(fault: dict) -> str:
    """How megaresil recovers from an injected fault of this kind."""
    if fault["kind"] == "sigterm":
        return "requeue"  # the job saves, exits 75 and is requeued
    if fault["kind"] in ("kill", "lose_local_node") or fault.get("mode") == "gil":
        return "relaunch"  # a dead (or GIL-holding, then killed) worker
    return "in_process"  # an exception or a hang the watchdog aborts


def fires_before_step(fault: dict) -> int:
    """The step a fault interrupts: one in a save's section strikes after its
    step, and a preemption takes effect once its step is done."""
    return fault["step"] + (fault["section"] == "checkpoint" or fault["kind"] == "sigterm")


# Among faults that strike together, the one that decides the recovery: a kill
# during the preemption save leaves no save and no orderly exit, a relaunch.
DECIDES = ("in_process", "requeue", "relaunch")


def episode_trace(faults: list[dict]) -> list[TraceFault]:
    """An episode's faults as trace entries: those at one step (and a fault in
    the setup of the restart they cause) make one outage, recovered by the
    costliest of their paths; a corruption goes first, so the outage skips it."""
    groups: dict[int, list[dict]] = {}
    for fault in faults:
        step = fires_before_step(fault) if fault["section"] != "setup" else min(groups)
        groups.setdefault(step, []).append(fault)
    trace = []
    for step, group in sorted(groups.items()):
        trace += [TraceFault(step, SLOW, f.get("seconds", 0.0)) for f in group
                  if f["kind"] == "slow"]
        trace += [TraceFault(step, CORRUPT) for f in group if f["kind"] == "corrupt_checkpoint"]
        # A corrupted local shard costs no outage of its own (a replica serves).
        paths = [recovery_path(f) for f in group
                 if f["kind"] not in ("slow", "corrupt_checkpoint", "corrupt_local_checkpoint")]
        if paths:
            trace.append(TraceFault(step, max(paths, key=DECIDES.index)))
    return trace


def replay_soak(soak: dict, costs: RunCosts) -> Result:
    if costs.interval is None:
        raise ValueError("the soak's run committed fewer than two global checkpoints, so its "
                         "save interval is unknown: there are no saves to replay")
    trace = [t for episode in soak["schedule"] for t in episode_trace(episode["faults"])]
    save = costs.saves["global"]
    setup = Setup(steps=soak["steps"], step_s=costs.step_s, interval=costs.interval,
                  blocking_s=save.blocking_s, total_s=save.total_s,
                  restart_s=costs.restart_s(), saving_paths={"requeue"}, startup_s=soak["calibration"]["startup_s"])
    return simulate(setup, trace=trace)
