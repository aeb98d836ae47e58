"""The run directory's JSON-lines records: `events.jsonl` (one object per
resilience/lifecycle event, written here) and `metrics.jsonl` (read here;
the training loop writes it)."""
from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any, Callable, Optional

from megaresil.config import ConfigError
from megaresil.safe_files import open_append_nofollow


class EventLog:
    """Appends events from any rank. Each line is written with one O_APPEND
    write, so lines from concurrent ranks never interleave; never through a
    link planted in the file's place (safe_files)."""

    def __init__(self, run_dir: str | Path, rank: Optional[int] = None):
        self.path = Path(run_dir) / "events.jsonl"
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.rank = rank

    def emit(self, event: str, **fields: Any) -> dict:
        record = {"time": time.time(), "event": event}
        if self.rank is not None:
            record["rank"] = self.rank
        record.update(fields)
        fd = open_append_nofollow(self.path)
        try:
            os.write(fd, (repair_prefix(fd) + json.dumps(record) + "\n").encode())
        finally:
            os.close(fd)
        return record


# Written after a torn last line is ended, so readers tell that line (lost,
# skipped) from corruption in the middle of the file (refused).
REPAIRED = {"repaired_torn_line": True}


def repair_prefix(fd: int) -> str:
    """What to write before appending to the JSON Lines file open as `fd`
    (safe_files.open_append_nofollow): when its last line is torn (a short
    write on a full disk, a power cut), a newline and the REPAIRED record,
    so the new line starts on a line of its own and only the torn one is
    lost. Read through the same descriptor, so no link is followed."""
    size = os.fstat(fd).st_size
    if size == 0 or os.pread(fd, 1, size - 1) == b"\n":
        return ""
    return "\n" + json.dumps(REPAIRED) + "\n"


class DamagedRecord(ConfigError):
    """A line of a run's JSON Lines file that is none of its records: what
    reads the file (the launcher's check, every worker, every restart) would
    meet it again, so no restart cures it."""

    def __init__(self, path: Path, number: int, problem: str):
        super().__init__(f"{path} line {number}", f"{problem}.",
                         "repair or delete that line (megaresil only appends to this file; "
                         "a deleted line loses only that record).")


def read_jsonl(path: Path, shape: Callable[[dict], Optional[str]] = lambda record: None
               ) -> list[dict]:
    """The records of a JSON Lines file. A torn last line (no newline after
    it, and not JSON) is ignored with a warning; a bad line anywhere else is
    corruption and raises DamagedRecord, naming the line. `shape` says what
    is wrong with a record that is JSON (None when nothing is)."""
    try:
        data = path.read_bytes()
    except IsADirectoryError:
        raise ConfigError(str(path), "is a directory, not the run's records (JSON Lines).",
                          "move it out of the run directory: megaresil writes this file."
                          ) from None
    lines = [(number, line) for number, line in enumerate(data.split(b"\n"), 1) if line.strip()]
    records = []
    for i, (number, line) in enumerate(lines):
        shown = line[:60].decode(errors="replace")
        try:
            record = json.loads(line)
        except ValueError:  # not JSON, or not UTF-8
            if not torn(lines, i, data):
                raise DamagedRecord(path, number, f"{shown!r} is not JSON") from None
            print(f"megaresil: warning: {path}: ignoring a torn line ({shown[:40]!r}...)",
                  file=sys.stderr)
            continue
        if record == REPAIRED:
            continue
        problem = "is not a JSON object" if not isinstance(record, dict) else shape(record)
        if problem:
            raise DamagedRecord(path, number, f"{shown!r} {problem}")
        records.append(record)
    return records


def torn(lines: list[tuple[int, bytes]], i: int, data: bytes) -> bool:
    """Whether line `i` of `data` is one a kill or a full disk cut short:
    the last, with no newline after it, or one the writer ended and marked
    REPAIRED after (repair_prefix)."""
    if i == len(lines) - 1:
        return not data.endswith(b"\n")
    return lines[i + 1][1] == json.dumps(REPAIRED).encode()


def event_shape(record: dict) -> Optional[str]:
    """What every reader of events.jsonl relies on: the event's name."""
    if not isinstance(record.get("event"), str):
        return 'has no "event" name'
    return None


def metrics_shape(record: dict) -> Optional[str]:
    """What every reader of metrics.jsonl relies on: a step's row (it has a
    loss) names its step and time."""
    step, at = record.get("step"), record.get("time")
    if "loss" in record and not (type(step) is int and type(at) in (int, float)):
        return 'is a step\'s row (it has "loss") without a whole "step" and a "time"'
    return None


def read_events(run_dir: str | Path) -> list[dict]:
    path = Path(run_dir) / "events.jsonl"
    return read_jsonl(path, event_shape) if path.exists() else []


def read_metrics(run_dir: str | Path) -> list[dict]:
    path = Path(run_dir) / "metrics.jsonl"
    return read_jsonl(path, metrics_shape) if path.exists() else []
