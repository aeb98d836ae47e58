"""The watchdog's judgement, pure: culprits named from heartbeats, a thread's
progress from its CPU time, peers gone silent, and what an alarm comes to
(stuck, past the hard limit, suspected) — all at given times, no clock."""
from __future__ import annotations

import pytest

from megaresil.config import WatchdogConfig
from megaresil.resilience.watchdog.judgement import (
    HANG_JUDGES,
    Alarm,
    PeerBeats,
    ProgressMeter,
    blamed_in_collectives,
    find_culprits,
    judges_hangs,
    store_intervals,
    stuck_or_running,
    unreachable_nodes,
    verdict,
)

def beat(step: int, section: str, state: str = "running", coll: dict | None = None,
         stalled_s: float = 2.0) -> dict:
    return {"state": state, "section": section, "step": step, "beat": 1,
            "stalled_s": stalled_s, "coll": coll or {}}


# --- culprits --------------------------------------------------------------------

def test_culprits_are_the_ranks_behind():
    # Rank 2 is still in `data` of step 5 while the others wait in collectives.
    assert find_culprits({0: beat(5, "forward_backward"), 1: beat(5, "optimizer"),
                          2: beat(5, "data")}) == [2]
    assert find_culprits({0: None, 1: beat(3, "data")}) == [0]  # never wrote one


def test_after_a_killed_rank_the_lost_rank_is_named_not_those_that_left():
    """Rank 5 was killed in forward_backward of step 7. Ranks 1, 2, 3, 7 met
    the closed connection and left the generation (they stop beating, which
    the old rule took for silence); 0, 4, 6 wait in the optimizer's collectives."""
    beats = {r: beat(7, "optimizer") for r in (0, 4, 6)}
    beats.update({r: beat(7, "forward_backward", state="left") for r in (1, 2, 3, 7)})
    beats[5] = beat(7, "forward_backward")
    assert find_culprits(beats) == [5]  # at the first read: furthest behind
    assert find_culprits(beats, gone=frozenset({5})) == [5]  # once its beat stopped
    beats[5] = beat(7, "optimizer")  # killed after the others' last collective with it
    assert find_culprits(beats, gone=frozenset({5})) == [5]


def three_d_collective_hang() -> dict[int, dict]:
    """tp2 pp2 dp2 (tp pairs 0-1, 2-3, 4-5, 6-7; dp pairs 0-2, 1-3, 4-6, 5-7;
    stage 0 = ranks 0-3). Rank 0 hangs on entering the optimizer inside a
    collective of a world-wide group nobody else calls; every rank ends in
    the optimizer of step 90, each blocked in a collective that waits for
    rank 0 directly or through a peer waiting for it."""
    base = {"world": 40, "hang": 0, "tp01": 30, "tp23": 30, "tp45": 30, "tp67": 30,
            "dp02": 20, "dp13": 20, "dp46": 20, "dp57": 20, "emb04": 9, "emb15": 9,
            "emb26": 9, "emb37": 9}
    groups = {0: ["world", "hang", "tp01", "dp02", "emb04"], 1: ["world", "hang", "tp01", "dp13", "emb15"],
              2: ["world", "hang", "tp23", "dp02", "emb26"], 3: ["world", "hang", "tp23", "dp13", "emb37"],
              4: ["world", "hang", "tp45", "dp46", "emb04"], 5: ["world", "hang", "tp45", "dp57", "emb15"],
              6: ["world", "hang", "tp67", "dp46", "emb26"], 7: ["world", "hang", "tp67", "dp57", "emb37"]}
    ahead = {0: {"hang"}, 1: {"tp01"}, 2: {"dp02"}, 3: {"dp13"},  # 3 waits for 1 on dp
             4: {"emb04"}, 5: {"emb15"}, 6: {"emb26"}, 7: {"emb37"}}  # last stage: tied embeddings
    return {r: beat(90, "optimizer", coll={g: base[g] + (g in ahead[r]) for g in groups[r]})
            for r in range(8)}


def test_a_collective_hang_at_3d_names_the_rank_that_hung_not_all_eight():
    assert find_culprits(three_d_collective_hang()) == [0]


def test_ties_go_to_the_rank_most_peers_wait_for():
    # Rank 1 waits for 0 and 2 waits for 0 on their pairs; 0 computes.
    beats = {0: beat(4, "forward_backward", coll={"p01": 5, "p02": 5}),
             1: beat(4, "forward_backward", coll={"p01": 6}),
             2: beat(4, "forward_backward", coll={"p02": 6})}
    assert find_culprits(beats) == [0]


