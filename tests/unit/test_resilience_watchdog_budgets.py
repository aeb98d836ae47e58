"""The watchdog's budgets, pure: calibration from observed section times,
the floor, the fixed budgets, the hard limit, and a calibration kept only
for what it was measured on."""
from __future__ import annotations

import json

import pytest

from megaresil.config import WatchdogConfig
from megaresil.resilience.watchdog.budgets import Budgets

EIGHT = {"world": 8, "workload": {"tp": 2, "pp": 2, "dp": 2}, "machine": {"cores": 2}}


def calibrated(**overrides) -> Budgets:
    budgets = Budgets(WatchdogConfig(**{"calibration_steps": 2, "factor": 5.0, "floor_s": 2.0,
                                        "initial_timeout_s": 60, **overrides}), EIGHT)
    for step, seconds in ((1, 30.0), (2, 0.9), (3, 0.7)):  # step 1: warm-up, not observed
        budgets.observe("forward_backward", step, seconds)
        budgets.observe("data", step, 0.01)
        budgets.step_done()
    return budgets


def test_budgets_are_factor_times_the_slowest_observed_after_warm_up():
    budgets = calibrated()
    assert budgets.budget("forward_backward") == pytest.approx(5 * 0.9)
    assert budgets.budget("data") == 2.0  # the floor
    assert budgets.budget("optimizer") == 60  # never observed
    assert budgets.slow_limit("forward_backward") == pytest.approx(5 * 5 * 0.9)


def test_a_batch_ramps_sections_are_budgeted_for_the_steps_batch():
    """Measured at a quarter of the full batch: the sections that follow the
    batch are budgeted 4x at the full batch; the optimizer's is not."""
    budgets = Budgets(WatchdogConfig(calibration_steps=1, factor=5.0, floor_s=0.1), EIGHT)
    budgets.batch_share = 0.25
    for section in ("forward_backward", "optimizer"):
        budgets.observe(section, 2, 1.0)
    budgets.step_done()
    assert budgets.budget("forward_backward") == pytest.approx(5 * 1.0)
    budgets.batch_share = 1.0
    assert budgets.budget("forward_backward") == pytest.approx(5 * 4.0)
    assert budgets.budget("optimizer") == pytest.approx(5 * 1.0)


def test_budgets_before_calibration_and_of_setup_and_checkpoint():
    cfg = WatchdogConfig(calibration_steps=3, initial_timeout_s=60)
    budgets = Budgets(cfg, EIGHT)
    budgets.observe("data", 2, 0.01)
    budgets.step_done()
    assert budgets.budget("data") == 60
    assert budgets.budget("setup") == cfg.setup_timeout_s
    assert budgets.budget("checkpoint") == cfg.checkpoint_timeout_s


def test_a_calibration_round_trips_only_onto_what_it_was_measured_on():
    saved = json.loads(json.dumps(calibrated().calibration()))  # as a checkpoint keeps it
    other = Budgets(WatchdogConfig(calibration_steps=2), {**EIGHT, "world": 1})
    assert not other.restore(saved) and other.slowest == {} and other.steps_seen == 0
    same = Budgets(WatchdogConfig(calibration_steps=2), json.loads(json.dumps(EIGHT)))
    same.observe("data", 2, 0.5)
    assert same.restore(saved)
    assert same.slowest == {"forward_backward": 0.9, "data": 0.5} and same.steps_seen == 3


def test_a_refused_calibration_names_what_differs_not_both_records():
    from megaresil.resilience.watchdog.budgets import what_differs

    saved = {"world": 1, "workload": {"layout": [1, 1, 1], "batch": 16}, "machine": "cpu"}
    now = {"world": 2, "workload": {"layout": [1, 1, 2], "batch": 16}, "machine": "cpu"}
    assert what_differs(saved, now) == "workload.layout [1, 1, 1] -> [1, 1, 2], world 1 -> 2"
