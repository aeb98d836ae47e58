"""Per-worker supervision under the TorchElastic agent: a lost worker
process is started again alone, in place, while the others stay in theirs.

TorchElastic's LocalElasticAgent starts its workers in one process context
that terminates them all when any one fails, and answers any failure by
restarting the whole group after a new rendezvous. The agent here keeps
TorchElastic's rendezvous, environment and process contexts, but watches
each worker process by itself: a process that died (a signal, or the
watchdog's hang exit) is replaced by a new one with the same environment
(same rank, same launch attempt), started in a context of its own, and
recorded in the launch store so the waiting ranks know it is coming
(resilience/replacement.py). A failure it may not replace (the process
exited with an error of its own, or the budget is spent) goes to
TorchElastic's relaunch of the whole group, as before."""
from __future__ import annotations

import signal
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any, Optional

import torch.distributed as dist
from torch.distributed.elastic.agent.server.api import RunResult, WorkerGroup, WorkerState
from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent
from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs, start_processes
from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

from megaresil.compat import context_process
from megaresil.events import EventLog
from megaresil.resilience.records import next_generation
from megaresil.resilience.replacement import REPLACEMENT_ENV, announce_replacement, attempt_prefix
from megaresil.resilience.watchdog.abort import HANG_EXIT_CODE


@dataclass(frozen=True)
class ReplacementPolicy:
    max_replacements: int  # per launch attempt
    run_dir: Path


def replaceable(exitcode: int) -> bool:
    """A process that was lost (a signal) or ended by the watchdog for a
    hang it could not abort; one that exited with an error of its own
    reported a failure no new process of the same rank would cure."""
    return exitcode < 0 or exitcode == HANG_EXIT_CODE


def how_it_ended(exitcode: int) -> str:
    return f"signal {signal.Signals(-exitcode).name}" if exitcode < 0 else f"exit code {exitcode}"


class ReplacingAgent(LocalElasticAgent):
    def __init__(self, *args: Any, policy: ReplacementPolicy, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.policy = policy
        self.events = EventLog(policy.run_dir)
        self.replacements: dict[int, Any] = {}  # local rank -> its replacement's context
        self.spent = 0  # replacements in this launch attempt

    def _start_workers(self, worker_group: WorkerGroup) -> dict[int, Any]:
        self._close_replacements()
        self.spent = 0
        return super()._start_workers(worker_group)

    def _shutdown(self, *args: Any, **kwargs: Any) -> None:
        self._close_replacements()
        super()._shutdown(*args, **kwargs)

    def _close_replacements(self) -> None:
        for context in self.replacements.values():
            context.close()
        self.replacements.clear()

    def _process(self, local_rank: int):
        """The live process of `local_rank`: its replacement's, once it has one."""
        if local_rank in self.replacements:
            return context_process(self.replacements[local_rank], 0)
        return context_process(self._pcontext, local_rank)

    def _error_file(self, local_rank: int) -> str:
        if local_rank in self.replacements:
            return self.replacements[local_rank].error_files[0]
        return self._pcontext.error_files[local_rank]

    def _monitor_workers(self, worker_group: WorkerGroup) -> RunResult:
        codes = {w.local_rank: self._process(w.local_rank).poll() for w in worker_group.workers}
        lost = {lr: code for lr, code in codes.items() if code not in (None, 0)}
        if lost and self._may_replace(lost):
            for local_rank, code in sorted(lost.items()):
                self._replace(worker_group, local_rank, code)
            return RunResult(state=WorkerState.HEALTHY)
        if lost:
            failures = {worker_group.workers[lr].global_rank: ProcessFailure(
                local_rank=lr, pid=self._process(lr).pid, exitcode=code,
                error_file=self._error_file(lr)) for lr, code in lost.items()}
            return RunResult(state=WorkerState.FAILED, failures=failures)
        if all(code == 0 for code in codes.values()):
            return RunResult(state=WorkerState.SUCCEEDED, return_values={
                w.global_rank: None for w in worker_group.workers})
        return RunResult(state=WorkerState.HEALTHY)

    def _may_replace(self, lost: dict[int, int]) -> bool:
        return (all(replaceable(code) for code in lost.values())
                and self.spent + len(lost) <= self.policy.max_replacements)

    def _replace(self, worker_group: WorkerGroup, local_rank: int, exitcode: int) -> None:
        """Start `local_rank` again in a context of its own, with its first
        environment (rank, launch attempt) and the replacement's mark."""
        worker = worker_group.workers[local_rank]
        lost_pid = self._process(local_rank).pid
        self.spent += 1
        how = how_it_ended(exitcode)
        # Recorded before the new process starts: the ranks count restarts
        # from the events once it has joined, so they all see this one (and
        # every node's console prints it).
        self.events.emit("restart", kind="replace", generation=next_generation(self.policy.run_dir),
                         reason=f"rank {worker.global_rank} (pid {lost_pid}) ended with {how}",
                         rank=worker.global_rank, lost_pid=lost_pid, from_tier="live",
                         attempt=self.spent, max_attempts=self.policy.max_replacements)
        first = self._pcontext
        if local_rank in self.replacements:  # a replacement lost in turn
            self.replacements.pop(local_rank).close()
        env = {**first.envs[local_rank], REPLACEMENT_ENV: "1"}
        context = start_processes(
            name=worker_group.spec.role, entrypoint=first.entrypoint,
            args={0: first.args[local_rank]}, envs={0: env},
            logs_specs=DefaultLogsSpecs(log_dir=str(self.policy.run_dir / "elastic" /
                                                    f"replacement_{lost_pid}")))
        self.replacements[local_rank] = context
        pid = context_process(context, 0).pid
        worker.id = pid
        announce_replacement(self._launch_store(worker_group, env), lost_pid, pid)

    @staticmethod
    def _launch_store(worker_group: WorkerGroup, env: dict) -> dist.Store:
        """The store the workers coordinate through, under their attempt's prefix."""
        store = dist.TCPStore(worker_group.master_addr, worker_group.master_port,
                              is_master=False, timeout=timedelta(seconds=30))
        return dist.PrefixStore(attempt_prefix(int(env["TORCHELASTIC_RESTART_COUNT"])), store)


def replacing_agent(policy: Optional[ReplacementPolicy]):
    """What builds the launch's agent: LocalElasticAgent, or with a policy
    the replacing agent."""
    if policy is None:
        return LocalElasticAgent
    return lambda *args, **kwargs: ReplacingAgent(*args, policy=policy, **kwargs)
