"""What a worker does with a failure it caught: the restart policy as one
table of rules over the facts of the failure, first match wins. The facts
are gathered by the worker's life (`resilience/restart.py`), in an order
that matters to the other ranks (the abort board is a shared store); this
module only decides. docs/fault-tolerance.md ("What is detected and what
happens") says it for users."""
from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Callable, Optional


class Action(enum.Enum):
    RERAISE = "reraise"  # the launcher handles it (relaunch, or the run ends)
    STOP_JOB = "stop_job"  # every rank stops: `JobFailed`, no restart anywhere
    RESTART = "restart"  # announce it and go again in process (or await a replacement)


@dataclass(frozen=True)
class Failure:
    """The facts of one caught failure."""
    fenced: bool = False  # this rank is cut off from the job
    # The first fatal error announced on this generation's board (None when
    # none, or when a lost peer left the board unread).
    fatal_first: Optional[dict] = None
    fatal_announced: bool = False  # another rank stopped the job for a fatal error
    peer_gone: bool = False  # a process of the job is lost
    in_process: bool = True  # resilience.in_process
    restart_allowed: bool = True  # within the limit of restarts without progress
    replacing: bool = False  # resilience.replacement.enabled
    stopping: bool = False  # told to stop (preemption)
    restartable: bool = True  # neither fatal nor the process told to end


Rule = tuple[str, Callable[[Failure], bool], Action]

RULES: tuple[Rule, ...] = (
    ("a fenced rank writes nothing more", lambda f: f.fenced, Action.RERAISE),
    ("a fatal error stops every rank",
     lambda f: f.fatal_first is not None or f.fatal_announced, Action.STOP_JOB),
    ("in-process restarts are off", lambda f: not f.in_process, Action.RERAISE),
    ("the limit of restarts without progress is reached",
     lambda f: not f.restart_allowed, Action.RERAISE),
    ("a lost peer without live replacement: the launcher re-forms the job",
     lambda f: f.peer_gone and not f.replacing, Action.RERAISE),
    ("told to stop: no restart here", lambda f: f.stopping, Action.RERAISE),
    ("no restart cures it", lambda f: not f.restartable, Action.RERAISE),
    ("restart in process", lambda f: True, Action.RESTART),
)


def decide(failure: Failure) -> Action:
    return next(action for _, applies, action in RULES if applies(failure))
