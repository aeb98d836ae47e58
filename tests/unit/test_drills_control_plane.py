"""The control-plane simulator (drills/control_plane.py) at a small scale:
64 simulated ranks on 8 nodes run the real watchdogs and membership wait
against a real TCPStore; the steady store traffic is what the key analysis
(bench/README.md, "Control plane at scale") says, a lost rank is detected
and named, and its replacement's wait names every rank's key per look."""
from __future__ import annotations

import math

import pytest

from megaresil.drills.control_plane import ControlPlaneSim, SimConfig, expected_steady
from megaresil.events import read_events
from megaresil.resilience.replacement import POLL_S

WORLD = 64


@pytest.fixture
def sim(tmp_path):
    simulated = ControlPlaneSim(SimConfig(world=WORLD, ranks_per_node=8), tmp_path)
    simulated.start()
    yield simulated
    simulated.close()


def test_steady_traffic_is_one_heartbeat_and_one_abort_check_per_rank_interval(sim):
    expected = expected_steady(sim.cfg.watchdog, WORLD)
    steady = sim.run_for(4 * expected["abort_poll_s"])
    assert steady["by_pattern"].keys() == {"set hb/N/N", "check abort/N"}
    assert steady["by_pattern"]["check abort/N"]["calls"] / steady["seconds"] \
        == expected["checks_per_s"] == WORLD / 1.0
    assert steady["by_pattern"]["set hb/N/N"]["calls"] / steady["seconds"] \
        == expected["sets_per_s"] == WORLD / 0.5


def test_a_lost_rank_is_detected_named_and_replaced(sim, tmp_path):
    sim.lose(WORLD - 1)
    fault = sim.run_until_aborted(limit_s=60.0)
    heartbeat_s = expected_steady(sim.cfg.watchdog, WORLD)["heartbeat_s"]
    silence_budget = sim.ranks[0].watchdog.budgets.silence_budget("forward_backward")
    assert fault["culprits"] == [WORLD - 1]
    assert fault["aborted"] == fault["live"] == WORLD - 1
    # The survivors wait out the section's budget, then the lost rank's
    # heartbeat must stay unchanged for 2.5 intervals (judgement.STALE_HEARTBEATS).
    assert silence_budget < fault["detected_s"] <= silence_budget + 4 * heartbeat_s
    detected = [e for e in read_events(tmp_path) if e["event"] == "hang_detected"]
    assert len(detected) == 1 and detected[0]["culprit_ranks"] == [WORLD - 1]

    replaced = sim.replace(WORLD - 1)
    assert 0 <= replaced["after_join_s"] <= 0.1
    # Each waiting rank's look at who is missing: a few round trips
    # (JobStore.missing_members), but every rank's key named, so O(world²)
    # keys a look for all the waiting ranks together, as issue 55 still has.
    checks = replaced["one_waiter"]["by_pattern"]["check genN/pid/N"]
    looks = replaced["one_waiter"]["seconds"] / POLL_S
    assert checks["calls"] <= (looks + 2) * (2 * math.log2(WORLD) + 1)
    assert checks["keys"] >= WORLD * looks
