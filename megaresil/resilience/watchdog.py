"""Hang detection: a monitor thread per rank, calibrated per-section budgets,
slow told apart from stuck by the training thread's CPU time, culprits named
from heartbeats in the c10d store, stack dumps, abort.

Slow or stuck. A budget passing proves nothing: a loaded machine, a bigger
layout or a slow peer all make sections long. What tells a stuck rank from a
slow one is whether its training thread still runs: the monitor samples the
thread's CPU clock (`pthread_getcpuclockid` of the main thread) every poll_s.
A thread blocked in a gloo collective, sleeping or waiting on a lock uses
~0.05 ms of CPU a second; a computing one uses far more than
PROGRESS_CPU_SHARE (2 %) of the wall time even when 30 runnable threads
share 2 cores (the scheduler gives each a slice every ~50 ms). CPU time needs
no cooperation from the code being watched (no counters inside long ops) and
is cheap to read (no stack walk); a stack that changes would also catch a
thread spinning in place, which the hard limit below catches instead.
Limits: a slow fault that *sleeps* looks stuck (a real slow rank computes);
on a GPU a host thread spinning in a CUDA synchronize looks busy, so a hung
kernel is caught by NCCL's abort path or the hard limit, not the CPU test.

The decision, when a rank's section passes its budget: find the culprits
(`find_culprits`): ranks gone silent, else the live ranks furthest behind
(step, then section), ties broken by the per-group collective counters (the
rank whose peers started collectives it has not joined), then by where the
training thread is (a rank waiting inside torch.distributed, e.g. creating a
process group, waits for a peer that is not). If every culprit
has made no progress for stall_s (its own monitor says so in its heartbeat;
a rank that is its own culprit asks its local meter, with no store delay;
a rank whose heartbeat stops for 2.5 heartbeat intervals is gone), the hang
is declared (`hang_detected`) and the generation aborted. If a culprit is
still computing, one `hang_suspected` event is written for the job (a
compare-and-set key per section and step) and training goes on, up to the
hard limit `slow_limit_factor` x budget, past which even a computing culprit
is declared hung (an endless loop). A real hang is declared one poll after
max(budget, stall_s) when the hung rank passes its own budget (the usual
case: it stopped first), plus at most one heartbeat interval while a peer's
heartbeat still shows an older place (1.03 s for a 1 s budget in a 1-rank
run); a hung rank whose own budget is longer is judged by its peers from
its heartbeats, within two heartbeat intervals of their budget.

Unblocking a collective: a thread blocked in a gloo collective cannot be
freed from outside (design.md §4), so its timeout is set on entering each
section, for collectives started afterwards. It is the hard limit, not the
budget: a rank waiting in a collective for a slow but computing peer must
not time out before the watchdog would declare that peer hung. The price is
recovery time for a hang *inside* a collective: the ranks blocked in it are
released only when their op's timeout passes, up to slow_limit_factor x
budget after it started (5 s for a 1 s budget) instead of half a second
after the declaration. A hang outside collectives (HangAbort is raised in
the thread) and any hang on NCCL are released at once: on a declared hang
the NCCL communicators are aborted, which returns their blocked ops. For
that the worker needs TORCH_NCCL_ASYNC_ERROR_HANDLING=0 (NCCL_WORKER_ENV;
TorchElastic sets 1, under which NCCL's own watchdog kills the process on a
timeout) when restarting in process. A thread blocked in C code that
released the GIL (a native call that never returns; a synchronize on a CUDA
kernel that never ends, which NCCL's abort does not end either) never sees
HangAbort: if it has not left the generation by the hard limit plus
ABORT_GRACE_S after the abort, a timer armed before the abort (the abort
itself may never return) writes a worker_error and exits the process with
HANG_EXIT_CODE, and the launcher relaunches the group.

Store load. Heartbeats are local until they matter: the monitor samples and
checks budgets every poll_s without touching the store; it writes its
heartbeat every heartbeat_s (0.5 s) and reads the abort key every
abort_poll_s (1 s): 3 ops/s per rank with the defaults (the previous design
made 20: a write and a read every 0.1 s). Both intervals grow with the world
so that all ranks together stay under store_ops_limit (2,000 ops/s by
default): up to 666 ranks a rank costs 3 ops/s; at 1,000 ranks the
intervals become 0.75 s and 1.5 s (2 ops/s per rank, 2,000 ops/s for the
store), and a peer's silence is noticed after 2.5 heartbeat intervals.
Reading every heartbeat (one op per rank) happens only when a budget
passed: once per alarm, then only the culprits' keys once per heartbeat
interval until the alarm clears or a culprit moves (one full read again).

Calibration: budgets are factor x the slowest observed duration of each
section; they are saved in checkpoints with what they were measured on
(world size, the workload the caller describes: layout, batch sizes; the
kind of machine: CPU model, usable cores, GPU). A calibration measured on
anything else is ignored on restore: 8 ranks' budgets say nothing of 1
rank's step time. The host name is deliberately not part of it, so a
relaunch onto other nodes of the same kind keeps its budgets.

A training thread holding the GIL in C code starves the monitor: the
guardian side process (guardian.py) catches that. Every duration here is on
the monotonic clock; wall-clock time appears only in events.
"""
from __future__ import annotations

