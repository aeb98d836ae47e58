"""`megaresil plan`: policies from a run's measured costs, their best
checkpoint interval and expected goodput (model.py), and the simulated run
(simulate.py) on a failure profile; then the recovery policies (live
replacement, hot spares) at the reference size and the job's (recovery.py)."""
from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Optional

from megaresil.config import NoLiveCopy
from megaresil.plan.control_plane import ControlPlane, format_control_plane
from megaresil.plan.costs import RunCosts, SaveCost
from megaresil.plan.model import Policy, daly_interval, young_interval
from megaresil.plan.profile import scope_of
from megaresil.plan.recovery import (
    DEFAULT_SPARES,
    REFERENCE_GPUS,
    Projection,
    Spares,
    format_recovery,
    mean_downtime,
    replacement_cost,
)
from megaresil.plan.simulate import Kind, Setup, simulate
from megaresil.run_records import NON_NEGATIVE, Shape, checked, one_of

# A failure trace's line (--failure-trace).
TRACE_ROW = Shape({"hours": NON_NEGATIVE, "path": one_of("in_process", "relaunch",
                                                         "node_replacement")},
                  {"scope": one_of("process", "node", "job")})


@dataclass
class Scale:
    """Costs measured on a small state, carried to a large one: a save's
    blocking snapshot grows with the bytes each rank holds; its total time is
    the measured one (fixed costs: barriers, metadata, commit) plus the state
    written at the storage's aggregate bandwidth; every recovery also reads
    the state back at that bandwidth."""
    state_bytes: float
    gpus: int
    storage_bytes_per_s: float

    def save(self, save: SaveCost) -> SaveCost:
        factor = self.state_bytes / self.gpus / (save.bytes / save.ranks)
        return SaveCost(save.tier, save.saves, save.blocking_s * factor,
                        save.total_s + self.load_s(), int(self.state_bytes), self.gpus)

    def load_s(self) -> float:
        return self.state_bytes / self.storage_bytes_per_s


def restart_costs(costs: RunCosts, replacement_s: float, scale: Optional[Scale]) -> dict:
    """Downtime per recovery path; a run that never relaunched gets its
    relaunch estimated from its own start-up (relaunch_is_estimated), one
    that had no live replacement the relaunch's downtime in its place."""
    measured = costs.restart_s()
    if "relaunch" not in measured:
        if costs.startup_s is None:
            raise ValueError("the run has neither a measured relaunch nor a recorded start-up "
                             "(generation_started): run it again with this version, or give a "
                             "run with a relaunch (megaresil chaos RECIPE --scenario kill-rank)")
        measured = {**measured, "relaunch": costs.startup_s}
    load = scale.load_s() if scale else 0.0
    # A live replacement takes the state from a peer's memory, not from storage.
    paths = {p: s + (0.0 if p == "replace" else load) for p, s in measured.items()}
    paths["node_replacement"] = paths["relaunch"] + replacement_s
    paths.setdefault("replace", paths["relaunch"])
    return paths


def with_control_plane(restart_s: dict[str, float], control_plane: Optional[ControlPlane],
                       gpus: int) -> dict[str, float]:
    """The downtimes at `gpus` GPUs: the run's, plus what the control plane
    adds at that size (a node replacement is a relaunch's, after the wait)."""
    if control_plane is None:
        return restart_s
    added = control_plane.added_s(gpus)
    return {p: s + added.get("relaunch" if p == "node_replacement" else p, 0.0)
            for p, s in restart_s.items()}


def policies(costs: RunCosts, kinds: list[Kind], restart_s: dict) -> list[tuple[Policy, dict]]:
    """(policy, downtime per path it uses) for global-only saves, the local
    tier, and in-process restart; a policy the run measured nothing for is left out."""
    no_in_process = {**restart_s, "in_process": restart_s["relaunch"]}
    if "global" not in costs.saves:
        raise ValueError("the run saved no checkpoint (no checkpoint_saved event), so its save "
                         "cost is unknown. Fix: train it with checkpoint.interval=N (a few "
                         "saves), then plan")
    g = costs.saves["global"]
    found = [(Policy("global only", g.blocking_s, g.total_s, mean_downtime(kinds, no_in_process)),
              no_in_process)]
    if "local" in costs.saves:
        loc = costs.saves["local"]
        found.append((Policy("with the local tier", loc.blocking_s, loc.total_s,
                             mean_downtime(kinds, no_in_process)), no_in_process))
    if "in_process" in restart_s:
        best = found[-1][0]
        found.append((Policy(f"{best.name} + in-process restart", best.blocking_s,
                             best.total_s, mean_downtime(kinds, restart_s)), restart_s))
    return found


