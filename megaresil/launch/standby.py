"""A standby worker: a process the replacing agent keeps beside its workers
(resilience.replacement.standby), with torch and the trainer imported, waiting.
When a worker is lost the agent writes that worker's environment to the
standby's stdin and it goes on as that worker: a replacement without the
seconds a new process spends importing (most of a replacement's cost on a
busy machine: docs/architecture.md ("A worker's start costs seconds")). The agent then starts the next standby.
Like a worker, a standby ends when its agent does, however the agent ends."""
from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys

from megaresil.resilience.guardian import die_with_parent

# Set for a standby: the pid of the agent that started it.
STANDBY_ENV = "MEGARESIL_STANDBY"


def is_standby() -> bool:
    return STANDBY_ENV in os.environ


def start_standby(command: list[str]) -> subprocess.Popen:
    """A standby of this agent, running `command` (a worker's)."""
    return subprocess.Popen(command, stdin=subprocess.PIPE,
                            env={**os.environ, STANDBY_ENV: str(os.getpid())})


def warm_up() -> None:
    """Import what a worker imports before its first step: torch, its
    distributed and elastic parts, the model, data, checkpoint and parallel
    code, and what torch imports on the first call of
    torch.use_deterministic_algorithms (every build makes it: its inductor
    config, half a second of a replacement's build on 2 cores)."""
    for module in ("megaresil.launch.worker", "megaresil.train.loop", "torch._inductor.config"):
        importlib.import_module(module)


def wait_for_assignment() -> None:
    """Warm up, then wait for the agent's assignment: one line on stdin,
    the environment of the rank to become. An empty read (the agent closed
    the pipe: it stopped, or no longer needs a standby) ends the process.
    Bound to the agent first: a standby whose agent was killed in its
    warm-up (seconds of imports) would otherwise outlive it that long."""
    die_with_parent(int(os.environ[STANDBY_ENV]))
    warm_up()
    line = sys.stdin.readline()
    if not line:
        sys.exit(0)
    os.environ.update(json.loads(line))
    del os.environ[STANDBY_ENV]


def assignment(env: dict[str, str]) -> bytes:
    """The line the agent writes to a standby: the environment it takes."""
    return (json.dumps(env) + "\n").encode()
