"""Fencing: a rank of a generation the job formed again without writes nothing.

A generation is one formation of the job: its number is the restarts
recorded in the run directory, and a token drawn as it forms tells apart two
formations with one number. As it forms, its rank 0 sets the run directory's
fence, the file `generation` ("NUMBER TOKEN", replaced atomically, never set
back to a lower number). A rank whose generation the fence does not name was
cut off (a partition), outlived its relaunch, or formed apart from the job
(the last to form holds the fence): it commits no checkpoint, moves no
`latest`, appends no metrics row and records no restart; it records
`fenced` once and stops. The check reads the fence just before each such
write (no compare-and-swap on shared file systems: a re-form inside that
instant is caught at the next write). A deleted fence fences nobody; a
damaged one is a ConfigError the launcher refuses (launch/checks.py).
docs/fault-tolerance.md ("Fencing") says it for users."""
from __future__ import annotations

import os
import re
import secrets
from pathlib import Path
from typing import Callable, Optional

from megaresil.config import ConfigError
from megaresil.events import EventLog
from megaresil.safe_files import write_atomic

FENCE_NAME = "generation"


class Fenced(BaseException):
    """This rank's generation is behind the fence: the job re-formed without
    it. A BaseException, so that no `except Exception` on the way keeps the
    rank going."""


# What rank 0 writes as a generation forms: its number, a space, its token.
FENCE_TEXT = re.compile(r"([0-9]{1,18}) ?(\S*)")


class FenceDamaged(ConfigError):
    """The run directory's fence is there but is not one: no rank can tell
    which formation holds the run directory, and no restart changes that."""

    def __init__(self, path: Path, problem: str, fix: str = ""):
        self.path, self.problem = path, problem
        super().__init__(str(path), f"{problem}, not the fence megaresil writes there "
                         "(\"NUMBER TOKEN\" as each generation of the job forms).",
                         fix or "run the same command again: before any worker starts it "
                         "says which generation to write back.")


def read_fence(run_dir: Path) -> Optional[tuple[int, str]]:
    """The run directory's fence: the newest generation's number and token;
    None without one."""
    path = Path(run_dir) / FENCE_NAME
    try:  # never through a link planted in its place
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    except FileNotFoundError:
        return None
    try:
        text = os.read(fd, 128).decode(errors="replace").strip()
    except IsADirectoryError:
        raise FenceDamaged(path, "is a directory") from None
    finally:
        os.close(fd)
    found = FENCE_TEXT.fullmatch(text)
    if found is None:
        raise FenceDamaged(path, f"holds {text[:40]!r}")
    return int(found[1]), found[2]


def fence_of(run_dir: Path) -> int:
    """The newest generation's number (0 without a fence)."""
    fence = read_fence(run_dir)
    return fence[0] if fence is not None else 0


def new_token() -> str:
    return secrets.token_hex(6)


def set_fence(run_dir: Path, generation: int, token: str) -> None:
    """Fence out every other formation: the generation `generation` formed
    as `token` holds the run directory; never set back to a lower number."""
    if generation >= fence_of(run_dir):
        write_atomic(Path(run_dir) / FENCE_NAME, f"{generation} {token}\n".encode())


class Fence:
    """One rank's check before a write only the current generation may make."""

    def __init__(self, run_dir: Path, generation: int, token: str, events: Optional[EventLog]):
        self.run_dir, self.generation, self.token = Path(run_dir), generation, token
        self.events = events
        self.reported = False

    def name(self) -> str:
        return f"{self.generation}-{self.token}"

    def check(self, write: str, abandoned: Callable[[], bool] = lambda: False) -> None:
        """Raise Fenced, recording `fenced` once, when another formation of
        the job holds the fence; `write` names what was about to be written.
        A save its rank abandoned is refused unrecorded (`abandoned()`, asked
        once refused: the rank abandons its saves before it joins the next
        formation, which sets the fence): the rank went on with the job, only
        its old save thread was left behind."""
        fence = read_fence(self.run_dir)
        if fence is None:
            # Deleted while the job runs (never by megaresil): it names no
            # other formation, so it fences nobody; the next formation writes
            # it again. Re-creating it here could fence the healthy job: a
            # rank cannot tell whether its own formation is the newest.
            return
        current, token = fence
        if fence == (self.generation, self.token) or current < self.generation:
            return  # ours, or an older formation's (a run directory of an older version)
        reason = (f"the job formed again as generation {current} without this rank "
                  f"(generation {self.generation}): {write} refused")
        if self.events is not None and not self.reported and not abandoned():
            self.reported = True
            self.events.emit("fenced", generation=self.generation, current_generation=current,
                             refused=write, reason=reason)
        raise Fenced(reason)