def test_a_rank_waiting_inside_torch_distributed_waits_for_the_one_that_is_not():
    """Issue 27 item 9: rank 0 waits in the next generation's setup for rank 1
    to create a process group (no collective counted yet, so no count tells
    them apart); rank 1 hangs in its own code. The hang is rank 1's."""
    beats = {0: {**beat(0, "setup"), "waiting": True}, 1: {**beat(0, "setup"), "waiting": False}}
    assert find_culprits(beats) == [1]
    beats[1]["waiting"] = True  # both wait inside torch.distributed: nothing tells them apart
    assert find_culprits(beats) == [0, 1]


# --- slow or stuck ----------------------------------------------------------------

def test_progress_meter_tells_computing_from_blocked():
    cpu = [0.0]
    meter = ProgressMeter(lambda: cpu[0], now=0.0)
    for tick in range(1, 21):  # 2 s of a thread getting 10 % of a core (a loaded machine)
        cpu[0] += 0.01
        meter.sample(tick * 0.1)
    assert meter.stalled_s(2.0) == 0.0
    for tick in range(21, 41):  # 2 s blocked in a collective: 50 us of CPU a second
        cpu[0] += 5e-6
        meter.sample(tick * 0.1)
    assert meter.stalled_s(4.0) == pytest.approx(2.0)


def test_a_byte_counter_advances_with_any_byte_and_a_quiet_link_stalls():
    moved = [0]
    meter = ProgressMeter(lambda: moved[0], now=0.0, min_rate=0.0)
    for tick in range(1, 11):  # a slow link: a few bytes acknowledged each poll
        moved[0] += 3
        meter.sample(tick * 0.1)
    assert meter.stalled_s(1.0) == 0.0
    for tick in range(11, 31):  # cut off: nothing moves
        meter.sample(tick * 0.1)
    assert meter.stalled_s(3.0) == pytest.approx(2.0)


def test_a_rank_without_cpu_is_stuck_only_when_its_connections_are_quiet_too():
    assert stuck_or_running(2.0, stall_s=0.5) == "stuck"  # not measured: the CPU decides
    assert stuck_or_running(2.0, stall_s=0.5, quiet_s=0.1) == "running"  # a slow link
    assert stuck_or_running(2.0, stall_s=0.5, quiet_s=2.0) == "stuck"  # cut off, or waiting
    assert stuck_or_running(0.0, stall_s=0.5, quiet_s=2.0) == "running"  # computing
    # A congested link: a second between bytes is no hang within a 4 s budget.
    assert stuck_or_running(5.0, stall_s=0.5, quiet_s=1.4, quiet_limit=4.0) == "running"
    assert stuck_or_running(5.0, stall_s=0.5, quiet_s=4.0, quiet_limit=4.0) == "stuck"


def test_a_peer_waiting_on_a_slow_link_is_running_and_a_cut_off_one_stuck():
    peers = PeerBeats(heartbeat_every=0.5)
    for n, quiet_s in enumerate([0.1, 0.2], start=1):
        peers.note({1: {**beat(5, "optimizer", stalled_s=3.0), "beat": n, "quiet_s": quiet_s}},
                   now=10.0 + n * 0.5)
    assert peers.state(1, 11.0, stall_s=0.5) == "running"
    peers.note({1: {**beat(5, "optimizer", stalled_s=3.5), "beat": 3, "quiet_s": 1.5}},
               now=11.5)
    assert peers.state(1, 11.5, stall_s=0.5, quiet_limit=4.0) == "running"  # congested
    assert peers.state(1, 11.5, stall_s=0.5, quiet_limit=1.0) == "stuck"


def test_a_node_whose_every_rank_went_silent_is_named_with_its_ranks_and_since_when():
    peers = PeerBeats(heartbeat_every=0.5)

    def read(now: float, beats: dict[int, int]) -> None:
        peers.note({r: {**beat(7, "optimizer"), "beat": n, "node": f"{r // 2} on h{r // 2}",
                        "at": 1000.0 + n} for r, n in beats.items()}, now)
    read(10.0, {0: 1, 1: 1, 2: 1, 3: 1})
    read(12.0, {0: 2, 1: 2, 2: 1, 3: 1})  # node 1's beats stopped; node 0's go on
    assert unreachable_nodes(peers, 12.0, mine="0 on h0") == [
        {"node": "1 on h1", "ranks": [2, 3], "since": 1001.0}]
    assert unreachable_nodes(peers, 12.0, mine="1 on h1") == []  # never this rank's own node
    # One silent rank of a node whose other rank still beats: a rank's hang, not the node.
    read(14.0, {0: 3, 1: 3, 2: 1, 3: 2})
    assert unreachable_nodes(peers, 14.5, mine="0 on h0") == []