import ctypes
import faulthandler
import json
import mmap
import os
import platform
import signal
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist

from megaresil.compat import (abort_process_groups, collective_counts, has_nccl_groups,
                              process_groups, set_gloo_timeout)
from megaresil.config import SECTIONS, WatchdogConfig
from megaresil.events import EventLog
from megaresil.observe.sections import SectionTime
from megaresil.parallel.layout import use_device
from megaresil.resilience.stragglers import StragglerDetector
from megaresil.safe_files import open_nofollow, own_dir, write_atomic

SECTION_ORDER = {name: i for i, name in enumerate(SECTIONS)}
PROGRESS_CPU_SHARE = 0.02  # CPU seconds per wall second below which a thread is not running
STALE_HEARTBEATS = 2.5  # heartbeat intervals without a new beat: the rank's monitor is gone
NCCL_WORKER_ENV = {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "0"}  # we abort NCCL ourselves
HANG_EXIT_CODE = 86  # a hang this process cannot recover from: the launcher restarts the group
# After HangAbort, how long past the hard limit the training thread may take to
# leave the generation (the limit covers a gloo op that returns at its timeout).
ABORT_GRACE_S = 5.0
OPS_PER_HEARTBEAT = 1  # a set
OPS_PER_ABORT_POLL = 1  # a check
TORCH_DISTRIBUTED = os.path.dirname(dist.__file__)


class HangAbort(BaseException):
    """Raised in the training thread when the job aborts a hung generation.

    A BaseException so that `except Exception` blocks in library code do not
    swallow it on the way up to the restart logic."""


def raise_in_thread(thread_id: int, exc_type: type | None) -> bool:
    """Schedule `exc_type` in a thread at its next Python bytecode (None
    clears a pending one). False when no such thread exists (it ended)."""
    set_async_exc = ctypes.pythonapi.PyThreadState_SetAsyncExc
    changed = set_async_exc(ctypes.c_ulong(thread_id),
                            ctypes.py_object(exc_type) if exc_type else None)
    if changed > 1:  # the id matched several thread states: undo, touch none
        set_async_exc(ctypes.c_ulong(thread_id), None)
        raise SystemError(f"raise_in_thread: thread id {thread_id} matched {changed} "
                          "thread states; nothing was raised")
    return changed == 1


def set_collective_timeouts(seconds: float, exempt: set) -> None:
    """Timeout of collectives started from now on, in every gloo group but
    the exempt ones (checkpoint traffic has its own budget)."""
    for group in process_groups():
        if group not in exempt:
            set_gloo_timeout(group, seconds)


def thread_cpu_clock(thread_id: int) -> Callable[[], float]:
    """CPU seconds used by one thread of this process (process CPU time where
    the platform has no per-thread clock)."""
    try:
        clock = time.pthread_getcpuclockid(thread_id)
        time.clock_gettime(clock)
    except (AttributeError, OSError):
        return time.process_time
    return lambda: time.clock_gettime(clock)


