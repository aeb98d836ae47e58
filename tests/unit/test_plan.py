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
from tests.harness.run_records import write_run_records
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


def test_a_soak_whose_saves_show_no_interval_is_not_replayed():
    """Under two global saves there is no interval to simulate saves at: a
    ValueError that says so, not a TypeError from inside the simulator."""
    soak = json.loads((RESULTS / "soak_30min.json").read_text())
    measured = json.loads((RESULTS / "plan_soak_costs.json").read_text())
    costs = RunCosts.from_dict({**measured, "interval": None})
    with pytest.raises(ValueError, match="interval"):
        replay_soak(soak, costs)


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
    report = plan(costs, kinds, gpus=16384, replacement_s=600,
                  scale=Scale(state_bytes=4.86e12, gpus=16384, storage_bytes_per_s=1e12))
    assert report["policies"] and 0 < report["policies"][0]["expected_goodput"] < 1


def write_run_with_a_replacement(run_dir, *, downtime_s: float, step_s: float = 0.5):
    """A run's records as a live replacement writes them (dp = 2, saves every
    2 steps): rank 1 killed in step 5; the agent's `restart` kind replace,
    rank 0's `checkpoint_loaded` from the live tier at step 4, then step 5
    (marked with its generation) `downtime_s` after the end of step 4."""
    run_dir.mkdir()
    t, records = 1000.0, []
    for step in range(1, 9):
        t += step_s + (downtime_s if step == 5 else 0.0)
        records.append({"step": step, "loss": 5.0, "lr": 1e-3, "grad_norm": 1.0,
                        "tokens": step * 512, "tokens_per_s": 512 / step_s, "elapsed_s": t - 990,
                        "time": t, **({"restart": 1} if step >= 5 else {})})
    step4_end = records[3]["time"]
    events = [{"time": 990.0, "event": "generation_started", "rank": 0, "generation": 0,
               "launched_at": 985.0},
              {"time": step4_end + 1.0, "event": "restart", "kind": "replace", "generation": 1,
               "rank": 1, "lost_pid": 11, "pid": 12, "from_tier": "live", "standby": True},
              {"time": step4_end + downtime_s - 0.5, "event": "checkpoint_loaded", "rank": 0,
               "step": 4, "path": None, "tier": "live", "from_peers": {"1": 0}}]
    write_run_records(run_dir, records, events, checkpoints="")


def test_a_live_replacement_is_measured_from_its_restart_event(cli_main, tmp_path):
    """Its outage was a `tuple.index` error before `replace` had a severity."""
    write_run_with_a_replacement(tmp_path / "run", downtime_s=3.0)
    costs = read_costs(tmp_path / "run")
    [replaced] = costs.recoveries().values()
    assert (replaced.kind, replaced.count, replaced.steps_lost) == ("replace", 1, 0.0)
    assert replaced.downtime_s == pytest.approx(3.0)
    report = json.loads(cli_main("plan", str(tmp_path / "run"), "--gpus", "1024",
                                 "--json").stdout)
    measured = report["recovery"]["costs"]
    assert measured["replace"]["measured"] and measured["replace"]["downtime_s"] == \
        pytest.approx(3.0)
    assert not measured["relaunch"]["measured"]  # this run never relaunched: estimated
    assert [p["gpus"] for p in report["recovery"]["projections"]] == [16384, 1024]
    text = cli_main("plan", str(tmp_path / "run"), "--gpus", "1024").stdout
    assert "downtime 3.0 s, 0.0 steps lost (measured, 1 in the run)" in text
    assert text.strip().splitlines()[-1].startswith("checkpoint.interval=")


def plan_at_layout(cli_main, run, *overrides: str) -> tuple[dict, str]:
    """The plan (JSON and text) of the run with a replacement, its recipe.yaml
    the MoE demo's at `overrides`, as training writes it."""
    from megaresil.config import load_recipe, to_yaml

    recipe = load_recipe(ROOT / "recipes" / "moe-tiny.yaml", ["parallel.tp=1", "parallel.pp=1",
                                                              *overrides])
    (run / "recipe.yaml").write_text(to_yaml(recipe))
    args = ("plan", str(run), "--gpus", "1024")
    return json.loads(cli_main(*args, "--json").stdout), cli_main(*args).stdout


def test_plan_projects_live_replacement_as_the_runs_layout_allows(cli_main, tmp_path):
    """ep = dp: live replacement is refused (no rank holds a copy of another's
    experts), so it is left out and hot spares relaunch a lost process; dp = 1:
    a replacement resumes from the newest save; ep < dp: from a peer."""
    run = tmp_path / "run"
    write_run_with_a_replacement(run, downtime_s=3.0)
    refused, text = plan_at_layout(cli_main, run, "parallel.dp=2", "parallel.ep=2")
    assert refused["recovery"]["no_live_copy"]["refused"]
    for rows in recovery_rows(refused).values():
        assert list(rows) == ["relaunch (today)", "hot spares"]
        assert (rows["hot spares"]["process"], rows["hot spares"]["rollback_share"]) == \
            ("relaunch", 1.0)
    assert "the run's layout refuses live replacement (at ep = dp = 2 each rank holds the " \
        "only copy of its experts)" in text
    alone, text = plan_at_layout(cli_main, run, "parallel.dp=1")
    for rows in recovery_rows(alone).values():
        assert rows["live replacement"]["rollback_share"] == 1.0
    assert "the run's layout: at dp=1 no data-parallel peer holds a copy" in text
    replicated, text = plan_at_layout(cli_main, run, "parallel.dp=4", "parallel.ep=2")
    assert replicated["recovery"]["no_live_copy"] is None and "run's layout" not in text
    for rows in recovery_rows(replicated).values():
        assert rows["live replacement"]["rollback_share"] < 1.0


