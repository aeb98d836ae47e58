"""A worker's life: process groups per generation, in-process restarts, and
the hand-over to the launcher when a process is lost.

In-process restart keeps the process (no re-import, no CUDA re-init): on an
exception, a detected hang or an abort announced by another rank, the
training thread unwinds to here, the old generation's trainer and process
groups are dropped, all ranks meet again under a new store prefix (a stale
address of the previous generation can never be read), rebuild the layout
and reload the newest valid checkpoint. Lost processes (SIGKILL, segfault)
and exhausted in-process restarts go to the TorchElastic agent, which
relaunches the group; its workers resume from the newest checkpoint too.
"""
from __future__ import annotations

import gc
import json
import os
import threading
import traceback
from datetime import timedelta
from pathlib import Path

import psutil
import torch
import torch.distributed as dist

from megaresil.config import ConfigError, RecipeConfig
from megaresil.checkpoint.format import CheckpointError
from megaresil.events import EventLog
from megaresil.parallel.layout import ParallelLayout, backend_for
from megaresil.resilience.faults import FaultInjector
from megaresil.resilience.preemption import PreemptionFlag
from megaresil.resilience.supervision import Supervision
from megaresil.resilience.watchdog import Watchdog, raise_in_thread
from megaresil.checkpoint.location import NoValidCheckpoint, checkpoint_root
from megaresil.train.loop import Trainer

HANG_EXIT_CODE = 86  # a hang without in-process restart: the launcher restarts the group
LOST_PEER = ("Connection closed by peer", "Connection reset by peer", "Broken pipe",
             "connectFullMesh failed")
NOT_RESTARTABLE = (ConfigError, NoValidCheckpoint, CheckpointError, KeyboardInterrupt, SystemExit)


RESTART_COUNTER = "megaresil/restarts"


def launch_store(rank: int, world: int) -> dist.Store:
    """The store of this launch: hosted by the TorchElastic agent when there
    is one (so no rank is a single point of failure), else by rank 0. It
    outlives relaunches of the worker group."""
    host, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    hosted_by_agent = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    return dist.TCPStore(host, port, world, is_master=rank == 0 and not hosted_by_agent,
                         timeout=timedelta(seconds=300), wait_for_workers=False)


def attempt() -> int:
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))


def lost_peer(err: BaseException) -> bool:
    return any(marker in str(err) for marker in LOST_PEER)