# --- peers' heartbeats ------------------------------------------------------------

def test_a_peer_is_judged_by_a_fresh_heartbeat_and_gone_after_two_and_a_half_beats():
    peers = PeerBeats(heartbeat_every=0.5)
    peers.note({1: beat(5, "data", stalled_s=0.0)}, now=10.0)
    assert peers.state(1, 10.0, stall_s=0.5) == "unknown"  # seen once: maybe from before the alarm
    peers.note({1: {**beat(5, "data", stalled_s=0.0), "beat": 2}}, now=10.5)
    assert peers.state(1, 10.5, stall_s=0.5) == "running"
    peers.note({1: {**beat(5, "data", stalled_s=0.7), "beat": 3}}, now=11.0)
    assert peers.state(1, 11.0, stall_s=0.5) == "stuck"
    peers.note({1: {**beat(5, "data", stalled_s=0.7), "beat": 3}}, now=12.0)  # the same beat
    assert peers.gone(12.25) == [] and peers.gone(12.26) == [1]
    assert peers.state(1, 12.26, stall_s=0.5) == "stuck"
    assert peers.state(2, 12.26, stall_s=0.5) == "stuck"  # never heard from


def test_a_peer_that_left_the_generation_is_never_gone():
    peers = PeerBeats(heartbeat_every=0.5)
    peers.note({1: beat(5, "data", state="left")}, now=0.0)
    assert peers.gone(100.0) == []


# --- an alarm ------------------------------------------------------------------------

def test_an_alarm_is_declared_when_every_culprit_is_stuck_or_past_the_hard_limit():
    assert verdict([], waited=100.0, slow_limit=5.0, suspected=False) is None  # nobody named yet
    assert verdict(["stuck", "stuck"], waited=1.1, slow_limit=5.0, suspected=False) == "stuck"
    assert verdict(["stuck", "running"], waited=1.1, slow_limit=5.0, suspected=False) == "suspect"
    assert verdict(["stuck", "running"], waited=1.1, slow_limit=5.0, suspected=True) is None
    assert verdict(["running"], waited=5.0, slow_limit=5.0, suspected=True) is None
    assert verdict(["running"], waited=5.01, slow_limit=5.0, suspected=True) == "slow_limit"
    assert verdict(["unknown"], waited=1.1, slow_limit=5.0, suspected=False) is None


def test_an_alarm_reads_every_rank_again_only_when_a_culprit_moved():
    alarm = Alarm("data", 5, started=0.0)
    alarm.name_culprits({0: beat(5, "optimizer"), 1: beat(5, "data"), 2: None},
                        gone=frozenset())
    assert alarm.culprits == [2] and alarm.positions == {}  # silent: no position
    alarm.name_culprits({0: beat(5, "optimizer"), 1: beat(5, "data")}, gone=frozenset())
    assert alarm.culprits == [1]
    assert alarm.culprits_stayed({1: beat(5, "data")})
    assert not alarm.culprits_stayed({1: beat(5, "forward_backward")})
    assert alarm.culprits_stayed({1: None})  # no heartbeat tells it moved


def test_store_intervals_stretch_with_the_world_to_the_ops_limit():
    cfg = WatchdogConfig()
    assert store_intervals(cfg, 4) == (cfg.heartbeat_s, cfg.abort_poll_s)
    heartbeat, abort_poll = store_intervals(cfg, 1000)
    assert (heartbeat, abort_poll) == pytest.approx((0.75, 1.5))
    assert 1000 * (1 / heartbeat + 1 / abort_poll) == pytest.approx(cfg.store_ops_limit)


def test_eight_hang_judges_spread_one_a_node_and_every_rank_of_a_small_job():
    for world, per_node in [(64, 8), (1000, 8), (16384, 8)]:
        judges = [r for r in range(world) if judges_hangs(r, world)]
        assert len(judges) == HANG_JUDGES
        assert len({r // per_node for r in judges}) == HANG_JUDGES  # a lost node takes one
    assert all(judges_hangs(r, 5) for r in range(5))


def test_the_tie_break_without_collective_counts_leaves_the_tie_to_who_waits():
    beats = {r: {"step": 3, "section": "forward_backward", "coll": {}, "waiting": r != 2}
             for r in range(4)}
    assert blamed_in_collectives([0, 1, 2, 3], beats) == [2]
    assert blamed_in_collectives([0, 1], beats) == [0, 1]
