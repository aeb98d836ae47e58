"""The hang detector as a whole: slow told apart from stuck (on a fake
clock), calibration that follows the layout and machine, a bounded store
load, raise_in_thread, culprits across real ranks. The pure parts have
their own tests: test_watchdog_judgement.py, test_watchdog_budgets.py."""
from __future__ import annotations

import ctypes
import json
import os
import subprocess
import sys
import threading
import time
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from tests.harness.dist import spawn_ranks
from tests.harness.fake_clock import FakeClock, FakeCpu, run_monitor
from megaresil.config import WatchdogConfig
from megaresil.events import EventLog, read_events
from megaresil.ports import free_port
from megaresil.resilience.watchdog.abort import HangAbort, raise_in_thread
from megaresil.resilience.watchdog.monitor import Watchdog


def watchdog(tmp_path, store, clock: FakeClock, cpu: FakeCpu, **overrides) -> Watchdog:
    """A one-rank watchdog in generation 0 on a fake clock and CPU clock; its
    thread is not started: the test drives its polls (run_monitor)."""
    cfg = WatchdogConfig(**{"initial_timeout_s": 0.5, "calibration_steps": 100,
                            "stall_s": 0.5, **overrides})
    wd = Watchdog(cfg, rank=0, world=1, store=store, run_dir=tmp_path,
                  events=EventLog(tmp_path, 0), exit_on_hang=None, guardian=False,
                  clock=clock, cpu_clock=cpu)
    wd.begin_generation(0)
    return wd


def event_names(tmp_path) -> list[str]:
    return [e["event"] for e in read_events(tmp_path)]


def test_a_slow_rank_is_suspected_once_and_never_aborted(tmp_path):
    clock, cpu = FakeClock(), FakeCpu()
    wd = watchdog(tmp_path, dist.HashStore(), clock, cpu)
    try:
        with wd.section("data", 5):
            # Three budgets, still computing.
            run_monitor(wd, clock, cpu, seconds=1.5, cpu_share=1.0)
    finally:
        wd.close()
    assert event_names(tmp_path) == ["hang_suspected"]
    suspected = read_events(tmp_path)[0]
    assert suspected["culprit_ranks"] == [0] and suspected["budget_s"] == 0.5
    assert suspected["section"] == "data" and suspected["step"] == 5


def test_a_stuck_rank_is_aborted_soon_after_its_budget(tmp_path):
    clock, cpu = FakeClock(), FakeCpu()
    wd = watchdog(tmp_path, dist.HashStore(), clock, cpu)
    started = clock.monotonic()
    try:
        with pytest.raises(HangAbort), wd.section("data", 5):
            run_monitor(wd, clock, cpu, seconds=10, cpu_share=0.0)  # the `hang` fault's sleep
    finally:
        wd.close()
    assert clock.monotonic() - started < 0.5 + 1.5
    detected = [e for e in read_events(tmp_path) if e["event"] == "hang_detected"]
    assert len(detected) == 1 and detected[0]["culprit_ranks"] == [0]
    assert detected[0]["why"] == "stuck"


def test_a_rank_the_abort_has_not_freed_yet_still_beats(tmp_path):
    """Aborted while blocked in C code (a collective until its time limit),
    the rank is alive: its heartbeat goes on, marked aborting, so ranks
    waiting for a replacement do not take it for lost
    (resilience/replacement.Liveness)."""
    clock, cpu, store = FakeClock(), FakeCpu(), dist.HashStore()
    wd = watchdog(tmp_path, store, clock, cpu)
    try:
        with pytest.raises(HangAbort), wd.section("data", 5):
            run_monitor(wd, clock, cpu, seconds=10, cpu_share=0.0)
        before = json.loads(store.get("hb/0/0"))["beat"]
        for _ in range(20):  # the abort landed here; a thread blocked in C would still be
            clock.advance(wd.cfg.poll_s)
            wd.poll()
        beat = json.loads(store.get("hb/0/0"))
    finally:
        wd.close()
    assert beat["beat"] > before and beat["state"] == "aborting"


@pytest.mark.parametrize("section,limit", [("setup", 30.0 + 5.0), ("data", 4 * 0.5 + 5.0)])
def test_an_aborted_rank_not_freed_from_setup_exits_within_half_a_minute(tmp_path, section,
                                                                          limit):
    """Another rank's failure aborts this one. In setup (a 600 s budget) a
    rank the abort has not freed after 30 s waits in a process group's
    formation for a peer that left, which no abort ends: it exits for a
    relaunch then, not at the setup budget's hard limit (an hour). Other
    sections keep their hard limit, the collective timeout."""
    clock, cpu, store = FakeClock(), FakeCpu(), dist.HashStore()
    wd = watchdog(tmp_path, store, clock, cpu, slow_limit_factor=4.0)
    armed = []
    wd.exit_timer.arm = lambda seconds, on_expiry: armed.append(seconds)
    try:
        with pytest.raises(HangAbort), wd.section(section, 0):
            store.set("abort/0", json.dumps({"reason": "error", "rank": 1, "error": "x"}))
            run_monitor(wd, clock, cpu, seconds=2, cpu_share=0.0)
    finally:
        wd.close()
    assert armed == [limit]


