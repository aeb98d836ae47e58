"""A worker's life: process groups per generation, in-process restarts, and
the hand-over to the launcher when a process is lost.

What is restarted is *a job* (`Job`), whatever `make_job` builds for one
generation: this module knows nothing of training. Each generation meets
under a store prefix of its own; restarts are bounded by failures in a row
without progress and back off exponentially; restart numbers come from the
run directory's records, which outlive any node's store.
docs/fault-tolerance.md ("What is detected and what happens", "Restarts")
says it for users."""
from __future__ import annotations

import gc
import os
import socket
import threading
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional, Protocol

import psutil
import torch
import torch.distributed as dist

from megaresil.checkpoint.local.replication import ranks_per_node
from megaresil.checkpoint.local.store import node_dir
from megaresil.checkpoint.paths import RunPaths
from megaresil.compat import abort_process_groups, has_nccl_groups
from megaresil.config import RecipeConfig
from megaresil.errors import MegaresilError, is_fatal, restartable
from megaresil.events import EventLog, read_metrics
from megaresil.fencing import Fence, Fenced, new_token, set_fence
from megaresil.observe.startup import StartupPhases
from megaresil.parallel.layout import backend_for, use_device
from megaresil.resilience.abort_board import AbortBoard
from megaresil.resilience.coordination import JobStore, launch_store, own_connection
from megaresil.resilience.failure_policy import Action, Failure, decide
from megaresil.resilience.faults import FaultInjector
from megaresil.resilience.preemption import PreemptionFlag
from megaresil.resilience.records import (
    current_generation,
    last_failure,
    newest_step,
    next_generation,
    relaunches_without_progress,
)
from megaresil.resilience.replacement import await_members, judges_the_wait
from megaresil.resilience.stragglers import StragglerDetector
from megaresil.resilience.supervision import Supervision
from megaresil.resilience.watchdog.abort import HANG_EXIT_CODE, HangAbort, raise_in_thread
from megaresil.resilience.watchdog.monitor import Watchdog
from megaresil.resilience.watchdog.probes import NodeTraffic, node_traffic_path, peer_bytes_counter
from megaresil.run_identity import run_id
from megaresil.worker_env import WorkerEnv

MAX_BACKOFF_S = 30.0


class Job(Protocol):
    """One generation's work: `run` returns how it ended ("finished",
    "exited", "preempted"); `close` releases what would outlive it;
    `hand_over` returns its state for the next generation (after a lost
    peer, with live replacement), or None when it has none consistent."""

    def run(self) -> str: ...

    def close(self) -> None: ...

    def hand_over(self) -> Optional[object]: ...


JobFactory = Callable[[Supervision], Job]


def node_name(env: WorkerEnv) -> str:
    """This rank's node as reports name it: its node rank and host."""
    return f"{env.node_rank} on {socket.gethostname()}"


def backoff_s(consecutive: int, base: float) -> float:
    """Wait before the `consecutive`-th restart in a row without progress:
    none for the first, then base, 2*base, ... capped."""
    return 0.0 if consecutive <= 1 else min(MAX_BACKOFF_S, base * 2 ** (consecutive - 2))


