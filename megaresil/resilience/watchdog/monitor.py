"""The Watchdog: this rank's monitor thread, composed of the budgets, the
judgement and the abort beside it; it owns the clock, the store traffic
(resilience/coordination.py's keys) and the generation's state. See the
package docstring and docs/watchdog.md."""
from __future__ import annotations

import json
import os
import sys
import threading
import time
from collections.abc import Callable
from contextlib import contextmanager
from pathlib import Path

import torch
import torch.distributed as dist

from megaresil.clock import Clock, SystemClock
from megaresil.compat import collective_counts
from megaresil.config import WatchdogConfig
from megaresil.events import EventLog
from megaresil.observe.sections import SectionTime
from megaresil.parallel.layout import use_device
from megaresil.resilience.coordination import JobStore
from megaresil.resilience.stragglers import StragglerDetector
from megaresil.resilience.watchdog.abort import (
    ABORT_GRACE_S,
    ExitTimer,
    Guardian,
    HangAbort,
    abort_nccl_groups,
    dump_stacks,
    exit_for_relaunch,
    raise_in_thread,
    set_collective_timeouts,
)
from megaresil.resilience.watchdog.budgets import Budgets, what_differs
from megaresil.resilience.watchdog.judgement import (
    Alarm,
    PeerBeats,
    ProgressMeter,
    judges_hangs,
    store_intervals,
    stuck_or_running,
    unreachable_nodes,
    verdict,
)
from megaresil.resilience.watchdog.probes import (
    machine_kind,
    thread_cpu_clock,
    waiting_in_torch_distributed,
)