def test_a_rank_waiting_on_a_slow_link_is_suspected_and_caught_only_at_the_hard_limit(tmp_path):
    # Blocked in a collective (no CPU) while its peer connections move bytes,
    # a second apart as on a congested link: a slow link, not a hang. The
    # hard limit (the gloo timeout) still holds.
    clock, cpu, moved = FakeClock(), FakeCpu(), [0]
    cfg = WatchdogConfig(initial_timeout_s=2.0, calibration_steps=100, stall_s=0.5,
                         slow_limit_factor=4.0)
    wd = Watchdog(cfg, rank=0, world=1, store=dist.HashStore(), run_dir=tmp_path,
                  events=EventLog(tmp_path, 0), exit_on_hang=None, guardian=False,
                  clock=clock, cpu_clock=cpu, peer_bytes=lambda: moved[0])
    wd.begin_generation(0)
    started = clock.monotonic()
    poll = wd.poll

    def poll_while_the_link_moves_bytes():
        if round(clock.monotonic() * 10) % 10 == 0:
            moved[0] += 100  # a few acknowledged bytes each second
        poll()
    wd.poll = poll_while_the_link_moves_bytes
    try:
        with pytest.raises(HangAbort), wd.section("optimizer", 5):
            run_monitor(wd, clock, cpu, seconds=10, cpu_share=0.0)
    finally:
        wd.close()
    assert 8.0 <= clock.monotonic() - started < 8.0 + 1.0  # 4 budgets, not 2 + stall_s
    events = read_events(tmp_path)
    assert [e["event"] for e in events] == ["hang_suspected", "hang_detected"]
    assert events[1]["why"] == "slow_limit"


def test_the_bytes_a_process_moves_are_counted_and_the_stores_left_out():
    from megaresil.resilience.watchdog.probes import peer_bytes_counter
    import socket

    with socket.create_server(("127.0.0.1", 0)) as server:
        port = server.getsockname()[1]
        with socket.create_connection(("127.0.0.1", port)) as client:
            accepted, _ = server.accept()
            with accepted:
                counted, store_left_out = peer_bytes_counter(None), peer_bytes_counter(port)
                before = counted(), store_left_out()
                client.sendall(b"x" * 50_000)
                received = 0
                while received < 50_000:
                    received += len(accepted.recv(1 << 20))
                deadline = time.time() + 10
                while counted() - before[0] < 100_000 and time.time() < deadline:
                    time.sleep(0.01)  # the acknowledgement's way back
                assert counted() - before[0] == 100_000  # acknowledged + received
                assert store_left_out() == before[1]  # both ends are the "store's"


def test_a_nodes_ranks_share_their_byte_counts_and_the_last_one_out_removes_the_file(tmp_path):
    from megaresil.resilience.watchdog.probes import NodeTraffic

    own = {0: 0, 1: 0}
    path = tmp_path / "traffic"
    ranks = {r: NodeTraffic(lambda r=r: own[r], path, local_rank=r) for r in (0, 1)}
    own[1] = 500  # rank 0's sockets idle, rank 1's move: the node's link is busy
    assert ranks[1]() == 500 and ranks[0]() == 500
    own[0] = 20
    assert ranks[0]() == 520
    ranks[0].close()
    assert path.exists()
    ranks[1].close()
    assert not path.exists()
    assert NodeTraffic(lambda: 7, None, local_rank=3)() == 7  # no node-local directory


def test_the_node_traffic_file_is_never_written_through_a_planted_link(tmp_path, capsys):
    """Its name is predictable: in /dev/shm itself (any user's) a link
    planted there had a run as root overwrite its target's first bytes. A
    port no TCP store has, so that no job of this machine shares the name."""
    from megaresil.resilience.watchdog.probes import NodeTraffic, node_traffic_path

    path = node_traffic_path(100_000 + os.getpid(), 0)
    target = tmp_path / "precious"
    target.write_bytes(b"precious" * 4)
    path.parent.mkdir(mode=0o700, exist_ok=True)
    path.symlink_to(target)
    try:
        traffic = NodeTraffic(lambda: 7, path, local_rank=0)
        assert traffic() == 7  # its own count: no file to share
        traffic.close()
    finally:
        path.unlink()
    assert target.read_bytes() == b"precious" * 4
    assert "counts each rank's own traffic, not its node's" in capsys.readouterr().err