def relaunch_is_estimated(costs: RunCosts) -> bool:
    return "relaunch" not in costs.restart_s()


def plan(costs: RunCosts, kinds: list[Kind], *, gpus: int, replacement_s: float,
         reference_kinds: Optional[list[Kind]] = None, spares: Spares = DEFAULT_SPARES,
         scale: Optional[Scale] = None, step_s: Optional[float] = None,
         simulate_days: Optional[float] = None, seed: int = 0,
         no_live_copy: Optional[NoLiveCopy] = None,
         control_plane: Optional[ControlPlane] = None) -> dict:
    """The plan on `gpus` GPUs failing as `kinds`; `reference_kinds`: the
    failures at REFERENCE_GPUS, to project the recovery policies there too;
    `no_live_copy`: the run's layout's, where its recipe is known (else the
    projection takes a data-parallel peer to hold a lost rank's state);
    `control_plane`: its latencies at each size, added to the run's downtimes."""
    measured = costs
    if scale:
        # replace, not a new RunCosts: the measured start-up (a relaunch's
        # floor) must survive the scaling of the saves.
        costs = replace(costs, saves={t: scale.save(s) for t, s in costs.saves.items()})
    step = step_s or costs.step_s
    if simulate_days and simulate_days * 86400 < step:
        raise ValueError(f"--days {simulate_days:g} holds no step of {step:.3g} s: simulate "
                         "at least one step")
    mtbf = 1 / sum(k.per_s for k in kinds)
    run_restart_s = restart_costs(costs, replacement_s, scale)
    restart_s = with_control_plane(run_restart_s, control_plane, gpus)
    rows = []
    for policy, paths in policies(costs, kinds, restart_s):
        tau = policy.best_interval(mtbf, step)
        row = {"policy": policy.name, "blocking_s": policy.blocking_s,
               "total_s": policy.total_s, "mean_restart_s": policy.restart_s,
               "young_s": young_interval(max(policy.blocking_s, 1e-9), mtbf),
               "daly_s": daly_interval(max(policy.blocking_s, 1e-9), mtbf),
               "best_interval_steps": round(tau / step), "expected_goodput":
               policy.goodput(tau, mtbf)}
        if simulate_days:
            setup = Setup(steps=int(simulate_days * 86400 / step), step_s=step,
                          interval=round(tau / step), blocking_s=policy.blocking_s,
                          total_s=policy.total_s, restart_s=paths)
            row["simulated"] = simulate(setup, kinds, seed=seed).to_dict()
        rows.append(row)
    tier = "local" if "local" in costs.saves else "global"
    sizes = [(gpus, kinds, costs.saves[tier])]
    if reference_kinds and gpus != REFERENCE_GPUS:
        at_reference = replace(scale, gpus=REFERENCE_GPUS) if scale else None
        save = at_reference.save(measured.saves[tier]) if at_reference else costs.saves[tier]
        sizes.insert(0, (REFERENCE_GPUS, reference_kinds, save))
    projection = Projection(run_restart_s, step, spares, simulate_days, seed, no_live_copy)
    projections = [replace(projection, restart_s=with_control_plane(
        run_restart_s, control_plane, size[0])).at(*size) for size in sizes]
    return {"step_s": step, "job_mtbf_h": mtbf / 3600, "restart_s": restart_s,
            "control_plane": ([control_plane.describe(size[0]) for size in sizes]
                              if control_plane else None),
            "saves": {t: vars(s) for t, s in costs.saves.items()},
            "relaunch_estimated": relaunch_is_estimated(costs),
            "local_tier_measured": "local" in costs.saves,
            "in_process_measured": "in_process" in costs.restart_s(), "policies": rows,
            "recovery": {"costs": replacement_cost(costs, run_restart_s), "save_tier": tier,
                         "spares": vars(spares),
                         "no_live_copy": vars(no_live_copy) if no_live_copy else None,
                         "projections": projections}}


