"""Per-worker supervision under the TorchElastic agent: a lost worker
process is started again alone while the others stay in theirs.

TorchElastic's agent starts its workers in one process context that
terminates them all when one fails, and restarts the whole group on any
failure. This agent keeps TorchElastic's rendezvous, environment and
process context but watches each worker process: one that died (a signal,
or the watchdog's hang exit) is replaced with the same environment, by the
standby (launch/standby.py) or a new process, recorded in the launch store
for the waiting ranks (resilience/replacement.py). A failure it may not
replace (an error of the process's own, the budget spent, a loss in a
generation's setup) goes to TorchElastic's relaunch of the group. A hot
spare (launch/spares.py) never needed ends as a success when the rendezvous
closes; one failing its health checks as it waits leaves (launch/admission.py).
docs/fault-tolerance.md ("Live replacement")."""
from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional, cast

import torch.distributed as dist
from torch.distributed.elastic.agent.server.api import RunResult, WorkerGroup, WorkerState

from megaresil.launch.admission import WaitingChecks
from megaresil.launch.reporting import AgentReport, ReportingAgent, how_it_ended
from megaresil.launch.standby import assignment, start_standby
from megaresil.resilience.coordination import JobStore
from megaresil.resilience.records import next_generation
from megaresil.resilience.watchdog.abort import HANG_EXIT_CODE
from megaresil.worker_env import REPLACEMENT_ENV, WorkerEnv


@dataclass(frozen=True)
class AgentPolicy:
    run_dir: Path
    max_replacements: int = 0  # per launch attempt; 0: a lost process relaunches all
    standby: bool = False  # keep a warm process ready to take a lost worker's place
    shutdown_timeout_s: float = 30.0
    spares: bool = False  # agents beyond the rendezvous's nodes may wait as spares
    # The node's health checks (launch/health.py) while it waits in the
    # rendezvous: None when it is fit, else why not (it is then excluded).
    health: Optional[Callable[[], Optional[str]]] = None
    health_interval_s: float = 60.0


def replaceable(exitcode: int) -> bool:
    """A process that was lost (a signal) or ended by the watchdog for a
    hang it could not abort; one that exited with an error of its own
    reported a failure no new process of the same rank would cure."""
    return exitcode < 0 or exitcode == HANG_EXIT_CODE


def stop_processes(procs: list[subprocess.Popen], timeout_s: float) -> None:
    """SIGTERM to all, then SIGKILL to those still running after `timeout_s`
    (as TorchElastic stops its workers: all at once, one deadline)."""
    for proc in procs:
        if proc.poll() is None:
            proc.terminate()
    deadline = time.monotonic() + timeout_s
    for proc in procs:
        try:
            proc.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


