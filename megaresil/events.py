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


class EventLog:
    """Appends events from any rank. Each line is written with one O_APPEND
    write, so lines from concurrent ranks never interleave."""

    def __init__(self, run_dir: str | Path, rank: Optional[int] = None):
        self.path = Path(run_dir) / "events.jsonl"
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.rank = rank

    def emit(self, event: str, **fields: Any) -> dict:
        record = {"time": time.time(), "event": event}
        if self.rank is not None:
            record["rank"] = self.rank
        record.update(fields)
        line = (repair_prefix(self.path) + json.dumps(record) + "\n").encode()
        fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.write(fd, line)
        finally:
            os.close(fd)
        return record


# Written after a torn last line is ended, so readers tell that line (lost,
# skipped) from corruption in the middle of the file (refused).
REPAIRED = {"repaired_torn_line": True}


def repair_prefix(path: Path) -> str:
    """What to write before appending to a JSON Lines file: when its last
    line is torn (a short write on a full disk, a power cut), a newline and
    the REPAIRED record, so the new line starts on a line of its own and
    only the torn one is lost."""
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            if f.tell() == 0:
                return ""
            f.seek(-1, os.SEEK_END)
            return "" if f.read(1) == b"\n" else "\n" + json.dumps(REPAIRED) + "\n"
    except FileNotFoundError:
        return ""


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