def test_a_run_whose_recipe_does_not_load_is_not_planned(cli_main, tmp_path):
    run = tmp_path / "run"
    write_run_with_a_replacement(run, downtime_s=3.0)
    (run / "recipe.yaml").write_text("parallel: {dp: 0}\n")
    result = cli_main("plan", str(run), "--gpus", "8", check=False)
    assert result.returncode == 2 and "recipe.yaml, whose layout the plan needs" in result.stderr


def test_a_run_without_a_replacement_says_how_to_measure_one():
    from megaresil.plan.costs import SaveCost
    from megaresil.plan.report import format_plan, plan

    costs = RunCosts(step_s=0.5, steps=10, interval=2, startup_s=12.0,
                     saves={"global": SaveCost("global", 5, 0.2, 0.4, 4_000_000)})
    report = plan(costs, job_kinds(load_profile(), 1024), gpus=1024, replacement_s=600)
    replaced = report["recovery"]["costs"]["replace"]
    assert not replaced["measured"] and replaced["downtime_s"] == report["restart_s"]["relaunch"]
    assert "kill-rank-replace" in replaced["measure"]
    assert "no live replacement: its downtime is unmeasured" in format_plan(report)


def recovery_rows(report: dict) -> dict[int, dict[str, dict]]:
    return {at["gpus"]: {r["policy"]: r for r in at["policies"]}
            for at in report["recovery"]["projections"]}


def planned_with_a_replacement(**kwargs) -> dict:
    """The plan of a run that measured a relaunch (20 s, 3 steps lost) and a
    live replacement (5 s, none lost), at 1,024 GPUs and 16,384."""
    from megaresil.plan.costs import Outage, SaveCost
    from megaresil.plan.report import plan

    costs = RunCosts(step_s=2.0, steps=100, interval=10,
                     saves={"global": SaveCost("global", 10, 1.0, 1.0, 4_000_000)},
                     outages=[Outage("relaunch", 20.0, 3), Outage("replace", 5.0, 0)])
    profile = load_profile()
    return plan(costs, job_kinds(profile, 1024), gpus=1024, replacement_s=600,
                reference_kinds=job_kinds(profile, 16384), **kwargs)


def test_live_replacement_projects_no_less_goodput_than_relaunch():
    for gpus, rows in recovery_rows(planned_with_a_replacement(simulate_days=5)).items():
        today, live = rows["relaunch (today)"], rows["live replacement"]
        # The profile's process-level failures (software bugs, NCCL
        # timeouts) no longer go back to the newest save.
        assert today["rollback_share"] == 1.0 and live["rollback_share"] < 1.0
        assert live["mean_restart_s"] < today["mean_restart_s"]
        assert live["expected_goodput"] >= today["expected_goodput"], gpus
        assert live["simulated"]["goodput"] >= today["simulated"]["goodput"] - 0.002, gpus
        spares = rows["live replacement + hot spares"]
        assert spares["expected_goodput"] > live["expected_goodput"]  # no wait for a host


def test_hot_spares_cost_idle_gpus():
    from megaresil.plan.recovery import Spares

    rows = recovery_rows(planned_with_a_replacement())
    spares = rows[16384]["live replacement + hot spares"]
    assert spares["spare_gpus"] == 16 * 8  # 2,048 nodes, one spare per 128
    assert spares["goodput_per_gpu"] == pytest.approx(spares["expected_goodput"] * 16384 / 16512)
    assert rows[1024]["live replacement + hot spares"]["spare_gpus"] == 8  # one at least
    assert all(rows[16384][p]["spare_gpus"] == 0 for p in ("relaunch (today)", "live replacement"))
    more = recovery_rows(planned_with_a_replacement(spares=Spares(every_nodes=16, gpus_per_node=8)))
    dense = more[16384]["live replacement + hot spares"]
    assert dense["spare_gpus"] == 128 * 8
    assert dense["expected_goodput"] == pytest.approx(spares["expected_goodput"])
    assert dense["goodput_per_gpu"] < spares["goodput_per_gpu"]


def test_a_live_path_resumes_at_the_step_reached():
    """The same fault at step 55 with saves every 10: a relaunch computes
    steps 51-54 again, a live replacement none."""
    from megaresil.plan.simulate import TraceFault

    setup = Setup(steps=100, step_s=1.0, interval=10, blocking_s=0.0, total_s=0.0,
                  restart_s={"relaunch": 30.0, "replace": 5.0})
    relaunched = simulate(setup, trace=[TraceFault(55, "relaunch")])
    live = simulate(Setup(**{**vars(setup), "live_paths": {"replace"}}),
                    trace=[TraceFault(55, "replace")])
    assert relaunched.lost_s["recompute"] == pytest.approx(4.0)
    assert live.lost_s.get("recompute", 0.0) == 0.0
    assert live.wall_s == pytest.approx(100 + 5.0)


def test_llama3_profile_splits_failures_by_scope():
    """What a failure takes out, by Table 5's categories: the node-level
    ones are about the paper's 78% hardware share."""
    counts = {}
    for kind in load_profile()["kinds"]:
        counts[kind["scope"]] = counts.get(kind["scope"], 0) + kind["count"]
    assert counts == {"node": 321, "process": 61, "job": 37}
    assert 0.76 < counts["node"] / 419 < 0.80