class WorkerLife:
    def __init__(self, cfg: RecipeConfig, rank: int, world: int, device: torch.device):
        self.cfg, self.rank, self.world, self.device = cfg, rank, world, device
        self.run_dir = Path(cfg.run.dir)
        self.events = EventLog(self.run_dir, rank)
        self.base_store = launch_store(rank, world)
        # One prefix per launch attempt and one per generation inside it: a
        # stale address of an earlier attempt can never be read.
        self.store = dist.PrefixStore(f"megaresil/attempt_{attempt()}", self.base_store)
        self.preemption = PreemptionFlag().install()
        wd = cfg.resilience.watchdog
        self.watchdog = (Watchdog(wd, rank=rank, world=world, store=self.store,
                                  run_dir=self.run_dir, events=self.events,
                                  exit_on_hang=None if cfg.resilience.in_process else HANG_EXIT_CODE)
                         if wd.enabled else None)
        self.generation = 0

    def run(self) -> str:
        self._note_relaunch()
        try:
            while True:
                outcome = self._one_generation()
                if outcome is not None:
                    return outcome
        finally:
            if self.watchdog is not None:
                self.watchdog.close()

    def _note_relaunch(self) -> None:
        if attempt() > 0 and self.rank == 0:
            self._count_restart("relaunch", f"launcher relaunch {attempt()}")

    def _count_restart(self, kind: str, reason: str) -> None:
        """Rank 0 numbers restarts in the launch store; every rank reads the
        number after the next rendezvous, so all agree on it."""
        generation = self.base_store.add(RESTART_COUNTER, 1)
        self.events.emit("restart", kind=kind, generation=generation, reason=reason[:500])

    def _one_generation(self) -> str | None:
        """Run one generation; its outcome, or None to go again."""
        dist.init_process_group(backend_for(self.device), rank=self.rank, world_size=self.world,
                                store=dist.PrefixStore(f"gen{self.generation}", self.store))
        trainer = None
        try:
            supervision = self._supervision()
            with supervision.section("setup", 0):
                trainer = Trainer(self.cfg, ParallelLayout.from_config(self.cfg.parallel,
                                                                      self.device), supervision)
            return trainer.run()
        except BaseException as err:  # noqa: B902  (HangAbort and DCP's errors are BaseExceptions)
            if self.watchdog is not None:
                self.watchdog.pause()
            raise_in_thread(threading.main_thread().ident, None)  # drop a pending abort
            self._handle_failure(err)
            return None
        finally:
            del trainer
            self._teardown()

    def _supervision(self) -> Supervision:
        generation = self.base_store.add(RESTART_COUNTER, 0)
        if self.watchdog is not None:
            self.watchdog.begin_generation(self.generation)
        faults = FaultInjector(self.cfg.faults, rank=self.rank, run_dir=self.run_dir,
                               checkpoint_root=checkpoint_root(self.cfg), events=self.events)
        return Supervision(self.watchdog, faults, self.preemption, generation)

    def _handle_failure(self, err: BaseException) -> None:
        """Re-raise what the launcher must handle; otherwise record the
        failure and announce the abort so every rank restarts with us."""
        section = self.watchdog.current[0] if self.watchdog is not None else "unknown"
        peer_gone = self._peer_gone(err)
        self.events.emit("worker_error", error=f"{type(err).__name__}: {err}"[:2000],
                         section=section, lost_peer=peer_gone,
                         generation=self.generation, pid=os.getpid(),
                         rss_mb=psutil.Process().memory_info().rss / 2**20)
        restartable = (self.cfg.resilience.in_process and not peer_gone
                       and not isinstance(err, NOT_RESTARTABLE)
                       and self.generation < self.cfg.resilience.max_in_process_restarts)
        if not restartable:
            raise err
        cause = self._abort_cause(err)
        traceback.clear_frames(err.__traceback__)
        self.generation += 1
        if self.rank == 0:
            self._count_restart("in_process", cause)

    def _peer_gone(self, err: BaseException) -> bool:
        """A connection closed under us means a lost peer, unless a peer
        announced this generation's abort first: then it is that (live) peer
        tearing down its process group before we heard of the abort."""
        return lost_peer(err) and not self.store.check([self._abort_key()])

    def _abort_key(self) -> str:
        return f"abort/{self.generation}"

    def _abort_cause(self, err: BaseException) -> str:
        """Announce this rank's failure so every rank aborts the generation,
        unless one already did; returns the first announced cause."""
        key = self._abort_key()
        mine = json.dumps({"reason": "error", "rank": self.rank,
                           "error": f"{type(err).__name__}: {err}"[:500]})
        first = json.loads(self.store.compare_set(key, "", mine))
        if first.get("reason") == "hang":
            return f"hang on rank(s) {first.get('culprit_ranks')} in {first.get('section')}"
        return f"rank {first['rank']}: {first['error']}"

    def _teardown(self) -> None:
        """Drop the generation's process groups and free its memory before the
        next one loads a checkpoint (no growth over repeated restarts)."""
        if dist.is_initialized():
            dist.destroy_process_group()
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


def run_worker(cfg: RecipeConfig, rank: int, world: int, device: torch.device) -> str:
    """Train as this rank until finished, exited at train.exit_at_step, or
    preempted (after saving); failures the launcher must handle propagate."""
    return WorkerLife(cfg, rank, world, device).run()