def test_the_node_traffic_file_lies_in_a_directory_of_the_users_own(tmp_path):
    from megaresil.resilience.watchdog.probes import NodeTraffic, node_traffic_path

    assert node_traffic_path(29500, 3) == Path(f"/dev/shm/megaresil-{os.getuid()}/traffic-29500-3")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (tmp_path / "megaresil-0").symlink_to(elsewhere)  # planted in place of the directory
    assert NodeTraffic(lambda: 7, tmp_path / "megaresil-0" / "traffic-1-0", 0)() == 7
    assert list(elsewhere.iterdir()) == []


def test_a_killed_jobs_traffic_file_is_removed_by_the_next_job_on_the_node(tmp_path):
    """A rank killed never runs its close(): 40-odd files were seen left."""
    from megaresil.resilience.watchdog.probes import NodeTraffic

    directory = tmp_path / "megaresil-0"
    directory.mkdir(mode=0o700)
    killed = subprocess.Popen(
        [sys.executable, "-c", "import pathlib, sys, time\n"
         "from megaresil.resilience.watchdog.probes import NodeTraffic\n"
         "NodeTraffic(lambda: 5, pathlib.Path(sys.argv[1]), 0)()\n"
         "print('counting', flush=True)\ntime.sleep(300)", str(directory / "traffic-1-0")],
        stdout=subprocess.PIPE, text=True)
    try:
        assert killed.stdout.readline() == "counting\n"
        alive = NodeTraffic(lambda: 1, directory / "traffic-2-0", 0)  # another job's, running
    finally:
        killed.kill()
        killed.wait()
    assert (directory / "traffic-1-0").exists()
    NodeTraffic(lambda: 3, directory / "traffic-3-0", 0).close()  # the next job, start to end
    assert sorted(p.name for p in directory.iterdir()) == ["traffic-2-0"]
    alive.close()
    assert list(directory.iterdir()) == []


def test_an_endless_computation_is_caught_at_the_hard_limit(tmp_path):
    clock, cpu = FakeClock(), FakeCpu()
    wd = watchdog(tmp_path, dist.HashStore(), clock, cpu, slow_limit_factor=3.0)
    started = clock.monotonic()
    try:
        with pytest.raises(HangAbort), wd.section("optimizer", 5):
            run_monitor(wd, clock, cpu, seconds=10, cpu_share=1.0)
    finally:
        wd.close()
    assert 1.5 <= clock.monotonic() - started < 1.5 + 1.0
    detected = next(e for e in read_events(tmp_path) if e["event"] == "hang_detected")
    assert detected["why"] == "slow_limit"


def test_a_rank_that_leaves_the_generation_while_an_abort_is_on_its_way_is_not_hit(
        tmp_path, monkeypatch):
    # A peer announced an abort; this rank's monitor reads it and dumps the
    # stacks while the training thread fails on its own and leaves the
    # generation. HangAbort must not land in that thread's failure handling
    # (it did: the worker died, and a restart waited out the checkpoint timeout).
    import megaresil.resilience.watchdog.monitor as monitor

    clock, cpu = FakeClock(), FakeCpu()
    store = dist.HashStore()
    wd = watchdog(tmp_path, store, clock, cpu)
    store.set("abort/0", json.dumps({"reason": "error", "rank": 1}))
    dumped = monitor.dump_stacks

    def dump_while_the_thread_leaves(*args):
        dumped(*args)
        wd.pause()

    monkeypatch.setattr(monitor, "dump_stacks", dump_while_the_thread_leaves)
    try:
        wd.poll()
        for _ in range(1000):  # bytecodes enough for a pending HangAbort to land
            pass
    finally:
        wd.close()
    assert (tmp_path / "hangs" / "generation_0" / "rank0.txt").exists()
    assert json.loads(store.get("hb/0/0"))["state"] == "left"


class LeavingStore:
    """A store on which the training thread leaves the generation (pause)
    just after the monitor found an abort announced, before it reads it."""

    def __init__(self, store):
        self.store, self.read, self.watchdog = store, [], None

    def check(self, keys):
        found = self.store.check(keys)
        if found and keys == ["abort/0"]:
            self.watchdog.pause()
        return found

    def get(self, key):
        self.read.append(key)
        return self.store.get(key)

    def __getattr__(self, name):
        return getattr(self.store, name)


