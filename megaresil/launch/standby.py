"""A standby worker: a process the replacing agent keeps beside its workers
(resilience.replacement.standby), with torch and the trainer imported, waiting.
When a worker is lost the agent writes that worker's environment to the
standby's stdin and it goes on as that worker: a replacement without the
seconds a new process spends importing (most of a replacement's cost on a
busy machine: design.md §4). The agent then starts the next standby."""
from __future__ import annotations

import importlib
import json
import os
import sys

STANDBY_ENV = "MEGARESIL_STANDBY"


def is_standby() -> bool:
    return os.environ.get(STANDBY_ENV) == "1"


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
    the pipe: it stopped, or no longer needs a standby) ends the process."""
    warm_up()
    line = sys.stdin.readline()
    if not line:
        sys.exit(0)
    os.environ.update(json.loads(line))
    del os.environ[STANDBY_ENV]


def assignment(env: dict[str, str]) -> bytes:
    """The line the agent writes to a standby: the environment it takes."""
    return (json.dumps(env) + "\n").encode()
