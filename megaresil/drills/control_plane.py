"""The control-plane simulator: N simulated ranks, grouped into nodes, run
megaresil's real control plane (each rank's watchdog: heartbeats, abort
polls, the hang judgement and its abort; the abort board; live
replacement's entry, membership wait and fence token) against a real c10d
TCPStore, every operation counted (drills/store_meter.py). The training step
is a timer. Unlike real ranks: one process polls every rank's monitor in
turn, on simulated time (ticks of tick_s, all ranks in lockstep); ranks
share a few store connections (`connections`); exit timers never expire
(the simulator frees each aborted rank at once); the ranks that wait in
the lost rank's collective (`judges`, by default all) wait for it, those of
them that judge hangs judge it, the others step on; and one waiting rank runs the membership wait, its reads standing
for every waiter's. bench/control_plane.py runs it at scale (bench/README.md)."""
from __future__ import annotations

import heapq
import itertools
import os
import threading
import time
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional

from megaresil.config import WatchdogConfig
from megaresil.drills.store_meter import Tally, client, serve
from megaresil.events import EventLog
from megaresil.resilience.abort_board import AbortBoard
from megaresil.resilience.coordination import JobStore
from megaresil.resilience.replacement import REPORTERS, await_members, wait_intervals
from megaresil.resilience.watchdog.abort import HangAbort
from megaresil.resilience.watchdog.judgement import store_intervals
from megaresil.resilience.watchdog.monitor import Watchdog

SECTION = "forward_backward"
AGENT_POLL_S = 0.1  # the agent notices its worker's end and records the replacement