def machine_kind() -> dict:
    """What a section's duration depends on besides the workload."""
    cpu_model = platform.processor()
    try:
        cpu_model = next(line.split(":", 1)[1].strip() for line in
                         Path("/proc/cpuinfo").read_text().splitlines()
                         if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return {"cpu": cpu_model, "cores": len(os.sched_getaffinity(0)),
            "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None}


class ProgressMeter:
    """Whether a thread is running: the CPU time it gains between samples."""

    def __init__(self, read_cpu: Callable[[], float], now: float):
        self.read_cpu = read_cpu
        self.cpu, self.sampled, self.last_progress = read_cpu(), now, now

    def sample(self, now: float) -> None:
        cpu = self.read_cpu()
        if cpu - self.cpu >= PROGRESS_CPU_SHARE * (now - self.sampled):
            self.last_progress = now
        self.cpu, self.sampled = cpu, now

    def stalled_s(self, now: float) -> float:
        """Seconds since the thread last used a fair share of CPU."""
        return now - self.last_progress


def position(hb: dict) -> tuple[int, int]:
    return hb["step"], SECTION_ORDER[hb["section"]]


def find_culprits(heartbeats: dict[int, dict | None], gone: frozenset = frozenset()) -> list[int]:
    """Ranks that stopped the job; the rest are waiting for them.

    `heartbeats` maps each rank to its latest heartbeat (None: it never wrote
    one this generation), `gone` names ranks whose heartbeat stopped. Ranks
    that left the generation (their own error, a restart) are not culprits.
    Silent ranks are culprits; otherwise the live ranks furthest behind
    (step, then section), ties broken by `blamed_in_collectives`."""
    silent = {r for r, hb in heartbeats.items() if hb is None} | set(gone)
    if silent:
        return sorted(silent)
    live = {r: hb for r, hb in heartbeats.items() if hb["state"] == "running"}
    if not live:
        return []
    least = min(position(hb) for hb in live.values())
    behind = [r for r, hb in live.items() if position(hb) == least]
    return blamed_in_collectives(behind, live) if len(behind) > 1 else behind


def blamed_in_collectives(candidates: list[int], heartbeats: dict[int, dict]) -> list[int]:
    """Of ranks at the same place, the ones the others wait for.

    Every group numbers its collectives in the same order on all members, so
    counts say who has started a collective that whom has not joined. First:
    a rank alone in a collective of a group of three or more, that no other
    member has started, called a collective nobody else calls (the others
    are all blocked elsewhere, waiting for it). Otherwise: the ranks most
    peers wait for (peers ahead of them on a shared group). Two-rank groups
    cannot tell the caller of an unmatched collective from a rank waiting
    for its partner, hence the first rule needs three."""
    unmatched = [r for r in candidates if alone_in_a_collective(r, heartbeats)]
    if unmatched:
        return sorted(unmatched)

    def waiters(rank: int) -> set[int]:
        mine = heartbeats[rank].get("coll", {})
        return {peer for peer, hb in heartbeats.items() if peer != rank and any(
            count > mine[name] for name, count in hb.get("coll", {}).items() if name in mine)}
    blame = {r: len(waiters(r)) for r in candidates}
    most = max(blame.values())
    blamed = [r for r in candidates if blame[r] == most]
    # Still tied (no collective tells them apart, e.g. a group being created):
    # the ranks waiting inside torch.distributed wait for those that are not.
    not_waiting = [r for r in blamed if not heartbeats[r].get("waiting")]
    return sorted(not_waiting or blamed)


def waiting_in_torch_distributed(thread_id: int) -> bool:
    """Whether the thread's innermost Python frame is torch.distributed's: it
    waits there on its peers (a collective, a group's creation, the store)."""
    frame = sys._current_frames().get(thread_id)
    return frame is not None and TORCH_DISTRIBUTED in frame.f_code.co_filename


def alone_in_a_collective(rank: int, heartbeats: dict[int, dict]) -> bool:
    for name, count in heartbeats[rank].get("coll", {}).items():
        others = [hb["coll"][name] for peer, hb in heartbeats.items()
                  if peer != rank and name in hb.get("coll", {})]
        if len(others) >= 2 and all(count > other for other in others):
            return True
    return False


@dataclass
class Alarm:
    """One section that passed its budget, while it lasts."""
    section: str
    step: int
    started: float
    culprits: list[int] = field(default_factory=list)
    positions: dict = field(default_factory=dict)  # culprit -> (step, section) at the full read
    next_read: float = 0.0
    suspected: bool = False


@dataclass
class Beat:
    """The latest distinct heartbeat seen from a peer, and when it was first seen."""
    record: dict
    seen: float
    fresh: bool  # written after an earlier read: at most one read interval old


class Watchdog:
    def __init__(self, cfg: WatchdogConfig, *, rank: int, world: int, store: dist.Store,
                 run_dir: Path, events: EventLog, exit_on_hang: int | None,
                 workload: dict | None = None, guardian: bool = True,
                 stragglers: StragglerDetector | None = None,
                 device: torch.device = torch.device("cpu")):
        self.cfg, self.rank, self.world, self.store = cfg, rank, world, store
        self.device = device  # the trainer's: the monitor thread aborts NCCL groups on it
        self.hang_dir = Path(run_dir) / "hangs"
        self.events, self.exit_on_hang = events, exit_on_hang
        self.stragglers = stragglers
        self.slowest: dict[str, float] = {}
        self.steps_seen = 0
        self.measured_on = {"world": world, "workload": workload, "machine": machine_kind()}
        self.current = ("setup", 0, time.monotonic())
        self.generation: int | None = None  # None: paused between generations
        self.aborted = False
        self.exit_timer: threading.Timer | None = None  # armed by an abort
        self.main_thread = threading.main_thread().ident
        self.progress = ProgressMeter(thread_cpu_clock(self.main_thread), time.monotonic())
        self.exempt: set = set()  # process groups whose timeout we leave alone
        scale = max(1.0, world * (OPS_PER_HEARTBEAT / cfg.heartbeat_s + OPS_PER_ABORT_POLL
                                  / cfg.abort_poll_s) / cfg.store_ops_limit)
        self.heartbeat_every, self.abort_poll_every = cfg.heartbeat_s * scale, cfg.abort_poll_s * scale
        self.beats = 0
        self.next_heartbeat = self.next_abort_poll = 0.0
        self.alarm: Alarm | None = None
        self.peers: dict[int, Beat] = {}
        self.lock = threading.Lock()  # the monitor and pause() both write heartbeats
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._monitor, name="megaresil-watchdog",
                                       daemon=True)
        self.guardian = None
        self.tick = self._start_guardian() if guardian else None
        self.thread.start()

    # --- called by the training thread ------------------------------------------

    @contextmanager
    def section(self, name: str, step: int):
        started = time.monotonic()
        self.current = (name, step, started)
        set_collective_timeouts(self.slow_limit(name), self.exempt)
        yield
        if step > 1:  # step 1 carries one-off warm-up costs
            self.slowest[name] = max(self.slowest.get(name, 0.0), time.monotonic() - started)

    def exempt_group(self, group) -> None:
        self.exempt.add(group)

    def step_done(self, times: dict[str, SectionTime] | None = None,
                  first_of_generation: bool = False) -> None:
        """A step completed; with its section times, every
        logging.straggler_interval steps the ranks compare them (a collective)."""
        self.steps_seen += 1
        if self.stragglers is not None and times is not None:
            step = self.current[1]
            self.stragglers.step_done(step, times, warm_up=first_of_generation or step == 1)

    def begin_generation(self, generation: int) -> None:
        self.current = ("setup", self.current[1], time.monotonic())
        self.alarm, self.peers, self.next_heartbeat = None, {}, 0.0
        self.generation, self.aborted = generation, False
        if self.exit_timer is not None:
            self.exit_timer.cancel()
        if self.stragglers is not None:
            self.stragglers.restart()

    def pause(self) -> None:
        """Leave the generation: peers stop counting this rank as a culprit."""
        with self.lock:
            generation, self.generation = self.generation, None
        if generation is None:
            return
        try:
            self._publish(generation, state="left")
        except Exception as err:  # the store is gone: so is the job, nobody is judging
            print(f"megaresil watchdog (rank {self.rank}): {err}", file=sys.stderr)

    def calibration(self) -> dict:
        return {"slowest": dict(self.slowest), "steps_seen": self.steps_seen,
                "measured_on": self.measured_on}

    def restore_calibration(self, saved: dict) -> bool:
        """Budgets from a checkpoint, so a restart does not start from zero;
        ignored (False) when measured on another world, workload or machine."""
        if saved.get("measured_on") != self.measured_on:
            if self.rank == 0:
                print(f"megaresil watchdog: the checkpoint's budgets were measured on "
                      f"{saved.get('measured_on')}, this run is {self.measured_on}: "
                      "calibrating again", file=sys.stderr)
            return False
        for name, seconds in saved.get("slowest", {}).items():
            self.slowest[name] = max(self.slowest.get(name, 0.0), seconds)
        self.steps_seen = max(self.steps_seen, saved.get("steps_seen", 0))
        return True

    def budget(self, section: str) -> float:
        if section == "setup":
            return self.cfg.setup_timeout_s
        if section == "checkpoint":
            return self.cfg.checkpoint_timeout_s
        if self.steps_seen < self.cfg.calibration_steps or section not in self.slowest:
            return self.cfg.initial_timeout_s
        return max(self.cfg.floor_s, self.cfg.factor * self.slowest[section])

    def slow_limit(self, section: str) -> float:
        """Past this even a computing culprit is hung; the collective timeout."""
        return self.cfg.slow_limit_factor * self.budget(section)

    def close(self) -> None:
        self.pause()
        self.stop.set()
        self.thread.join(timeout=2)
        if self.guardian is not None:
            self.guardian.terminate()

    # --- the monitor thread -------------------------------------------------------

    def _key(self, what: str, rank: int | None = None,
             generation: int | None = None) -> str:
        generation = self.generation if generation is None else generation
        return f"{what}/{generation}" + (f"/{rank}" if rank is not None else "")

    def _monitor(self) -> None:
        use_device(self.device)
        while not self.stop.wait(self.cfg.poll_s):
            if self.tick is not None:
                self.tick[:8] = struct.pack("d", time.monotonic())
            now = time.monotonic()
            self.progress.sample(now)
            generation = self.generation
            if generation is None:
                continue
            if self.aborted:  # the exit timer decides whether the abort freed the thread
                continue
            try:
                self._check(generation, now)
            except Exception as err:  # the store went away: the job is ending
                if not self.stop.is_set() and self.generation is not None:
                    print(f"megaresil watchdog (rank {self.rank}): {err}", file=sys.stderr)

    def _check(self, generation: int, now: float) -> None:
        if now >= self.next_heartbeat:
            self._publish(generation)
        if now >= self.next_abort_poll:
            self.next_abort_poll = now + self.abort_poll_every
            if self.store.check([self._key("abort")]):
                self._abort(json.loads(self.store.get(self._key("abort"))))
                return
        section, step, started = self.current
        waited = now - started
        if waited <= self.budget(section):
            self.alarm = None
            return
        if self.alarm is None or self.alarm.started != started:
            self.alarm = Alarm(section, step, started)
        self._judge(self.alarm, waited, now)

    def _publish(self, generation: int, state: str = "running") -> None:
        now = time.monotonic()
        with self.lock:
            if state == "running" and self.generation != generation:
                return  # the rank left this generation meanwhile: keep its "left"
            self.next_heartbeat = now + self.heartbeat_every
            self.beats += 1
            self.store.set(self._key("hb", self.rank, generation),
                           json.dumps(self._record(state, now)))

    def _record(self, state: str, now: float) -> dict:
        """This rank's heartbeat: where it is and whether its thread runs."""
        section, step, _ = self.current
        return {"state": state, "section": section, "step": step, "beat": self.beats,
                "stalled_s": round(self.progress.stalled_s(now), 3),
                "waiting": waiting_in_torch_distributed(self.main_thread),
                "coll": collective_counts(self.exempt) if dist.is_initialized() else {}}

    # --- judging an alarm -----------------------------------------------------------

    def _judge(self, alarm: Alarm, waited: float, now: float) -> None:
        if now >= alarm.next_read:
            alarm.next_read = now + self.heartbeat_every
            self._read_culprits(alarm, now)
        if not alarm.culprits:
            return
        states = [self._culprit_state(r, now) for r in alarm.culprits]
        if all(state == "stuck" for state in states):
            self._declare(alarm, waited, "stuck")
        elif waited > self.slow_limit(alarm.section):
            self._declare(alarm, waited, "slow_limit")
        elif "running" in states and not alarm.suspected:
            alarm.suspected = True
            self._suspect(alarm, waited)

    def _read_culprits(self, alarm: Alarm, now: float) -> None:
        """Refresh the culprits' heartbeats; every rank's on the first read,
        or when a culprit has moved on (someone else holds the job now)."""
        if alarm.culprits:
            beats = self._heartbeats(alarm.culprits, now)
            if all(beats[r] is None or position(beats[r]) == alarm.positions.get(r)
                   for r in alarm.culprits):
                return
        beats = self._heartbeats(range(self.world), now)
        alarm.culprits = find_culprits(beats, frozenset(self._gone(now)))
        alarm.positions = {r: position(beats[r]) for r in alarm.culprits if beats[r] is not None}

    def _heartbeats(self, ranks, now: float) -> dict[int, dict | None]:
        """The ranks' latest heartbeats (this rank's as it is now); notes
        which peers wrote a new one since the last read."""
        keys = {r: self._key("hb", r) for r in ranks if r != self.rank}
        if self.store.check(list(keys.values())):
            values = self.store.multi_get(list(keys.values()))
            beats = {r: json.loads(v) for r, v in zip(keys, values)}
        else:  # someone never wrote one: ask key by key
            beats = {r: json.loads(self.store.get(k)) if self.store.check([k]) else None
                     for r, k in keys.items()}
        for r, hb in beats.items():
            known = self.peers.get(r)
            if hb is not None and (known is None or known.record["beat"] != hb["beat"]):
                self.peers[r] = Beat(hb, now, fresh=known is not None)
        if self.rank in ranks:
            beats[self.rank] = self._record("running", now)
        return beats

    def _gone(self, now: float) -> list[int]:
        """Peers whose heartbeat stopped changing (process killed or frozen)."""
        return [r for r, beat in self.peers.items() if beat.record["state"] == "running"
                and now - beat.seen > STALE_HEARTBEATS * self.heartbeat_every]

    def _culprit_state(self, rank: int, now: float) -> str:
        """stuck, running, or unknown (no heartbeat written since the alarm
        began yet). This rank asks its own meter; a peer is judged by a
        heartbeat it wrote since the previous read, or by its silence."""
        if rank == self.rank:
            return "stuck" if self.progress.stalled_s(now) >= self.cfg.stall_s else "running"
        beat = self.peers.get(rank)
        if beat is None or rank in self._gone(now):
            return "stuck"
        if not beat.fresh:
            return "unknown"
        return "stuck" if beat.record["stalled_s"] >= self.cfg.stall_s else "running"

    def _report(self, alarm: Alarm, waited: float) -> dict:
        return {"rank": self.rank, "section": alarm.section, "step": alarm.step,
                "waited_s": round(waited, 3), "budget_s": round(self.budget(alarm.section), 3),
                "culprit_ranks": alarm.culprits}

    def _suspect(self, alarm: Alarm, waited: float) -> None:
        """One warning per section and step for the whole job."""
        report = self._report(alarm, waited)
        key = self._key(f"suspect/{alarm.section}/{alarm.step}")
        if self.store.compare_set(key, "", str(self.rank)) == str(self.rank).encode():
            self.events.emit("hang_suspected", **{k: v for k, v in report.items() if k != "rank"})

    def _declare(self, alarm: Alarm, waited: float, why: str) -> None:
        report = {**self._report(alarm, waited), "why": why,
                  "stack_dump": str(self.hang_dir / f"generation_{self.generation}")}
        mine = json.dumps(report)
        if self.store.compare_set(self._key("hang"), "", mine) == mine.encode():
            self.events.emit("hang_detected", **{k: v for k, v in report.items() if k != "rank"})
            self.store.set(self._key("abort"), json.dumps({"reason": "hang", **report}))
        self._abort({"reason": "hang", **report})

    def _abort(self, reason: dict) -> None:
        """Free this rank's training thread: dump stacks, abort NCCL
        communicators, and raise HangAbort at its next bytecode (a gloo op
        already blocked returns at its timeout)."""
        self.aborted = True
        self._dump_stacks(f"abort: {json.dumps(reason)}", "w")
        if self.exit_on_hang is not None:  # no in-process restart: the launcher restarts us
            os._exit(self.exit_on_hang)
        # Armed before the NCCL abort, on a thread of its own: ProcessGroupNCCL's
        # abort runs here, on the monitor thread, and can itself block for ever
        # (a teardown queued behind a kernel that never ends).
        self._arm_exit_timer(self.slow_limit(self.current[0]) + ABORT_GRACE_S)
        if dist.is_initialized() and has_nccl_groups():
            abort_process_groups()
        raise_in_thread(self.main_thread, HangAbort)

    def _arm_exit_timer(self, seconds: float) -> None:
        self.exit_timer = threading.Timer(seconds, self._exit_if_not_freed,
                                          args=(self.generation,))
        self.exit_timer.daemon = True
        self.exit_timer.start()

    def _exit_if_not_freed(self, generation: int | None) -> None:
        """The training thread was told to abort and still has not left the
        generation: it is blocked where no exception reaches it, in C code
        that released the GIL (a native call that never returns, a CUDA
        synchronize on a kernel that never ends; NCCL's abort does not free
        those), or the abort itself never returned. Only a new process frees
        it: exit, and the launcher restarts the worker group."""
        if not (self.aborted and self.generation == generation):
            return
        # The incident line, and what the relaunch names as its cause (restart.last_failure).
        self.events.emit("worker_error", error="not freed by the hang abort (blocked in native "
                         "code or on the device): exiting for a relaunch",
                         section=self.current[0], lost_peer=False, fatal=False,
                         generation=self.generation, pid=os.getpid())
        self._dump_stacks("not freed by the abort: exiting", "a")
        os._exit(HANG_EXIT_CODE)

    def _dump_stacks(self, headline: str, mode: str) -> None:
        """`headline` and every thread's stack into this rank's hang dump."""
        dump_dir = self.hang_dir / f"generation_{self.generation}"
        own_dir(dump_dir)
        with open_nofollow(dump_dir / f"rank{self.rank}.txt", mode) as f:
            f.write(headline + "\n")
            faulthandler.dump_traceback(file=f, all_threads=True)

    # --- the guardian side process ----------------------------------------------

    def _start_guardian(self) -> mmap.mmap:
        """Start the stdlib-only guardian and register the stack-dump signal."""
        own_dir(self.hang_dir)
        tick_path = self.hang_dir / f".tick.rank{self.rank}"
        write_atomic(tick_path, struct.pack("d", time.monotonic()))
        tick_file = open(tick_path, "r+b")
        tick = mmap.mmap(tick_file.fileno(), 8)
        self._dump_file = open_nofollow(self.hang_dir / f"gil_rank{self.rank}.txt", "w")
        faulthandler.register(signal.SIGUSR2, file=self._dump_file, all_threads=True)
        self.guardian = subprocess.Popen(
            [sys.executable, "-m", "megaresil.resilience.guardian", str(os.getpid()),
             str(tick_path), str(self.cfg.gil_timeout_s)], start_new_session=False)
        return tick