def test_the_monitor_reads_the_abort_of_the_generation_it_judges_though_the_rank_left_it(
        tmp_path, capsys):
    # It read `abort/None` instead: a key nobody sets, so the read waited for
    # the store's timeout while holding the store's client, and the rank's
    # own "left" heartbeat waited behind it (a 43 s stall, then a relaunch).
    store = dist.HashStore()
    store.set_timeout(timedelta(seconds=1))
    leaving = LeavingStore(store)
    wd = watchdog(tmp_path, leaving, FakeClock(), FakeCpu())
    leaving.watchdog = wd
    store.set("abort/0", json.dumps({"reason": "error", "rank": 1}))
    try:
        wd.poll()
    finally:
        wd.close()
    assert leaving.read == ["abort/0"]
    assert "megaresil watchdog" not in capsys.readouterr().err
    assert json.loads(store.get("hb/0/0"))["state"] == "left"


def save_section_with_a_peer(tmp_path, clock: FakeClock, peer_beats_until: float):
    """Rank 0 of two (node n0) blocked in a save's checkpoint section (budget
    300 s), its peer (node n1) blocked too, beating until `peer_beats_until`."""
    cfg = WatchdogConfig(initial_timeout_s=0.5, calibration_steps=100, stall_s=0.5,
                         checkpoint_timeout_s=300.0)
    store = dist.HashStore()
    wd = Watchdog(cfg, rank=0, world=2, store=store, run_dir=tmp_path,
                  events=EventLog(tmp_path, 0), exit_on_hang=None, guardian=False,
                  clock=clock, cpu_clock=FakeCpu(), node="n0")
    wd.begin_generation(0)
    poll, beats = wd.poll, [0]

    def poll_beside_the_peer():
        if clock.monotonic() < peer_beats_until:
            beats[0] += 1
            store.set("hb/0/1", json.dumps({"state": "running", "section": "checkpoint",
                                            "step": 8, "beat": beats[0], "stalled_s": 30.0,
                                            "quiet_s": 30.0, "node": "n1", "at": 100.0}))
        poll()
    wd.poll = poll_beside_the_peer
    return wd


def test_a_peer_silent_during_a_save_is_a_hang_long_before_the_checkpoints_budget(tmp_path):
    # A node cut off mid-save: its heartbeats stop. The checkpoint's own
    # budget (300 s) is for slow filesystems; a silent peer is no slow write.
    clock = FakeClock()
    wd = save_section_with_a_peer(tmp_path, clock, peer_beats_until=2.0)
    try:
        with pytest.raises(HangAbort), wd.section("checkpoint", 8):
            run_monitor(wd, clock, FakeCpu(), seconds=60, cpu_share=0.0)
    finally:
        wd.close()
    assert clock.monotonic() < 2.0 + 2 * wd.peers.stale_after
    detected = [e for e in read_events(tmp_path) if e["event"] == "hang_detected"]
    assert len(detected) == 1
    assert detected[0]["why"] == "silent" and detected[0]["culprit_ranks"] == [1]
    assert detected[0]["budget_s"] == 0.5  # the silence budget, before calibration
    assert [u["node"] for u in detected[0]["unreachable"]] == ["n1"]


def test_a_peer_that_beats_through_a_slow_save_waits_for_the_checkpoints_budget(tmp_path):
    # Both ranks blocked (no CPU, no byte) in a save on a slow filesystem: no
    # hang and no warning until the checkpoint's own budget.
    clock = FakeClock()
    wd = save_section_with_a_peer(tmp_path, clock, peer_beats_until=float("inf"))
    try:
        with wd.section("checkpoint", 8):
            run_monitor(wd, clock, FakeCpu(), seconds=120, cpu_share=0.0)
    finally:
        wd.close()
    assert [e for e in read_events(tmp_path) if e["event"].startswith("hang")] == []


# --- calibration -----------------------------------------------------------------

def test_calibrated_budgets_have_a_floor(tmp_path):
    wd = watchdog(tmp_path, dist.HashStore(), FakeClock(), FakeCpu(), calibration_steps=2,
                  factor=5.0, floor_s=2.0, initial_timeout_s=60)
    wd.close()
    wd.budgets.slowest = {"data": 0.01, "forward_backward": 0.9}
    assert wd.budget("data") == 60  # not calibrated yet
    wd.budgets.steps_seen = 2
    assert wd.budget("data") == 2.0 and wd.budget("forward_backward") == pytest.approx(4.5)
    assert wd.budget("checkpoint") == wd.cfg.checkpoint_timeout_s
    wd.budgets.slowest["checkpoint"] = 1.5
    assert wd.budgets.silence_budget("checkpoint") == pytest.approx(7.5)
    assert wd.budgets.silence_budget("data") == wd.budget("data")
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
    eight.budgets.slowest, eight.budgets.steps_seen = {"forward_backward": 1.548}, 40
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
        wd.start()
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
    wd.start()
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
