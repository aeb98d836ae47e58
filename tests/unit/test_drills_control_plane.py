"""The control-plane simulator (drills/control_plane.py) at a small scale:
64 simulated ranks on 8 nodes run the real watchdogs and membership wait
against a real TCPStore; the steady store traffic is what the key analysis
(bench/README.md, "Control plane at scale") says, a lost rank is detected
and named, and its replacement's wait reads one key a look (its judges
name every rank's key)."""
from __future__ import annotations

import math

import pytest

from megaresil.drills.control_plane import ControlPlaneSim, SimConfig, expected_steady
from megaresil.events import read_events
from megaresil.resilience.replacement import ENTERED_POLL_S, POLL_S, REPORTERS
from megaresil.resilience.watchdog.judgement import HANG_JUDGES

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
    # Only the hang judges read every heartbeat (one a node here), about four
    # times: 8·world keys a look, where every rank judging read world².
    assert fault["judging"] == HANG_JUDGES == WORLD // sim.cfg.ranks_per_node
    heartbeat_keys = sum(row["keys"] for name, row in fault["by_pattern"].items()
                         if name.endswith(" hb/N/N"))
    assert WORLD * HANG_JUDGES <= heartbeat_keys <= 6 * WORLD * HANG_JUDGES < WORLD * WORLD
    detected = [e for e in read_events(tmp_path) if e["event"] == "hang_detected"]
    assert len(detected) == 1 and detected[0]["culprit_ranks"] == [WORLD - 1]

    replaced = sim.replace(WORLD - 1)
    assert 0 <= replaced["after_join_s"] <= 0.1
    # The judge (the first rank in) reads the count, one key a look, and
    # names the missing ranks every POLL_S (JobStore.missing_members): a few
    # round trips of every rank's key. The other waiting ranks read one key a
    # look, so all waiting ranks together read O(world) keys a second.
    waiter = replaced["one_waiter"]
    counts = waiter["by_pattern"]["add genN/entered"]
    assert counts["calls"] == counts["keys"] >= waiter["seconds"] / ENTERED_POLL_S
    checks = waiter["by_pattern"]["check genN/pid/N"]
    judged = waiter["seconds"] / POLL_S + 1
    assert checks["calls"] <= judged * (2 * math.log2(WORLD) + 1)
    assert WORLD * (judged - 1) <= checks["keys"] <= 2 * WORLD * judged
    all_keys = waiter["all_waiting_per_s"]["keys"]
    assert all_keys <= REPORTERS * 2 * WORLD / POLL_S + 2 * WORLD / ENTERED_POLL_S
    assert all_keys < WORLD * WORLD / POLL_S  # what every rank naming every key read
