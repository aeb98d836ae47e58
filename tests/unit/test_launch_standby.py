"""The standby (launch/standby.py) ends with the agent that started it,
however the agent ends, as its workers do: not only once its warm-up is
over and it finds its stdin closed."""
from __future__ import annotations

import contextlib
import subprocess
import sys

import psutil

from tests.harness.cli import ROOT

# An agent that starts a standby and prints its pid. Something else holds the
# standby's stdin open (here a sleep; after a kill -9, whatever inherited it),
# so that no end of file ever reaches the standby: only its binding can end it.
AGENT = """
import subprocess, sys, time
from megaresil.launch.standby import start_standby
standby = start_standby([sys.executable, "-m", "megaresil", "train", "gpt-tiny"])
holder = subprocess.Popen(["sleep", "300"], pass_fds=(standby.stdin.fileno(),))
print(standby.pid, holder.pid, flush=True)
time.sleep(300)
"""


def test_a_standby_ends_with_its_agent_killed_during_its_warm_up():
    agent = subprocess.Popen([sys.executable, "-c", AGENT], stdout=subprocess.PIPE, text=True,
                             cwd=ROOT)
    standby, holder = (psutil.Process(int(pid)) for pid in agent.stdout.readline().split())
    try:
        agent.kill()  # kill -9: no cleanup of the agent's runs
        agent.wait()
        standby.wait(timeout=60)  # psutil.TimeoutExpired while it lives on
    finally:
        for process in (standby, holder):
            with contextlib.suppress(psutil.NoSuchProcess):
                process.kill()