class SimClock:
    """megaresil.clock.Clock on simulated time: moved only by `advance` (and
    `sleep`), firing the actions scheduled with `at` as it passes them."""

    def __init__(self):
        self.now = 0.0
        self.due: list = []
        self.order = itertools.count()

    def monotonic(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds
        while self.due and self.due[0][0] <= self.now:
            heapq.heappop(self.due)[2]()

    def sleep(self, seconds: float) -> None:
        self.advance(seconds)

    def wait(self, event: threading.Event, timeout: float) -> bool:
        event.wait()  # only exit timers wait here, and the simulator cancels each
        return True

    def at(self, when: float, action: Callable[[], None]) -> None:
        heapq.heappush(self.due, (when, next(self.order), action))


class AbortSink:
    """The thread the watchdogs raise HangAbort in, in place of a training
    thread: it swallows them (the simulator sees each abort on its rank)."""

    def __init__(self):
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, name="sim-abort-sink", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while not self.stop.is_set():
            try:
                time.sleep(0.01)
            except HangAbort:
                continue

    @property
    def ident(self) -> int:
        assert self.thread.ident is not None  # started in __init__
        return self.thread.ident

    def close(self) -> None:
        self.stop.set()
        self.thread.join(timeout=2)


@dataclass
class SimRank:
    rank: int
    watchdog: Watchdog
    cpu_s: float = 0.0  # its training thread's CPU seconds: grows while it computes
    step: int = 1
    section: Optional[AbstractContextManager] = None
    section_ends: float = 0.0
    blocked: bool = False  # waiting in the lost rank's collective
    lost: bool = False
    aborted_at: Optional[float] = None


@dataclass
class SimConfig:
    world: int
    ranks_per_node: int = 8
    # A binary fraction, so that the watchdog's intervals (0.5 s, 1 s, and
    # their stretched multiples at a world of 2**k) fall on ticks exactly.
    tick_s: float = 0.125
    # Real ranks hold two each; here they share these, node by node (a new
    # connection to a loaded loopback store now and then stalls for 5 s).
    connections: int = 16
    step_s: float = 1.0
    judges: Optional[int] = None  # ranks blocked by the lost one (None: all others)
    warmup_steps: int = 5  # past the watchdog's calibration
    replacement_join_s: float = 1.0  # from the agent's record to the replacement's entry
    watchdog: WatchdogConfig = field(default_factory=WatchdogConfig)


def phase_counts(before: dict, after: dict, seconds: float) -> dict:
    """Operations, keys and bytes between two tallies: totals per second and
    per (operation, key pattern)."""
    rows = {}
    for op, pattern in after["calls"]:
        calls = after["calls"][op, pattern] - before["calls"][op, pattern]
        if calls:
            rows[f"{op} {pattern}"] = {
                "calls": calls, "keys": after["keys"][op, pattern] - before["keys"][op, pattern],
                "bytes": after["bytes"][op, pattern] - before["bytes"][op, pattern]}
    total = {k: sum(r[k] for r in rows.values()) for k in ("calls", "keys", "bytes")}
    return {"seconds": seconds, "per_s": {k: v / seconds for k, v in total.items()} if seconds
            else {}, "by_pattern": rows, **total}


def expected_steady(cfg: WatchdogConfig, world: int) -> dict:
    """What the key analysis says of the steady state: every rank writes its
    heartbeat (one set) each heartbeat interval and checks the abort key
    (one check) each abort-poll interval, both stretched with the world."""
    heartbeat_s, abort_poll_s = store_intervals(cfg, world)
    return {"heartbeat_s": heartbeat_s, "abort_poll_s": abort_poll_s,
            "sets_per_s": world / heartbeat_s, "checks_per_s": world / abort_poll_s}


def all_waiting(judge: dict, waiting: int) -> dict:
    """The membership wait's store reads per second of all `waiting` ranks,
    from one judge's counted ones: REPORTERS judges, and the others' looks
    (replacement.await_members), one key each: the count every look, the
    judges' verdict every judging interval."""
    look_s, verdict_s = wait_intervals(waiting + 1, judge=False)
    others = (waiting - REPORTERS) * (1 / look_s + 1 / verdict_s)
    return {unit: judge[unit] / judge["seconds"] * REPORTERS + others
            for unit in ("calls", "keys")}


class ControlPlaneSim:
    """One simulated job: `start()`, `run_for(seconds)` in steady state,
    `lose(rank)` and `run_until_aborted()`, then `replace(rank)`."""

    def __init__(self, cfg: SimConfig, run_dir: Path):
        self.cfg, self.run_dir = cfg, Path(run_dir)
        self.clock = SimClock()
        self.tally = Tally()
        self.server = serve()
        nodes = -(-cfg.world // cfg.ranks_per_node)
        self.stores = [JobStore(client(self.server, self.tally))
                       for _ in range(min(nodes, cfg.connections))]
        self.sink = AbortSink()
        self.generation = 0
        self.ranks = [self._rank(r) for r in range(cfg.world)]
        self.fault_at: Optional[float] = None

    def _store(self, rank: int) -> JobStore:
        return self.stores[rank // self.cfg.ranks_per_node % len(self.stores)]

    def _rank(self, rank: int) -> SimRank:
        sim: Optional[SimRank] = None
        watchdog = Watchdog(self.cfg.watchdog, rank=rank, world=self.cfg.world,
                            store=self._store(rank), run_dir=self.run_dir,
                            events=EventLog(self.run_dir, rank), exit_on_hang=None,
                            guardian=False, clock=self.clock,
                            cpu_clock=lambda: sim.cpu_s if sim is not None else 0.0,
                            node=f"node{rank // self.cfg.ranks_per_node}")
        watchdog.main_thread = self.sink.ident  # its aborts land in the sink
        sim = SimRank(rank, watchdog)
        return sim

    # --- steady state ------------------------------------------------------------

    def start(self) -> None:
        """Every rank enters generation 0 and starts its first step; the
        watchdogs are then calibrated over the warm-up steps."""
        for sim in self.ranks:
            self._store(sim.rank).enter(self.generation, sim.rank)
            sim.watchdog.begin_generation(self.generation)
            self._begin_step(sim)
        self.run_for(self.cfg.warmup_steps * self.cfg.step_s)

    def _begin_step(self, sim: SimRank) -> None:
        sim.section = sim.watchdog.section(SECTION, sim.step)
        sim.section.__enter__()
        sim.section_ends = self.clock.now + self.cfg.step_s

    def _end_step(self, sim: SimRank) -> None:
        assert sim.section is not None
        sim.section.__exit__(None, None, None)
        sim.watchdog.step_done()
        sim.step += 1
        self._begin_step(sim)

    def tick(self) -> None:
        """tick_s of simulated time: each live rank's training thread (its
        timer), then its monitor's poll."""
        self.clock.advance(self.cfg.tick_s)
        for sim in self.ranks:
            if sim.lost or sim.aborted_at is not None:
                continue
            if not sim.blocked:
                sim.cpu_s += self.cfg.tick_s
                if self.clock.now >= sim.section_ends:
                    self._end_step(sim)
            sim.watchdog.poll()
            if sim.watchdog.aborted:
                self._free(sim)

    def _free(self, sim: SimRank) -> None:
        """What an aborted rank's training thread does: it reads the
        generation's cause on the board and leaves the generation. Its exit
        timer is cancelled now, not as it enters the next generation: the
        timer's thread would otherwise stay, and every later abort's stack
        dump (all threads) would grow with the ranks aborted before it."""
        sim.aborted_at = self.clock.now
        AbortBoard(self._store(sim.rank), sim.rank).first_reason(self.generation)
        sim.watchdog.pause()
        sim.watchdog.exit_timer.cancel()

    def run_for(self, seconds: float) -> dict:
        """Tick for `seconds`; the store traffic meanwhile (phase_counts)."""
        before, started = self.tally.snapshot(), self.clock.now
        for _ in range(round(seconds / self.cfg.tick_s)):
            self.tick()
        return phase_counts(before, self.tally.snapshot(), self.clock.now - started)

    # --- a lost rank ---------------------------------------------------------------

    def lose(self, rank: int) -> None:
        """`rank`'s process is gone: its heartbeats stop; the judges wait for
        it in their collective (their training threads use no CPU)."""
        self.fault_at = self.clock.now
        self.ranks[rank].lost = True
        judges = self.cfg.judges if self.cfg.judges is not None else self.cfg.world - 1
        for sim in [s for s in self.ranks if not s.lost][:judges]:
            sim.blocked = True

    def run_until_aborted(self, limit_s: float) -> dict:
        """Tick until every live rank has aborted (or `limit_s`); the
        traffic meanwhile and the latencies from the loss."""
        assert self.fault_at is not None, "lose() a rank first"
        before = self.tally.snapshot()
        live = [s for s in self.ranks if not s.lost]
        while any(s.aborted_at is None for s in live) and self.clock.now - self.fault_at < limit_s:
            self.tick()
        aborted = [s.aborted_at for s in live if s.aborted_at is not None]
        counts = phase_counts(before, self.tally.snapshot(), self.clock.now - self.fault_at)
        record = JobStore(self.server).abort(self.generation)  # uncounted: the simulator's look
        judging = sum(s.blocked and s.watchdog.judges for s in live)
        return {**counts, "aborted": len(aborted), "live": len(live), "judging": judging,
                "culprits": None if record is None else record.get("culprit_ranks"),
                "detected_s": min(aborted) - self.fault_at if aborted else None,
                "all_aborted_s": max(aborted) - self.fault_at if len(aborted) == len(live)
                else None}

    # --- live replacement ------------------------------------------------------------

    def replace(self, lost: int, join_timeout_s: float = 60.0) -> dict:
        """The next generation with a replacement of `lost`: every survivor
        enters it; the lost rank's agent records the replacement
        AGENT_POLL_S after and the replacement enters replacement_join_s
        after that (as when the survivors learn of the loss at once, a peer's
        connection closing); one waiting rank, the first in (a judge of the
        wait), runs the real membership wait, then every rank reads the
        generation's fence token."""
        assert self.fault_at is not None, "lose() a rank first"
        store, before = self._store(0), self.tally.snapshot()
        nxt = self.generation + 1
        for sim in self.ranks:
            if not sim.lost:
                self._store(sim.rank).enter(nxt, sim.rank)
        entered, waiting_from = self.tally.snapshot(), self.clock.now
        recorded = waiting_from + AGENT_POLL_S
        self.clock.at(recorded, lambda: self._store(lost).announce_replacement(os.getpid(), 1))
        self.clock.at(recorded + self.cfg.replacement_join_s, lambda: self._join(lost))
        await_members(store, nxt, self.cfg.world, join_timeout_s, judge=True, clock=self.clock)
        agreed, joined = self.clock.now, recorded + self.cfg.replacement_join_s
        waited = phase_counts(entered, self.tally.snapshot(), agreed - waiting_from)
        waited["all_waiting_per_s"] = all_waiting(waited, self.cfg.world - 1)
        for sim in self.ranks:
            self._store(sim.rank).fence_token(nxt, (lambda: "token") if sim.rank == 0 else None)
        self.generation = nxt
        return {"wait_s": agreed - waiting_from, "after_join_s": agreed - joined,
                "one_waiter": waited,
                "generation_ops": phase_counts(before, self.tally.snapshot(), 0.0)["calls"]}

    def _join(self, lost: int) -> None:
        store = self._store(lost)
        store.enter(store.generation_to_join(lost, 1.0), lost)

    def close(self) -> None:
        for sim in self.ranks:
            sim.watchdog.close()
        self.sink.close()
