"""Hang detection: a monitor thread per rank, heartbeats in the c10d store,
calibrated per-section budgets, culprit analysis, stack dumps, abort.

Why a thread, and what backs it up: the thread sees the training thread's
section and step directly and keeps working while that thread is blocked in
a collective (gloo releases the GIL while it waits). It cannot run while the
training thread holds the GIL in C code, so a stdlib-only side process (the
guardian, started per rank; no torch import, so it costs milliseconds)
watches the thread's tick and, when it stops, dumps the rank's stacks through
faulthandler's C-level signal handler and kills the rank, leaving the rest to
the launcher restart.

Unblocking a collective: a thread blocked in a gloo collective cannot be
freed from outside (destroying the group or shortening its timeout does not
touch an op already waiting). So the budget is given to the collectives up
front: on entering a section, every training process group's timeout is set
to that section's budget, and a collective stuck behind a hung peer raises
by itself. A training thread stuck in Python gets HangAbort raised in it.

Who restarts whom: every rank judges only its own budget. The first rank to
expire declares the hang in the store (compare-and-set, so exactly one
declaration per generation), names the culprits from all ranks' heartbeats,
and sets the generation's abort key; every rank's monitor polls that key and
aborts its own training thread. No rank is special, and the store lives in
the launcher's agent, not in a rank.
"""
from __future__ import annotations

import ctypes
import faulthandler
import json
import mmap
import os
import signal
import struct
import subprocess
import sys
import threading
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Optional

import torch
import torch.distributed as dist

from megaresil.compat import abort_process_groups, process_groups, set_gloo_timeout
from megaresil.config import SECTIONS, WatchdogConfig
from megaresil.events import EventLog

SECTION_ORDER = {name: i for i, name in enumerate(SECTIONS)}


class HangAbort(BaseException):
    """Raised in the training thread when the job aborts a hung generation.

    A BaseException so that `except Exception` blocks in library code do not
    swallow it on the way up to the restart logic."""


def raise_in_thread(thread_id: int, exc_type: Optional[type]) -> None:
    """Schedule `exc_type` in a thread at its next Python bytecode (None clears)."""
    ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(thread_id),
                                               ctypes.py_object(exc_type) if exc_type else None)


def set_collective_timeouts(seconds: float, exempt: set) -> None:
    """Timeout of collectives started from now on, in every gloo group but
    the exempt ones (checkpoint traffic has its own budget)."""
    for group in process_groups():
        if group not in exempt:
            set_gloo_timeout(group, seconds)


def find_culprits(heartbeats: dict[int, Optional[dict]], now: float,
                  stale_after: float) -> list[int]:
    """Ranks that stopped making progress; the rest are waiting for them.

    A rank whose heartbeat is stale (dead, or its monitor starved of the GIL)
    is a culprit; otherwise the ranks furthest behind (step, then section
    within the step) are: the others went on until they needed them."""
    stale = [r for r, hb in heartbeats.items() if hb is None or now - hb["now"] > stale_after]
    if stale:
        return sorted(stale)
    progress = {r: (hb["step"], SECTION_ORDER[hb["section"]]) for r, hb in heartbeats.items()}
    least = min(progress.values())
    return sorted(r for r, p in progress.items() if p == least)


