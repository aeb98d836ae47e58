"""megaresil plan: the interval formulas, the simulator (determinism, a
closed form, the soak it must reproduce) and the command on a real run."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from megaresil.plan.costs import RunCosts, read_costs
from megaresil.plan.model import Policy, daly_goodput, daly_interval, young_interval
from megaresil.plan.profile import job_kinds, load_profile, mtbf_hours
from megaresil.plan.simulate import Kind, Setup, simulate
from megaresil.drills.replay import replay_soak
from tests.harness.cli import ROOT
from tests.harness.dist import TINY

RESULTS = ROOT / "bench" / "results"


def test_young_and_daly_intervals():
    """Worked values, not the formulas again. A 5-minute save (delta = 300 s)
    and a one-day MTBF (M = 86400 s), chosen so that both work out by hand:
    - Young (1974), tau = sqrt(2 delta M) = sqrt(51,840,000) = 7200 s, two hours;
    - Daly (2006), tau = sqrt(2 delta M) (1 + sqrt(x)/3 + x/9) - delta with
      x = delta / 2M = 1/576, sqrt(x) = 1/24: 7200 (1 + 1/72 + 1/5184) - 300
      = 7200 + 100 + 25/18 - 300 = 7001.39 s.
    And what each claims to be, found by brute force over tau: Young's the
    minimum of the first-order waste delta/tau + tau/2M, Daly's the optimum of
    his full model of the run's wall time (daly_goodput), to his estimate's
    higher-order error."""
    assert young_interval(300, 86400) == pytest.approx(7200.0)
    assert daly_interval(300, 86400) == pytest.approx(7001.39, abs=0.01)
    assert young_interval(60, 86400) == pytest.approx(3219.94, abs=0.01)  # 1-minute save
    for cost, mtbf in [(60, 86400), (300, 86400), (300, 8 * 3600), (600, 3600)]:
        taus = [t / 10 for t in range(10, 4 * mtbf * 10, 7)]
        first_order = min(taus, key=lambda t: cost / t + t / (2 * mtbf))
        assert young_interval(cost, mtbf) == pytest.approx(first_order, abs=1.0)
        exact = max(taus, key=lambda t: daly_goodput(t, cost, 0.0, mtbf))
        assert daly_interval(cost, mtbf) == pytest.approx(exact, rel=2e-3)
    assert daly_interval(100, 40) == 40  # a save longer than 2 M: save every M


def test_best_interval_is_the_models_optimum_and_async_is_bounded_by_the_save():
    sync = Policy("sync", blocking_s=60, total_s=60, restart_s=120)
    tau = sync.best_interval(86400, step_s=1.0)
    assert tau == pytest.approx(young_interval(60, 86400), rel=0.05)
    assert all(sync.goodput(tau, 86400) >= sync.goodput(t, 86400) for t in (tau / 2, tau * 2))
    hidden = Policy("async", blocking_s=0.01, total_s=300, restart_s=120)
    assert hidden.best_interval(86400, step_s=1.0) >= 300  # never two saves in flight


def test_simulator_without_failures_is_the_closed_form():
    setup = Setup(steps=1000, step_s=2.0, interval=10, blocking_s=0.5, total_s=3.0,
                  restart_s={"relaunch": 30.0})
    result = simulate(setup)
    saves = 1000 // 10 - 1  # none after the last step
    assert result.wall_s == pytest.approx(1000 * 2.0 + saves * 0.5)
    assert result.goodput == pytest.approx(2.0 / (2.0 + 0.5 / 10), rel=1e-3)


def test_simulator_is_deterministic_and_agrees_with_daly():
    setup = Setup(steps=200_000, step_s=1.0, interval=600, blocking_s=20, total_s=20,
                  restart_s={"relaunch": 120.0})
    kinds = [Kind("node", 1 / 20_000, "relaunch")]
    a, b = simulate(setup, kinds, seed=3), simulate(setup, kinds, seed=3)
    assert a.to_dict() == b.to_dict() and a.failures["node"] > 5
    assert simulate(setup, kinds, seed=4).wall_s != a.wall_s
    runs = [simulate(setup, kinds, seed=s).goodput for s in range(8)]
    assert sum(runs) / len(runs) == pytest.approx(daly_goodput(600, 20, 120, 20_000), abs=0.02)


def test_llama3_profile_holds_the_papers_numbers():
    profile = load_profile()
    kinds = profile["kinds"]
    assert sum(k["count"] for k in kinds) == 419
    hardware = sum(k["count"] for k in kinds if k["hardware"]) / 419
    assert 0.76 < hardware < 0.80  # "about 78%"
    assert mtbf_hours(job_kinds(profile, 16384)) == pytest.approx(54 * 24 / 419)


def test_simulator_predicts_the_soaks_goodput():
    """The 30-minute soak's fault schedule replayed with the downtime, save
    and step costs its own run directory measured (plan_soak_costs.json, by
    read_costs); lost work comes from the simulated saves."""
    soak = json.loads((RESULTS / "soak_30min.json").read_text())
    costs = RunCosts.from_dict(json.loads((RESULTS / "plan_soak_costs.json").read_text()))
    predicted = replay_soak(soak, costs).goodput
    assert predicted == pytest.approx(soak["goodput"], rel=0.10)


@pytest.mark.slow
def test_plan_on_a_real_run(cli_main, tmp_path):
    """A tiny run with a kill (a relaunch) and saves every 2 steps, then the command."""
    run = tmp_path / "run"
    faults = 'faults=[{kind: kill, rank: 0, step: 5}]'
    subprocess.run([sys.executable, "-m", "megaresil", "train", "recipes/gpt-tiny.yaml", *TINY,
                    "train.steps=8", "checkpoint.interval=2", faults, f"run.dir={run}"],
                   check=True, capture_output=True, timeout=600)
    costs = read_costs(run)
    assert costs.interval == 2 and "relaunch" in costs.restart_s()
    out = cli_main("plan", str(run), "--gpus", "8", "--mtbf-hours", "100", "--json").stdout
    report = json.loads(out)
    assert report["policies"][0]["policy"] == "global only"
    assert 0 < report["policies"][0]["expected_goodput"] < 1
    assert report["local_tier_measured"] is False


def test_scaling_a_run_without_a_relaunch_keeps_its_start_up():
    """`megaresil plan RUN --state-bytes N` on a run that never relaunched:
    the relaunch is estimated from the run's start-up, which the scaling of
    its saves must keep (it dropped it, and the command refused the run)."""
    from megaresil.plan.costs import SaveCost
    from megaresil.plan.report import Scale, plan

    costs = RunCosts(step_s=0.2, steps=10, interval=2, startup_s=6.0,
                     saves={"global": SaveCost("global", 5, 0.01, 0.1, 30_000_000)})
    kinds = job_kinds(load_profile(), 16384)
    report = plan(costs, kinds, replacement_s=600,
                  scale=Scale(state_bytes=4.86e12, gpus=16384, storage_bytes_per_s=1e12))
    assert report["policies"] and 0 < report["policies"][0]["expected_goodput"] < 1