class Watchdog:
    """Built idle; `start()` starts the monitor thread (and the guardian).
    `clock` and `cpu_clock` (the training thread's CPU seconds) are the
    real ones unless a test gives fakes, and then drives `poll()` itself."""

    def __init__(self, cfg: WatchdogConfig, *, rank: int, world: int,
                 store: dist.Store | JobStore,
                 run_dir: Path, events: EventLog, exit_on_hang: int | None,
                 workload: dict | None = None, guardian: bool = True,
                 stragglers: StragglerDetector | None = None,
                 device: torch.device = torch.device("cpu"), clock: Clock = SystemClock(),
                 cpu_clock: Callable[[], float] | None = None,
                 peer_bytes: Callable[[], int] | None = None, node: str | None = None):
        self.cfg, self.rank, self.world, self.store = cfg, rank, world, JobStore.of(store)
        self.node = node  # this rank's node, named in heartbeats: a partition names the node
        self.clock = clock
        self.device = device  # the trainer's: the monitor thread aborts NCCL groups on it
        self.hang_dir = Path(run_dir) / "hangs"
        self.events, self.exit_on_hang = events, exit_on_hang
        self.stragglers = stragglers
        self.budgets = Budgets(cfg, {"world": world, "workload": workload,
                                     "machine": machine_kind()})
        self.current = ("setup", 0, clock.monotonic())
        self.generation: int | None = None  # None: paused between generations
        self.leaving: int | None = None  # the generation pause() has yet to publish "left" in
        self.aborted = False
        self.exit_timer = ExitTimer(clock)  # armed by an abort
        main_thread = threading.main_thread().ident
        assert main_thread is not None  # the main thread has always started
        self.main_thread = main_thread
        self.progress = ProgressMeter(cpu_clock or thread_cpu_clock(self.main_thread),
                                      clock.monotonic())
        # Bytes its peer connections move (probes.peer_bytes_counter): a rank
        # waiting on a slow link is not hung. None: not measured.
        self.traffic = (None if peer_bytes is None
                        else ProgressMeter(peer_bytes, clock.monotonic(), min_rate=0.0))
        self.exempt: set = set()  # process groups whose timeout we leave alone
        self.heartbeat_every, self.abort_poll_every = store_intervals(cfg, world)
        self.judges = judges_hangs(rank, world)  # else the abort poll tells it of a hang
        self.beats = 0
        self.next_heartbeat = self.next_abort_poll = 0.0
        self.alarm: Alarm | None = None
        self.peers = PeerBeats(self.heartbeat_every)
        self.lock = threading.Lock()  # the monitor and pause() both write heartbeats
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._monitor, name="megaresil-watchdog",
                                       daemon=True)
        self.with_guardian = guardian
        self.guardian: Guardian | None = None

    def start(self) -> None:
        if self.with_guardian:
            self.guardian = Guardian(self.hang_dir, self.rank, self.cfg.gil_timeout_s)
        self.thread.start()

    # --- called by the training thread ------------------------------------------

    @contextmanager
    def section(self, name: str, step: int):
        started = self.clock.monotonic()
        self.current = (name, step, started)
        set_collective_timeouts(self.slow_limit(name), self.exempt)
        yield
        self.budgets.observe(name, step, self.clock.monotonic() - started)

    def batch_share(self, share: float) -> None:
        """The coming step's global batch over the full one (budgets.py)."""
        self.budgets.batch_share = share

    def exempt_group(self, group) -> None:
        self.exempt.add(group)

    def step_done(self, times: dict[str, SectionTime] | None = None,
                  first_of_generation: bool = False) -> None:
        """A step completed; with its section times, every
        logging.straggler_interval steps the ranks compare them (a collective)."""
        self.budgets.step_done()
        if self.stragglers is not None and times is not None:
            step = self.current[1]
            self.stragglers.step_done(step, times, warm_up=first_of_generation or step == 1)

    def begin_generation(self, generation: int) -> None:
        self.current = ("setup", self.current[1], self.clock.monotonic())
        self.alarm, self.peers, self.next_heartbeat = None, PeerBeats(self.heartbeat_every), 0.0
        self.generation, self.aborted = generation, False
        self.exit_timer.cancel()
        if self.stragglers is not None:
            self.stragglers.restart()

    def pause(self) -> None:
        """Leave the generation: peers stop counting this rank as a culprit,
        and once this returns the monitor raises no abort in the training
        thread (_abort checks the generation under the same lock). A second
        call publishes the "left" a first one interrupted did not."""
        with self.lock:
            if self.generation is not None:
                self.leaving, self.generation = self.generation, None
        if self.leaving is None:
            return
        try:
            self._publish(self.leaving, state="left")
        except Exception as err:  # noqa: BLE001 (no store, no job: nobody is judging)
            print(f"megaresil watchdog (rank {self.rank}): {err}", file=sys.stderr)
        self.leaving = None

    def calibration(self) -> dict:
        return self.budgets.calibration()

    def restore_calibration(self, saved: dict) -> bool:
        """Budgets from a checkpoint, so a restart does not start from zero;
        ignored (False) when measured on another world, workload or machine."""
        restored = self.budgets.restore(saved)
        if not restored and self.rank == 0:
            changed = what_differs(saved.get("measured_on") or {}, self.budgets.measured_on)
            print(f"megaresil watchdog: the checkpoint's budgets were measured on another run "
                  f"shape ({changed}): calibrating again", file=sys.stderr)
        return restored

    def budget(self, section: str) -> float:
        return self.budgets.budget(section)

    def slow_limit(self, section: str) -> float:
        return self.budgets.slow_limit(section)

    def close(self) -> None:
        self.pause()
        self.stop.set()
        self.exit_timer.cancel()
        if self.thread.is_alive():
            self.thread.join(timeout=2)
        if self.guardian is not None:
            self.guardian.stop()

    # --- the monitor thread -------------------------------------------------------

    def _monitor(self) -> None:
        use_device(self.device)
        while not self.clock.wait(self.stop, self.cfg.poll_s):
            self.poll()

    def poll(self) -> None:
        """One round of the monitor: tick the guardian, sample the training
        thread, and judge the section it is in."""
        if self.guardian is not None:
            self.guardian.tick()
        now = self.clock.monotonic()
        self.progress.sample(now)
        if self.traffic is not None:
            self.traffic.sample(now)
        generation = self.generation
        if generation is None:
            return
        if self.aborted:  # the exit timer decides whether the abort freed the thread
            if now >= self.next_heartbeat:
                # Still beating: a rank the abort has not freed yet (blocked in
                # a collective until its time limit) is alive, and ranks waiting
                # for a replacement must not take it for lost.
                self._publish(generation, state="aborting")
            return
        try:
            self._check(generation, now)
        except Exception as err:  # noqa: BLE001 (no store: the job is ending)
            if not self.stop.is_set() and self.generation is not None:
                print(f"megaresil watchdog (rank {self.rank}): {err}", file=sys.stderr)

    def _check(self, generation: int, now: float) -> None:
        """`generation` is the one judged, passed in (not `self.generation`):
        the training thread may leave it meanwhile (pause), and a read of
        generation None would hold the store's client for its timeout, the
        leaving rank's own "left" heartbeat waiting behind it."""
        if now >= self.next_heartbeat:
            self._publish(generation)
        if now >= self.next_abort_poll:
            self.next_abort_poll = now + self.abort_poll_every
            announced = self.store.abort(generation)
            if announced is not None:
                self._abort(generation, announced)
                return
        section, step, started = self.current
        waited = now - started
        if waited <= self.budgets.silence_budget(section) or not self.judges:
            self.alarm = None
            return
        if self.alarm is None or self.alarm.started != started:
            self.alarm = Alarm(section, step, started)
        self._judge(generation, self.alarm, waited, now)

    def _publish(self, generation: int, state: str = "running") -> None:
        now = self.clock.monotonic()
        with self.lock:
            if state != "left" and self.generation != generation:
                return  # the rank left this generation meanwhile: keep its "left"
            self.next_heartbeat = now + self.heartbeat_every
            self.beats += 1
            self.store.publish_heartbeat(generation, self.rank, self._record(state, now))

    def _record(self, state: str, now: float) -> dict:
        """This rank's heartbeat: where it is and whether its thread runs."""
        section, step, _ = self.current
        record = {"state": state, "section": section, "step": step, "beat": self.beats,
                  "stalled_s": round(self.progress.stalled_s(now), 3),
                  "waiting": waiting_in_torch_distributed(self.main_thread),
                  "coll": collective_counts(self.exempt) if dist.is_initialized() else {}}
        if self.traffic is not None:
            record["quiet_s"] = round(self.traffic.stalled_s(now), 3)
        if self.node is not None:
            record.update(node=self.node, at=round(time.time(), 3))
        return record

    # --- judging an alarm -----------------------------------------------------------

    def _judge(self, generation: int, alarm: Alarm, waited: float, now: float) -> None:
        if waited <= self.budget(alarm.section):
            self._watch_for_silence(generation, alarm, waited, now)
            return
        if now >= alarm.next_read:
            alarm.next_read = now + self.heartbeat_every
            self._read_culprits(generation, alarm, now)
        states = [self._culprit_state(r, now, self.budget(alarm.section))
                  for r in alarm.culprits]
        found = verdict(states, waited, self.slow_limit(alarm.section), alarm.suspected)
        if found in ("stuck", "slow_limit"):
            self._declare(generation, alarm, waited, found, now)
        elif found == "suspect":
            alarm.suspected = True
            self._suspect(generation, alarm, waited)

    def _watch_for_silence(self, generation: int, alarm: Alarm, waited: float,
                           now: float) -> None:
        """Between a section's silence budget and its own (Budgets.silence_budget):
        only peers whose heartbeat stopped are a hang, and they are its culprits.
        Every rank's heartbeat is read: whoever is furthest behind is no sign."""
        if now >= alarm.next_read:
            alarm.next_read = now + self.heartbeat_every
            self._heartbeats(generation, range(self.world), now)
        silent = self.peers.gone(now)
        if silent:
            alarm.culprits = sorted(silent)
            self._declare(generation, alarm, waited, "silent", now)

    def _read_culprits(self, generation: int, alarm: Alarm, now: float) -> None:
        """Refresh the culprits' heartbeats; every rank's on the first read,
        or when a culprit has moved on (someone else holds the job now)."""
        if alarm.culprits and alarm.culprits_stayed(self._heartbeats(generation, alarm.culprits,
                                                                     now)):
            return
        alarm.name_culprits(self._heartbeats(generation, range(self.world), now),
                            frozenset(self.peers.gone(now)))

    def _heartbeats(self, generation: int, ranks, now: float) -> dict[int, dict | None]:
        """The ranks' latest heartbeats (this rank's as it is now); notes
        which peers wrote a new one since the last read."""
        beats = self.store.heartbeats(generation, [r for r in ranks if r != self.rank])
        self.peers.note(beats, now)
        if self.rank in ranks:
            beats[self.rank] = self._record("running", now)
        return beats

    def _culprit_state(self, rank: int, now: float, quiet_limit: float) -> str:
        """This rank asks its own meters (no store delay); a peer is judged
        by its heartbeats. No byte for `quiet_limit` (the section's budget)
        is needed besides no CPU: see judgement.stuck_or_running."""
        if rank == self.rank:
            quiet_s = float("inf") if self.traffic is None else self.traffic.stalled_s(now)
            return stuck_or_running(self.progress.stalled_s(now), self.cfg.stall_s, quiet_s,
                                    quiet_limit)
        return self.peers.state(rank, now, self.cfg.stall_s, quiet_limit)

    def _report(self, alarm: Alarm, waited: float, budget: float | None = None) -> dict:
        """`budget`: the one that applied, when not the section's own."""
        budget = self.budget(alarm.section) if budget is None else budget
        return {"rank": self.rank, "section": alarm.section, "step": alarm.step,
                "waited_s": round(waited, 3), "budget_s": round(budget, 3),
                "culprit_ranks": alarm.culprits}

    def _suspect(self, generation: int, alarm: Alarm, waited: float) -> None:
        """One warning per section and step for the whole job."""
        report = self._report(alarm, waited)
        if self.store.claim_suspect(generation, alarm.section, alarm.step, self.rank):
            self.events.emit("hang_suspected", **{k: v for k, v in report.items() if k != "rank"})

    def _declare(self, generation: int, alarm: Alarm, waited: float, why: str,
                 now: float) -> None:
        budget = self.budgets.silence_budget(alarm.section) if why == "silent" else None
        report = {**self._report(alarm, waited, budget), "why": why,
                  "stack_dump": str(self.hang_dir / f"generation_{generation}")}
        unreachable = self._unreachable(generation, now)
        if unreachable:
            report["unreachable"] = unreachable
        if self.store.claim_hang(generation, report):
            self.events.emit("hang_detected", **{k: v for k, v in report.items() if k != "rank"})
            self.store.set_abort(generation, {"reason": "hang", **report})
        self._abort(generation, {"reason": "hang", **report})

    def _unreachable(self, generation: int, now: float) -> list[dict]:
        """Nodes whose ranks all went silent, from every rank's heartbeat
        read afresh (the alarm re-read only its culprits')."""
        if self.node is None:
            return []
        self._heartbeats(generation, range(self.world), now)
        return unreachable_nodes(self.peers, now, self.node)

    # --- aborting -------------------------------------------------------------------

    def _dump_path(self, generation: int) -> Path:
        return self.hang_dir / f"generation_{generation}" / f"rank{self.rank}.txt"

    def _abort(self, generation: int, reason: dict) -> None:
        """Free this rank's training thread: dump stacks, abort NCCL
        communicators, and raise HangAbort at its next bytecode (a gloo op
        already blocked returns at its timeout)."""
        self.aborted = True
        dump_stacks(self._dump_path(generation), f"abort: {json.dumps(reason)}", "w")
        if self.exit_on_hang is not None:  # no in-process restart: the launcher restarts us
            os._exit(self.exit_on_hang)
        self.exit_timer.arm(self.budgets.abort_limit(self.current[0]) + ABORT_GRACE_S,
                            lambda: self._exit_if_not_freed(generation))
        abort_nccl_groups()
        with self.lock:
            # The thread may have left the generation meanwhile, failing on its
            # own: HangAbort would then land in its failure handling.
            if self.generation == generation:
                raise_in_thread(self.main_thread, HangAbort)

    def _exit_if_not_freed(self, generation: int) -> None:
        """Exit for a relaunch if the training thread still has not left the
        aborted generation (see abort.exit_for_relaunch)."""
        if self.aborted and self.generation == generation:
            exit_for_relaunch(self.events, self._dump_path(generation), section=self.current[0],
                              generation=generation)
