"""What a node's TorchElastic agent tells the run's records and the
launcher beyond TorchElastic's own logs.

A worker process that ends with no report of its own (a signal: killed,
out of memory, crashed) leaves its peers only a closed connection. The
agent saw which one it was: it polls each worker process itself
(TorchElastic's check reports the ones it stopped as failed too) and
records `process_lost`, the cause the console and the relaunch name. It
counts the relaunches it made (the workers may not have lived to record
them), and says whether it runs the job's rank 0: on several nodes every
launcher follows the same events.jsonl, and only that node's prints the
job's lines. docs/fault-tolerance.md ("On the console")."""
from __future__ import annotations

import os
import signal
import socket
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from torch.distributed.elastic.agent.server.api import RunResult, WorkerGroup, WorkerState
from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent
from torch.distributed.elastic.multiprocessing.api import PContext
from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

from megaresil.compat import context_process
from megaresil.events import EventLog
from megaresil.resilience.watchdog.abort import HANG_EXIT_CODE


@dataclass
class AgentReport:
    """What this node's agent did, as the launcher reports it."""
    relaunches: int = 0  # of the workers after a failure (resilience.max_restarts)
    runs_rank_0: bool = False  # in its latest round: its console speaks for the job


def how_it_ended(exitcode: int) -> str:
    return f"signal {signal.Signals(-exitcode).name}" if exitcode < 0 else f"exit code {exitcode}"


def without_report(failure: ProcessFailure) -> bool:
    """A process that ended leaving no error file (a worker writes one for
    any error of its own, a lost peer's included), other than by the
    watchdog's hang exit (the hang is recorded)."""
    return not os.path.isfile(failure.error_file) and failure.exitcode != HANG_EXIT_CODE


class ReportingAgent(LocalElasticAgent):
    def __init__(self, *args: Any, run_dir: Path, report: AgentReport, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.events = EventLog(run_dir)
        self.report = report

    def _start_workers(self, worker_group: WorkerGroup) -> dict[int, Any]:
        self.report.runs_rank_0 = any(w.global_rank == 0 for w in worker_group.workers)
        return super()._start_workers(worker_group)

    def _process(self, local_rank: int) -> subprocess.Popen:
        return context_process(self._pcontext, local_rank)

    def _workers(self) -> PContext:
        """The workers' process context, which TorchElastic sets when it
        starts them: every caller acts on workers that were started."""
        assert self._pcontext is not None
        return self._pcontext

    def _monitor_workers(self, worker_group: WorkerGroup) -> RunResult:
        """Each worker process polled. TorchElastic's own check, once one
        failed, stops the others and reports them failed as well (exit code
        143 from a SIGTERM): the lost process could not be told from them."""
        codes = {w.local_rank: self._process(w.local_rank).poll() for w in worker_group.workers}
        lost = {lr: code for lr, code in codes.items() if code not in (None, 0)}
        if lost and not self._replaced(worker_group, lost):
            return self._failed(worker_group, lost)
        if not lost and all(code == 0 for code in codes.values()):
            return RunResult(state=WorkerState.SUCCEEDED, return_values={
                w.global_rank: None for w in worker_group.workers})
        return RunResult(state=WorkerState.HEALTHY)

    def _replaced(self, worker_group: WorkerGroup, lost: dict[int, int]) -> bool:
        """Whether the `lost` processes were replaced; here never: the agent
        relaunches every worker (a subclass may replace them one by one)."""
        return False

    def _failed(self, worker_group: WorkerGroup, lost: dict[int, int]) -> RunResult:
        """The failure TorchElastic acts on, each process that left no
        report of its own recorded as `process_lost`."""
        failures = {worker_group.workers[lr].global_rank: ProcessFailure(
            local_rank=lr, pid=self._process(lr).pid, exitcode=code,
            error_file=self._workers().envs[lr]["TORCHELASTIC_ERROR_FILE"])
            for lr, code in lost.items()}
        for rank, failure in sorted(failures.items()):
            if without_report(failure):
                self.events.emit("process_lost", rank=rank, pid=failure.pid,
                                 local_rank=failure.local_rank, exitcode=failure.exitcode,
                                 how=how_it_ended(failure.exitcode), host=socket.gethostname())
        return RunResult(state=WorkerState.FAILED, failures=failures)

    def _restart_workers(self, worker_group: WorkerGroup) -> None:
        # TorchElastic restarts the group after a failure (its budget) and when
        # nodes wait to join (not counted): the state tells them apart.
        if worker_group.state in (WorkerState.FAILED, WorkerState.UNHEALTHY):
            self.report.relaunches += 1
        super()._restart_workers(worker_group)
