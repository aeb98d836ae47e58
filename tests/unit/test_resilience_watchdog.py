"""The hang detector: culprits, slow told apart from stuck, calibration that
follows the layout and machine, a bounded store load, raise_in_thread."""
from __future__ import annotations

import ctypes
import json
import threading
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from tests.harness.dist import spawn_ranks
from megaresil.config import WatchdogConfig
from megaresil.events import EventLog, read_events
from megaresil.ports import free_port
from megaresil.resilience.faults import compute_for
from megaresil.resilience.watchdog import (
    HangAbort,
    ProgressMeter,
    Watchdog,
    find_culprits,
    raise_in_thread,
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


def watchdog(tmp_path, store, **overrides) -> Watchdog:
    cfg = WatchdogConfig(**{"initial_timeout_s": 0.5, "calibration_steps": 100,
                            "stall_s": 0.5, **overrides})
    wd = Watchdog(cfg, rank=0, world=1, store=store, run_dir=tmp_path,
                  events=EventLog(tmp_path, 0), exit_on_hang=None, guardian=False)
    wd.begin_generation(0)
    return wd


def event_names(tmp_path) -> list[str]:
    return [e["event"] for e in read_events(tmp_path)]


def test_a_slow_rank_is_suspected_once_and_never_aborted(tmp_path):
    wd = watchdog(tmp_path, dist.HashStore())
    try:
        with wd.section("data", 5):
            compute_for(1.5)  # three budgets, still computing
    finally:
        wd.close()
    assert event_names(tmp_path) == ["hang_suspected"]
    suspected = read_events(tmp_path)[0]
    assert suspected["culprit_ranks"] == [0] and suspected["budget_s"] == 0.5
    assert suspected["section"] == "data" and suspected["step"] == 5


def test_a_stuck_rank_is_aborted_soon_after_its_budget(tmp_path):
    wd = watchdog(tmp_path, dist.HashStore())
    started = time.monotonic()
    try:
        with pytest.raises(HangAbort), wd.section("data", 5):
            while time.monotonic() - started < 10:
                time.sleep(0.05)  # the `hang` fault's sleep
    finally:
        wd.close()
    assert time.monotonic() - started < 0.5 + 1.5
    detected = [e for e in read_events(tmp_path) if e["event"] == "hang_detected"]
    assert len(detected) == 1 and detected[0]["culprit_ranks"] == [0]
    assert detected[0]["why"] == "stuck"


def test_an_endless_computation_is_caught_at_the_hard_limit(tmp_path):
    wd = watchdog(tmp_path, dist.HashStore(), slow_limit_factor=3.0)
    started = time.monotonic()
    try:
        with pytest.raises(HangAbort), wd.section("optimizer", 5):
            compute_for(10)
    finally:
        wd.close()
    assert 1.5 <= time.monotonic() - started < 1.5 + 1.0
    detected = next(e for e in read_events(tmp_path) if e["event"] == "hang_detected")
    assert detected["why"] == "slow_limit"


# --- calibration -----------------------------------------------------------------

def test_calibrated_budgets_have_a_floor(tmp_path):
    wd = watchdog(tmp_path, dist.HashStore(), calibration_steps=2, factor=5.0, floor_s=2.0,
                  initial_timeout_s=60)
    wd.close()
    wd.slowest = {"data": 0.01, "forward_backward": 0.9}
    assert wd.budget("data") == 60  # not calibrated yet
    wd.steps_seen = 2
    assert wd.budget("data") == 2.0 and wd.budget("forward_backward") == pytest.approx(4.5)
    assert wd.budget("checkpoint") == wd.cfg.checkpoint_timeout_s
    assert wd.slow_limit("forward_backward") == pytest.approx(5 * 4.5)


def test_calibration_is_restored_only_on_the_layout_and_machine_it_was_measured_on(tmp_path):
    cfg = WatchdogConfig(calibration_steps=2, floor_s=1.0)

    def make(world: int, workload: dict) -> Watchdog:
        wd = Watchdog(cfg, rank=0, world=world, store=dist.HashStore(), run_dir=tmp_path,
                      events=EventLog(tmp_path, 0), exit_on_hang=None, workload=workload,
                      guardian=False)
        wd.close()
        return wd

    eight = make(8, {"tp": 2, "pp": 2, "dp": 2})
    eight.slowest, eight.steps_seen = {"forward_backward": 1.548}, 40
    saved = json.loads(json.dumps(eight.calibration()))  # as the checkpoint stores it
    one = make(1, {"tp": 1, "pp": 1, "dp": 1})
    assert not one.restore_calibration(saved)
    assert one.budget("forward_backward") == cfg.initial_timeout_s  # measured afresh
    other_machine = json.loads(json.dumps(saved))
    other_machine["measured_on"]["machine"]["cores"] += 1
    again = make(8, {"tp": 2, "pp": 2, "dp": 2})
    assert not again.restore_calibration(other_machine)
    assert not again.restore_calibration({"slowest": {"data": 1.0}, "steps_seen": 7})  # unknown
    assert again.restore_calibration(saved)
    assert again.budget("forward_backward") == pytest.approx(5 * 1.548)


# --- store load --------------------------------------------------------------------

class CountingStore:
    """A store that counts operations (a multi_get counts one per key)."""

    def __init__(self, store: dist.Store):
        self.store, self.ops = store, 0

    def __getattr__(self, name):
        method = getattr(self.store, name)

        def counted(*args, **kwargs):
            self.ops += len(args[0]) if name == "multi_get" else 1
            return method(*args, **kwargs)
        return counted


def test_store_ops_per_rank_stay_bounded(tmp_path):
    """Four ranks training normally for 3 s: at most 3 ops/s per rank (the
    old design wrote a heartbeat and polled the abort key every 0.1 s: 20),
    and with 1,000 ranks the whole job stays under store_ops_limit."""
    shared = dist.HashStore()
    cfg = WatchdogConfig(initial_timeout_s=60)
    stores = [CountingStore(shared) for _ in range(4)]
    dogs = [Watchdog(cfg, rank=r, world=4, store=stores[r], run_dir=tmp_path,
                     events=EventLog(tmp_path, r), exit_on_hang=None, guardian=False)
            for r in range(4)]
    for wd in dogs:
        wd.begin_generation(0)
    started = time.monotonic()
    for step in range(1, 31):  # 30 steps of three 0.033 s sections
        for section in ("data", "forward_backward", "optimizer"):
            for wd in dogs:
                wd.current = (section, step, time.monotonic())
            time.sleep(0.033)
    seconds = time.monotonic() - started
    ops = [s.ops for s in stores]
    for wd in dogs:
        wd.close()
    # The first beat and poll come at once; then 2 beats and 1 poll a second.
    assert max(ops) <= 2 + 3.0 * seconds + 1, (ops, seconds)
    big = Watchdog(cfg, rank=0, world=1000, store=dist.HashStore(), run_dir=tmp_path,
                   events=EventLog(tmp_path, 0), exit_on_hang=None, guardian=False)
    big.close()
    per_rank = 1 / big.heartbeat_every + 1 / big.abort_poll_every
    assert 1000 * per_rank <= cfg.store_ops_limit + 1e-6


# --- raise_in_thread -----------------------------------------------------------------

def test_raise_in_thread_reports_a_missing_thread_and_raises_in_a_live_one():
    assert raise_in_thread(2**40 + 12345, HangAbort) is False
    caught = []

    def victim():
        try:
            while True:
                time.sleep(0.01)
        except HangAbort:
            caught.append(True)
    thread = threading.Thread(target=victim)
    thread.start()
    assert raise_in_thread(thread.ident, HangAbort) is True
    thread.join(timeout=5)
    assert caught == [True]


def test_raise_in_thread_undoes_a_call_that_matched_several_threads(monkeypatch):
    calls = []

    def set_async_exc(thread_id, exc):
        calls.append(exc)
        return 2 if len(calls) == 1 else 1
    monkeypatch.setattr(ctypes.pythonapi, "PyThreadState_SetAsyncExc", set_async_exc)
    with pytest.raises(SystemError, match="matched 2 thread states"):
        raise_in_thread(7, HangAbort)
    assert len(calls) == 2 and calls[1] is None  # the exception was taken back


# --- several ranks -------------------------------------------------------------------

def chain_worker(rank: int, port: int, run_dir: str) -> None:
    """Rank 0 calls a collective nobody else calls; rank 1 waits for 0 on
    their pair, rank 2 for 1 on theirs."""
    store = dist.TCPStore("127.0.0.1", port, 3, is_master=rank == 0,
                          timeout=timedelta(seconds=60))
    dist.init_process_group("gloo", rank=rank, world_size=3, store=dist.PrefixStore("pg", store))
    side, pair01, pair12 = (dist.new_group(ranks) for ranks in ([0, 1, 2], [0, 1], [1, 2]))
    cfg = WatchdogConfig(initial_timeout_s=1.0, calibration_steps=100, slow_limit_factor=3.0)
    wd = Watchdog(cfg, rank=rank, world=3, store=dist.PrefixStore("wd", store),
                  run_dir=run_dir, events=EventLog(run_dir, rank), exit_on_hang=None,
                  guardian=False)
    wd.begin_generation(0)
    dist.barrier()
    try:
        try:
            with wd.section("optimizer", 5):
                if rank == 0:
                    dist.barrier(group=side)
                elif rank == 1:
                    dist.all_reduce(torch.ones(1), group=pair01)
                else:
                    time.sleep(0.2)
                    dist.all_reduce(torch.ones(1), group=pair12)
        except RuntimeError:  # the collective timed out: HangAbort is on its way
            time.sleep(10)
    except HangAbort:
        pass
    wd.close()


def test_collective_hang_across_ranks_names_the_rank_that_hung(tmp_path):
    spawn_ranks(chain_worker, (free_port(), str(tmp_path)), 3)
    events = read_events(tmp_path)
    detected = [e for e in events if e["event"] == "hang_detected"]
    assert len(detected) == 1, events
    assert detected[0]["culprit_ranks"] == [0] and detected[0]["section"] == "optimizer"
    assert detected[0]["waited_s"] < 1.0 + 1.5
