"""What a node's agent reports beyond TorchElastic (launch/reporting.py):
a worker process that ended with no report of its own is recorded as
`process_lost` with its rank (its peers only saw a connection close), and
the relaunches it made are counted by the agent itself, not from records
the failing workers may never have written (issue 46 item 12: "giving up
after 0 relaunches" after five). A real TorchElastic agent in this
process, its workers a line of Python each."""
from __future__ import annotations

import sys

import pytest
from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.launcher.api import LaunchConfig, elastic_launch

from megaresil.compat import elastic_agent_class
from megaresil.events import read_events
from megaresil.launch.reporting import AgentReport
from megaresil.launch.supervisor import supervising_agent

# Rank 1 is killed (no error file, as a kill -9 or the OOM killer leaves
# it); rank 0 would wait for it, as a peer in a collective does.
KILLED_RANK_1 = ("import os, signal, time\n"
                 "if os.environ['RANK'] == '1': os.kill(os.getpid(), signal.SIGKILL)\n"
                 "time.sleep(60)")


def test_a_killed_worker_is_recorded_by_rank_and_each_relaunch_counted(tmp_path):
    report = AgentReport()
    config = LaunchConfig(min_nodes=1, max_nodes=1, nproc_per_node=2, rdzv_backend="c10d",
                          rdzv_endpoint="127.0.0.1:0", run_id="reporting", max_restarts=2,
                          monitor_interval=0.1, logs_specs=DefaultLogsSpecs(
                              log_dir=str(tmp_path / "elastic")))
    with elastic_agent_class(supervising_agent(None, tmp_path, report)):
        with pytest.raises(ChildFailedError):
            elastic_launch(config, sys.executable)("-c", KILLED_RANK_1)
    assert report.relaunches == 2  # the budget: no worker recorded a restart
    assert report.runs_rank_0
    lost = [e for e in read_events(tmp_path) if e["event"] == "process_lost"]
    assert [(e["rank"], e["exitcode"], e["how"]) for e in lost] == [(1, -9, "signal SIGKILL")] * 3
    assert all(e["pid"] > 0 and e["host"] for e in lost)
