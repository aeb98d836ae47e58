"""The run directory's JSON-lines records: `events.jsonl` (one object per
resilience/lifecycle event, written here) and `metrics.jsonl` (read here;
the training loop writes it)."""
from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any, Optional

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


def read_jsonl(path: Path) -> list[dict]:
    """The records of a JSON Lines file. A torn last line (no newline after
    it, and not JSON) is ignored with a warning; a bad line anywhere else is
    corruption and raises."""
    text = path.read_text()
    lines = [line for line in text.split("\n") if line.strip()]
    records = []
    for i, line in enumerate(lines):
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            last, repaired = i == len(lines) - 1, lines[i + 1:i + 2] == [json.dumps(REPAIRED)]
            if not (repaired or last and not text.endswith("\n")):
                raise
            print(f"megaresil: warning: {path}: ignoring a torn line ({line[:40]!r}...)",
                  file=sys.stderr)
            continue
        if record != REPAIRED:
            records.append(record)
    return records


def read_events(run_dir: str | Path) -> list[dict]:
    path = Path(run_dir) / "events.jsonl"
    return read_jsonl(path) if path.exists() else []


def read_metrics(run_dir: str | Path) -> list[dict]:
    path = Path(run_dir) / "metrics.jsonl"
    return read_jsonl(path) if path.exists() else []