class Watchdog:
    def __init__(self, cfg: WatchdogConfig, *, rank: int, world: int, store: dist.Store,
                 run_dir: Path, events: EventLog, exit_on_hang: Optional[int]):
        self.cfg, self.rank, self.world, self.store = cfg, rank, world, store
        self.hang_dir = Path(run_dir) / "hangs"
        self.events, self.exit_on_hang = events, exit_on_hang
        self.slowest: dict[str, float] = {}
        self.steps_seen = 0
        self.current = ("setup", 0, time.time())
        self.generation: Optional[int] = None  # None: paused between generations
        self.aborted = False
        self.main_thread = threading.main_thread().ident
        self.exempt: set = set()  # process groups whose timeout we leave alone
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._monitor, name="megaresil-watchdog",
                                       daemon=True)
        self.tick = self._start_guardian()
        self.thread.start()

    # --- called by the training thread ------------------------------------------

    @contextmanager
    def section(self, name: str, step: int):
        started = time.time()
        self.current = (name, step, started)
        # Half a second past the budget: the monitor declares the hang (and
        # names the culprits) first, then stuck collectives give up.
        set_collective_timeouts(self.budget(name) + 0.5, self.exempt)
        yield
        if step > 1:  # step 1 carries one-off warm-up costs
            self.slowest[name] = max(self.slowest.get(name, 0.0), time.time() - started)

    def exempt_group(self, group) -> None:
        self.exempt.add(group)

    def step_done(self) -> None:
        self.steps_seen += 1

    def begin_generation(self, generation: int) -> None:
        self.generation, self.aborted = generation, False
        self.current = ("setup", self.current[1], time.time())

    def pause(self) -> None:
        self.generation = None

    def calibration(self) -> dict:
        return {"slowest": dict(self.slowest), "steps_seen": self.steps_seen}

    def restore_calibration(self, saved: dict) -> None:
        """Budgets from a checkpoint, so a restart does not start from zero."""
        for name, seconds in saved.get("slowest", {}).items():
            self.slowest[name] = max(self.slowest.get(name, 0.0), seconds)
        self.steps_seen = max(self.steps_seen, saved.get("steps_seen", 0))

    def budget(self, section: str) -> float:
        if section == "setup":
            return self.cfg.setup_timeout_s
        if section == "checkpoint":
            return self.cfg.checkpoint_timeout_s
        if self.steps_seen < self.cfg.calibration_steps or section not in self.slowest:
            return self.cfg.initial_timeout_s
        return max(self.cfg.floor_s, self.cfg.factor * self.slowest[section])

    def close(self) -> None:
        self.stop.set()
        self.thread.join(timeout=2)
        if self.guardian is not None:
            self.guardian.terminate()

    # --- the monitor thread -------------------------------------------------------

    def _key(self, what: str, rank: Optional[int] = None) -> str:
        return f"{what}/{self.generation}" + (f"/{rank}" if rank is not None else "")

    def _monitor(self) -> None:
        while not self.stop.wait(self.cfg.poll_s):
            self.tick[:8] = struct.pack("d", time.time())
            generation = self.generation
            if generation is None or self.aborted:
                continue
            try:
                self._check(generation)
            except Exception as err:  # the store went away: the job is ending
                if not self.stop.is_set():
                    print(f"megaresil watchdog (rank {self.rank}): {err}", file=sys.stderr)

    def _check(self, generation: int) -> None:
        section, step, started = self.current
        now = time.time()
        self.store.set(self._key("hb", self.rank), json.dumps(
            {"section": section, "step": step, "started": started, "now": now}))
        if self.store.check([self._key("abort")]):
            self._abort(json.loads(self.store.get(self._key("abort"))))
            return
        waited = now - started
        if waited > self.budget(section):
            self._declare(section, step, waited)

    def _heartbeats(self) -> dict[int, Optional[dict]]:
        keys = [self._key("hb", r) for r in range(self.world)]
        present = {r: self.store.check([k]) for r, k in enumerate(keys)}
        return {r: json.loads(self.store.get(keys[r])) if present[r] else None
                for r in range(self.world)}

    def _declare(self, section: str, step: int, waited: float) -> None:
        culprits = find_culprits(self._heartbeats(), time.time(),
                                 stale_after=max(1.0, 5 * self.cfg.poll_s))
        report = {"rank": self.rank, "section": section, "step": step, "waited_s": waited,
                  "budget_s": self.budget(section), "culprit_ranks": culprits,
                  "stack_dump": str(self.hang_dir / f"generation_{self.generation}")}
        won = self.store.compare_set(self._key("hang"), "", json.dumps(report)) == \
            json.dumps(report).encode()
        if won:
            self.events.emit("hang_detected", **{k: v for k, v in report.items() if k != "rank"})
            self.store.set(self._key("abort"), json.dumps({"reason": "hang", **report}))
        self._abort({"reason": "hang", **report})

    def _abort(self, reason: dict) -> None:
        """Free this rank's training thread: dump stacks, make blocked
        collectives time out, and raise HangAbort at its next bytecode."""
        self.aborted = True
        dump_dir = self.hang_dir / f"generation_{self.generation}"
        dump_dir.mkdir(parents=True, exist_ok=True)
        with open(dump_dir / f"rank{self.rank}.txt", "w") as f:
            f.write(f"abort: {json.dumps(reason)}\n")
            faulthandler.dump_traceback(file=f, all_threads=True)
        if self.exit_on_hang is not None:  # no in-process restart: the launcher restarts us
            os._exit(self.exit_on_hang)
        if torch.cuda.is_available():
            abort_process_groups()  # NCCL can abort its communicators
        raise_in_thread(self.main_thread, HangAbort)

    # --- the guardian side process ----------------------------------------------

    def _start_guardian(self) -> mmap.mmap:
        """Start the stdlib-only guardian and register the stack-dump signal."""
        self.hang_dir.mkdir(parents=True, exist_ok=True)
        tick_path = self.hang_dir / f".tick.rank{self.rank}"
        tick_path.write_bytes(struct.pack("d", time.time()))
        tick_file = open(tick_path, "r+b")
        tick = mmap.mmap(tick_file.fileno(), 8)
        self._dump_file = open(self.hang_dir / f"gil_rank{self.rank}.txt", "w")
        faulthandler.register(signal.SIGUSR2, file=self._dump_file, all_threads=True)
        self.guardian = subprocess.Popen(
            [sys.executable, "-m", "megaresil.resilience.guardian", str(os.getpid()),
             str(tick_path), str(self.cfg.gil_timeout_s)], start_new_session=False)
        return tick