def local_node_dir(cfg: RecipeConfig, env: WorkerEnv) -> Optional[Path]:
    """This rank's node directory of the local tier (None when it is off)."""
    local = cfg.checkpoint.local
    if not local.enabled:
        return None
    per_node = ranks_per_node(local.ranks_per_node, env.world, env.local_world)
    return node_dir(RunPaths.of(cfg).local_run_dir(run_id(Path(cfg.run.dir))),
                    env.rank // per_node)


class JobFailed(MegaresilError):
    """The job stopped for a reason a restart cannot cure (announced on
    every rank; `run_failed` in events.jsonl says why). Under megaresil's
    own launcher workers then exit 0, so the agent does not relaunch them
    only to fail again; the launcher turns it into exit status 1."""


def workload(cfg: RecipeConfig) -> dict:
    """What a step's section durations depend on, besides the machine: the
    watchdog keeps a calibration only for the same workload."""
    p, t = cfg.parallel, cfg.train
    return {"tp": p.tp, "pp": p.pp, "dp": p.dp, "vpp": p.vpp, "seq_len": cfg.data.seq_len,
            "micro_batch_size": t.micro_batch_size, "global_batch_size": t.global_batch_size}


@dataclass
class RestartPolicy:
    """How many restarts in a row without progress, and how long to wait."""
    max_consecutive: int
    backoff_base_s: float
    consecutive: int = 0

    def failed(self, made_progress: bool) -> bool:
        """Count a failure; True while another in-process restart is allowed."""
        self.consecutive = 1 if made_progress else self.consecutive + 1
        return self.consecutive <= self.max_consecutive

    def wait(self) -> None:
        time.sleep(backoff_s(self.consecutive, self.backoff_base_s))


def build_watchdog(cfg: RecipeConfig, env: WorkerEnv, store: JobStore, events: EventLog,
                   device: torch.device, traffic: NodeTraffic) -> Optional[Watchdog]:
    """This rank's watchdog (None when it is off), on a store connection of
    its own: its monitor thread must not wait behind the training thread's
    requests."""
    res, run_dir = cfg.resilience, Path(cfg.run.dir)
    if not res.watchdog.enabled:
        return None
    return Watchdog(res.watchdog, rank=env.rank, world=env.world, store=store, run_dir=run_dir,
                    events=events, exit_on_hang=None if res.in_process else HANG_EXIT_CODE,
                    workload=workload(cfg),
                    stragglers=StragglerDetector(cfg.logging, rank=env.rank, run_dir=run_dir,
                                                 events=events, pp=cfg.parallel.pp),
                    device=device, peer_bytes=traffic, node=node_name(env))


class WorkerLife:
    def __init__(self, cfg: RecipeConfig, env: WorkerEnv, device: torch.device,
                 make_job: JobFactory, *, store: Optional[dist.Store] = None):
        self.cfg, self.env, self.device = cfg, env, device
        self.rank, self.world = env.rank, env.world
        use_device(device)  # the training thread's; the other threads set theirs
        self.make_job = make_job
        self.run_dir = Path(cfg.run.dir)
        self.events = EventLog(self.run_dir, self.rank)
        self.phases = StartupPhases(self.events, self.rank)
        # One prefix per launch attempt and one per generation inside it: a
        # stale address of an earlier attempt can never be read.
        store = store if store is not None else launch_store(env)
        self.store = JobStore.for_attempt(store, env)
        self.board = AbortBoard(self.store, self.rank)
        res = cfg.resilience
        self.policy = RestartPolicy(res.max_in_process_restarts, res.restart_backoff_s)
        self.preemption = PreemptionFlag().install()
        self.traffic = NodeTraffic(peer_bytes_counter(env.master_port),
                                   node_traffic_path(env.master_port, env.node_rank),
                                   env.local_rank)
        self.watchdog = build_watchdog(cfg, env, JobStore.for_attempt(own_connection(store), env),
                                       self.events, device, self.traffic)
        if self.watchdog is not None:
            self.watchdog.start()
        self.generation = 0
        self.furthest_step = 0  # the furthest step any generation of this process completed
        # Live replacement: whether the next generation waits for a
        # replacement to join, and this rank's state carried into it.
        self.awaiting: bool = False
        self.carried: Optional[object] = None

    def _progressed(self, supervision: Supervision) -> bool:
        """Whether the generation got further than every earlier one: a step
        completed again after resuming from an older checkpoint is no
        progress, so a failure that recurs after the same step (a broken
        collective after each step's work) ends in the restart limit, not in
        restarts forever."""
        progressed = supervision.last_step > self.furthest_step
        self.furthest_step = max(self.furthest_step, supervision.last_step)
        return progressed

    def run(self) -> str:
        if self.env.replacement:  # started in place of a lost process: the others wait for it
            self.generation = self.store.generation_to_join(
                self.rank, self.cfg.resilience.replacement.join_timeout_s)
            self.awaiting = True
        else:
            self._after_relaunch()
        try:
            while True:
                outcome = self._one_generation()
                if outcome is not None:
                    return outcome
        finally:
            if self.watchdog is not None:
                self.watchdog.close()
            self.traffic.close()

    def _after_relaunch(self) -> None:
        """On a relaunched attempt, rank 0 numbers the restart and backs off
        when the previous attempts made no progress either (a first attempt
        may follow a launch that ended unsaved); the other ranks wait for it
        in the next rendezvous."""
        if self.rank != 0:
            return
        if self.env.restart_count == 0:
            self._after_unsaved_end()
            return
        consecutive = relaunches_without_progress(self.run_dir) + 1
        self._count_restart("relaunch", last_failure(self.run_dir), self.env.restart_count,
                            self.cfg.resilience.max_restarts)
        time.sleep(backoff_s(consecutive, self.cfg.resilience.restart_backoff_s))

    def _after_unsaved_end(self) -> None:
        """A new launch on a run directory whose metrics go past its newest
        checkpoint: the previous launch ended without saving those steps (its
        launcher was killed, or it failed). They are trained again, so the
        launch counts as a relaunch and its repeated rows are marked."""
        last = max((r["step"] for r in read_metrics(self.run_dir) if "loss" in r), default=None)
        resumed = newest_step(self.cfg, self.world)[0] or 0
        if last is not None and last > resumed:
            # Not an attempt of this launch's budget (attempt 0): the console
            # says which steps are trained again instead.
            self._count_restart("relaunch", f"the previous launch ended after step {last} "
                                "without saving it (its launcher was killed, or it failed)",
                                self.env.restart_count, self.cfg.resilience.max_restarts,
                                unsaved_step=last)

    def _count_restart(self, kind: str, reason: str, number: int, limit: int,
                       **fields) -> None:
        """Rank 0 records the restart before the next rendezvous; every rank
        counts the recorded restarts after it, so all agree on the number."""
        from_step, from_tier = newest_step(self.cfg, self.world)
        self.events.emit("restart", kind=kind, generation=next_generation(self.run_dir),
                         reason=reason[:500], from_step=from_step, from_tier=from_tier,
                         attempt=number, max_attempts=limit, **fields)

    def _one_generation(self) -> Optional[str]:
        """Run one generation; its outcome, or None to go again."""
        arrival = self.store.enter(self.generation, self.rank)
        if self.awaiting:
            with self.phases.phase("waiting for the replacement"):
                await_members(self.store, self.generation, self.world,
                              self.cfg.resilience.replacement.join_timeout_s,
                              judge=judges_the_wait(arrival),
                              stopping=lambda: self.preemption.signalled_at is not None)
            self.awaiting = False
        with self.phases.phase("rendezvous"):
            dist.init_process_group(backend_for(self.device), rank=self.rank,
                                    world_size=self.world,
                                    store=self.store.generation_store(self.generation))
        job, supervision = None, self._supervision(self._generation_token())
        supervision.carried, self.carried = self.carried, None
        try:
            with supervision.section("setup", 0):
                job = self.make_job(supervision)
            self.store.set_up(self.generation, self.rank)
            self.preemption.saving_possible = True
            return job.run()
        except BaseException as err:  # noqa: BLE001 (HangAbort and DCP's errors are BaseExceptions)
            self._leave_generation()
            self.preemption.saving_possible = False
            self._handle_failure(err, supervision, job)
            return None
        finally:
            if job is not None:
                job.close()
            del job
            self._teardown()

    def _leave_generation(self) -> None:
        """Stop the watchdog judging this rank, and drop an abort it raised
        here before: after pause() it raises none, but one raised just before
        lands at any bytecode until cleared, pause()'s own included. The
        monitor raises once a generation, so at most one lands."""
        while True:
            try:
                if self.watchdog is not None:
                    self.watchdog.pause()
                main = threading.main_thread().ident
                assert main is not None  # the main thread runs this
                raise_in_thread(main, None)
                return
            except HangAbort:
                continue

    def _generation_token(self) -> str:
        """The token of the generation that just formed: drawn by rank 0,
        read by the others through the generation's store."""
        return self.store.fence_token(self.generation, new_token if self.rank == 0 else None)

    def _supervision(self, token: str) -> Supervision:
        generation = current_generation(self.run_dir)
        if self.rank == 0:
            # Now, not when the restart was recorded: every rank of the job has
            # left the old generation (they all joined this one), so none of
            # them is fenced on its way out; nothing of this one is written yet.
            set_fence(self.run_dir, generation, token)
        if self.watchdog is not None:
            self.watchdog.begin_generation(self.generation)
        faults = FaultInjector(self.cfg.faults, rank=self.rank, run_dir=self.run_dir,
                               checkpoint_root=RunPaths.of(self.cfg).checkpoint_root,
                               events=self.events,
                               local_node_dir=local_node_dir(self.cfg, self.env),
                               replacement=self.env.replacement)
        return Supervision(self.watchdog, faults, self.preemption, generation,
                           Fence(self.run_dir, generation, token, self.events),
                           local_world=self.env.local_world)

    def _handle_failure(self, err: BaseException, supervision: Supervision,
                        job: Optional[Job]) -> None:
        """Re-raise what the launcher must handle, stop the job on a fatal
        error, or restart: the policy's table decides (`failure_policy`)."""
        failure = self._facts(err, supervision)
        action = decide(failure)
        if action is Action.STOP_JOB:
            self._stop_job(err, failure.fatal_first)
        if action is not Action.RESTART:
            raise err
        self._restart(err, failure.peer_gone, job, supervision)

    def _facts(self, err: BaseException, supervision: Supervision) -> Failure:
        """The failure's facts, gathered in this order because the abort
        board is shared: the failure is recorded before any announcement,
        and a fatal one is announced (first wins) only while the store can
        be trusted to be there (no peer lost)."""
        if isinstance(err, Fenced):
            return Failure(fenced=True)  # recorded as `fenced` by the launcher
        if supervision.fence is not None:
            # A rank the job re-formed without (cut off, then its collectives
            # timed out) records `fenced`, not an error of the job's.
            supervision.fence.check(f"the record of its failure ({type(err).__name__})")
        made_progress = self._progressed(supervision)
        section = self.watchdog.current[0] if self.watchdog is not None else "unknown"
        peer_gone = self.board.peer_gone(self.generation, err)
        self.events.emit("worker_error", error=f"{type(err).__name__}: {err}"[:2000],
                         section=section, lost_peer=peer_gone, fatal=is_fatal(err),
                         generation=self.generation, pid=os.getpid(),
                         rss_mb=psutil.Process().memory_info().rss / 2**20)
        fatal_first = (self.board.fatal(self.generation, err)
                       if is_fatal(err) and not peer_gone else None)
        res = self.cfg.resilience
        return Failure(
            fatal_first=fatal_first,
            fatal_announced=(not peer_gone and fatal_first is None
                             and self.board.fatal_announced(self.generation)),
            peer_gone=peer_gone, in_process=res.in_process,
            restart_allowed=self.policy.failed(made_progress),
            replacing=res.replacement.enabled,
            stopping=self.preemption.signalled_at is not None,
            restartable=restartable(err))

    def _stop_job(self, err: BaseException, fatal_first: Optional[dict]) -> None:
        """Stop with the first fatal error (its rank records `run_failed`),
        or with the rank that announced one."""
        if fatal_first is None:
            raise JobFailed("stopped with the rank that failed") from err
        if fatal_first["rank"] == self.rank:
            self.events.emit("run_failed", error=fatal_first["error"])
        raise JobFailed(fatal_first["error"]) from err

    def _restart(self, err: BaseException, peer_gone: bool, job: Optional[Job],
                 supervision: Supervision) -> None:
        """Announce the failure so every rank restarts with us, then wait
        for a replacement (a peer was lost first) or go again in place."""
        cause = self.board.announce(self.generation, err, "lost_peer" if peer_gone else "error")
        traceback.clear_frames(err.__traceback__)
        if self.board.first_reason(self.generation) == "lost_peer":
            self._await_replacement(job, supervision)
            return
        self.generation += 1
        if self.rank == 0:
            assert supervision.fence is not None  # every generation's supervision has one
            supervision.fence.check("the record of an in-process restart")
            self._count_restart("in_process", cause, self.policy.consecutive,
                                self.policy.max_consecutive)
        self.policy.wait()

    def _await_replacement(self, job: Optional[Job], supervision: Supervision) -> None:
        """A process of the job was lost: this rank keeps its state for the
        next generation, which waits for the replacement the lost process's
        agent starts (and records as the restart). A generation lost before
        its job took the state it was handed (a replacement lost in turn)
        hands that on."""
        self.carried = job.hand_over() if job is not None else supervision.carried
        self.generation += 1
        self.awaiting = True

    def _teardown(self) -> None:
        """Drop the generation's process groups and free its memory before the
        next one loads a checkpoint (no growth over repeated restarts)."""
        if dist.is_initialized():
            if has_nccl_groups():  # the default group is "cpu:gloo,cuda:nccl" on CUDA
                # After a failure NCCL's destroy can block on a communicator a
                # peer left hanging; abort tears every communicator down.
                abort_process_groups()
            if dist.is_initialized():
                dist.destroy_process_group()
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


def run_worker(cfg: RecipeConfig, env: WorkerEnv, device: torch.device,
               make_job: JobFactory) -> str:
    """Run `make_job`'s jobs as this rank until one finishes, exits at
    train.exit_at_step or is preempted; failures the launcher must handle
    propagate."""
    # What is loaded by now (torch, the trainer's modules) lives as long as the
    # process: left out of the collection each teardown makes, so the path from
    # a lost process to the next generation does not scan it.
    gc.freeze()
    return WorkerLife(cfg, env, device, make_job).run()