def trace_kinds(path: Path) -> list[Kind]:
    """A failure trace (JSON lines {"hours": when, "path": recovery path,
    "scope": optional, process|node|job}) as one rate per path and scope:
    count over the trace's span."""
    rows = checked(json_lines(path), path, lambda _: TRACE_ROW)
    if not rows:
        raise ValueError(f"failure trace {path} is empty: one JSON line per failure, "
                         '{"hours": 3.2, "path": "relaunch"}')
    span_s = max(r["hours"] for r in rows) * 3600
    if not span_s:
        raise ValueError(f"failure trace {path} spans no time (every failure at hours 0), so "
                         "it has no rate: give each failure its time since the job started")
    kinds = sorted({(r["path"], scope_of(r)) for r in rows})
    return [Kind(f"{path} ({scope})", sum((r["path"], scope_of(r)) == (path, scope) for r in rows)
                 / span_s, path, scope) for path, scope in kinds]


def json_lines(path: Path) -> list:
    """The lines of a JSON Lines file a person wrote; ValueError naming a bad one."""
    rows = []
    for number, line in enumerate(path.read_text().splitlines(), 1):
        if line.strip():
            try:
                rows.append(json.loads(line))
            except ValueError as err:
                raise ValueError(f"{path}: line {number} is not JSON ({err})") from None
    return rows


def readable_hours(hours: float) -> str:
    """A duration in the unit a person reads it in: minutes, hours or days."""
    if hours < 1:
        return f"{hours * 60:.0f} min"
    if hours < 48:
        return f"{hours:.1f} h"
    return f"{hours / 24:.1f} days"


def format_plan(report: dict) -> str:
    step = report["step_s"]
    lines = [f"step {step:.3f} s, job MTBF {readable_hours(report['job_mtbf_h'])}, "
             "downtime per path: " + ", ".join(f"{p} {s:.1f} s"
                                               for p, s in report["restart_s"].items())]
    if report.get("relaunch_estimated"):
        lines.append("the run has no relaunch: its downtime is an estimate, the run's own "
                     "start-up (launch to first step)")
    if not report["local_tier_measured"]:
        lines.append("the run has no local-tier save (local_checkpoint_saved): no local policy")
    if not report["in_process_measured"]:
        lines.append("the run has no in-process restart: no in-process policy")
    lines += format_control_plane(report.get("control_plane") or [])
    lines.append(f"{'policy':<40} {'block s':>9} {'total s':>8} {'restart s':>9} "
                 f"{'Young s':>8} {'Daly s':>8} {'interval':>18} {'goodput':>8} "
                 f"{'simulated':>9}")
    for r in report["policies"]:
        sim = r.get("simulated")
        interval = (f"{r['best_interval_steps']} steps "
                    f"({r['best_interval_steps'] * step / 60:.1f} min)")
        lines.append(f"{r['policy']:<40} {r['blocking_s']:>9.4f} {r['total_s']:>8.2f} "
                     f"{r['mean_restart_s']:>9.1f} {r['young_s']:>8.1f} {r['daly_s']:>8.1f} "
                     f"{interval:>18} {r['expected_goodput']:>8.1%} "
                     f"{format(sim['goodput'], '.1%') if sim else '-':>9}")
    lines += format_recovery(report["recovery"])
    best = max(report["policies"], key=lambda r: r["expected_goodput"])
    lines.append(f"# best: {best['policy']}; to use its interval, add:")
    lines.append(f"checkpoint.interval={max(1, best['best_interval_steps'])}")
    return "\n".join(lines)


def read_run_costs(source: Path) -> RunCosts:
    """A run directory, or the JSON `megaresil plan --json` wrote of one."""
    from megaresil.plan.costs import read_costs

    if source.is_file():
        try:
            data = json.loads(source.read_text())
            return RunCosts.from_dict(data.get("costs", data) if isinstance(data, dict) else data)
        except ValueError as err:
            raise ValueError(f"{source} is not what `megaresil plan --json` writes: {err}. "
                             "Fix: give a run directory, or such a file") from None
    return read_costs(source)