class SupervisingAgent(ReportingAgent):
    def __init__(self, *args: Any, policy: AgentPolicy, report: AgentReport, **kwargs: Any):
        super().__init__(*args, run_dir=policy.run_dir, report=report, **kwargs)
        self.policy = policy
        self.replacements: dict[int, subprocess.Popen] = {}  # local rank -> its replacement
        self.standby: Optional[subprocess.Popen] = None
        self.spent = 0  # replacements in this launch attempt

    def run(self, *args: Any, **kwargs: Any) -> RunResult:
        """TorchElastic's run, which returns nothing when the rendezvous
        closed on a spare still waiting (the job ended without needing it):
        a success, said once."""
        result = super().run(*args, **kwargs)
        if result is None:
            print(f"megaresil: the job ended; this node ({socket.gethostname()}) waited as a "
                  "hot spare and was not needed", file=sys.stderr, flush=True)
            return RunResult(state=WorkerState.SUCCEEDED, return_values={})
        return result

    def _rendezvous(self, worker_group: WorkerGroup) -> None:
        """TorchElastic's rendezvous, the node's checks running while it
        waits (launch/admission.py)."""
        if self.policy.health is None:
            return super()._rendezvous(worker_group)
        with WaitingChecks(self.policy.health, self.policy.health_interval_s):
            super()._rendezvous(worker_group)

    def _start_workers(self, worker_group: WorkerGroup) -> dict[int, Any]:
        self._stop_extra_processes()
        self.spent = 0
        pids = super()._start_workers(worker_group)
        self._start_standby(worker_group)
        return pids

    def _shutdown(self, *args: Any, **kwargs: Any) -> None:
        """The workers, the replacements and the standby stop together."""
        for proc in self._extra_processes():
            if proc.poll() is None:
                proc.terminate()
        super()._shutdown(*args, **kwargs)
        self._stop_extra_processes()

    def _extra_processes(self) -> list[subprocess.Popen]:
        return [*self.replacements.values(), *filter(None, [self.standby])]

    def _stop_extra_processes(self) -> None:
        stop_processes(self._extra_processes(), self.policy.shutdown_timeout_s)
        self.replacements.clear()
        self.standby = None

    def _start_standby(self, worker_group: WorkerGroup) -> None:
        if self.policy.standby and self.spent < self.policy.max_replacements:
            spec = worker_group.spec
            assert isinstance(spec.entrypoint, str)  # megaresil's workers are a binary's processes
            self.standby = start_standby([spec.entrypoint, *spec.args])

    def _process(self, local_rank: int) -> subprocess.Popen:
        """The live process of `local_rank`: its replacement's, once it has one."""
        if local_rank in self.replacements:
            return self.replacements[local_rank]
        return super()._process(local_rank)

    def _replaced(self, worker_group: WorkerGroup, lost: dict[int, int]) -> bool:
        """Put a process in the place of each of the `lost` ones, when they
        may be replaced (else they are relaunched with the others)."""
        store = self._replacement_store(worker_group, lost)
        if store is None:
            return False
        for local_rank, code in sorted(lost.items()):
            self._replace(worker_group, local_rank, code, store)
        return True

    def _replacement_store(self, worker_group: WorkerGroup,
                           lost: dict[int, int]) -> Optional[JobStore]:
        """The launch store the replacements of the `lost` processes are
        recorded in; None when they may not be replaced (then relaunched)."""
        if not (all(replaceable(code) for code in lost.values())
                and self.spent + len(lost) <= self.policy.max_replacements):
            return None
        try:
            worker_env = {**os.environ, **self._workers().envs[next(iter(lost))]}
            # torch's WorkerGroup declares its store address by a bare None;
            # the rendezvous set it before the workers started.
            store = JobStore.for_agent(cast(str, worker_group.master_addr),
                                       cast(int, worker_group.master_port),
                                       WorkerEnv.parse(worker_env))
            if any(store.lost_in_setup(worker_group.workers[lr].global_rank,
                                       self._process(lr).pid) for lr in lost):
                return None
            return store
        except dist.DistError:  # the store went with its host: only a relaunch re-forms
            return None

    def _replace(self, worker_group: WorkerGroup, local_rank: int, exitcode: int,
                 store: JobStore) -> None:
        """Put a process in `local_rank`'s place, with its first environment
        (rank, launch attempt) and the replacement's mark: the standby, or a
        new process."""
        worker = worker_group.workers[local_rank]
        lost_pid = self._process(local_rank).pid
        self.spent += 1
        workers = self._workers()
        assert isinstance(workers.entrypoint, str)  # megaresil's workers are a binary's processes
        env = {**workers.envs[local_rank], REPLACEMENT_ENV: "1"}
        standby, self.standby = self.standby, None
        if standby is not None and standby.poll() is not None:
            standby = None
        # A new process imports for seconds before it can join; the standby
        # joins at once, so it is told only once the restart is recorded.
        proc = standby or subprocess.Popen(
            [workers.entrypoint, *workers.args[local_rank]], env={**os.environ, **env})
        # The waiting ranks read the store (a lost rank nobody replaces ends
        # their wait); they count restarts from the events once the
        # replacement has joined, so they all see this one (and every
        # node's console prints it).
        store.announce_replacement(lost_pid, proc.pid)
        self.events.emit("restart", kind="replace", generation=next_generation(self.policy.run_dir),
                         reason=f"rank {worker.global_rank} (pid {lost_pid}) ended with "
                                f"{how_it_ended(exitcode)}",
                         rank=worker.global_rank, lost_pid=lost_pid, pid=proc.pid,
                         from_tier="live", standby=standby is not None, attempt=self.spent,
                         max_attempts=self.policy.max_replacements)
        if standby is not None:
            assert standby.stdin is not None  # start_standby opens it as a pipe
            try:
                standby.stdin.write(assignment(env))
                standby.stdin.close()
            except BrokenPipeError:  # it died since the poll: the next poll replaces it in turn
                pass
        if local_rank in self.replacements:  # a replacement lost in turn
            stop_processes([self.replacements[local_rank]], self.policy.shutdown_timeout_s)
        self.replacements[local_rank] = proc
        worker.id = proc.pid
        self._start_standby(worker_group)


def supervising_agent(policy: Optional[AgentPolicy], run_dir: Path, report: AgentReport):
    """What builds the launch's agent: the reporting agent, or with a policy
    (replacement or spares) the supervising agent; both tell `report`."""
    if policy is None:
        return lambda *args, **kwargs: ReportingAgent(*args, run_dir=run_dir, report=report,
                                                      **kwargs)
    return lambda *args, **kwargs: SupervisingAgent(*args, policy=policy, report=report,
                                                    **kwargs)
